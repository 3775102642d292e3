"""What the edges share (header forwarding, body parsing, the end-of-exchange hook), and the
passthrough: any path that is not an LLM call goes straight to a backend.

The LLM calls themselves are http/edges.py's: each is handed to the gateway, which owns it from
then on.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from contextlib import aclosing
from typing import Any

import trio
from quart import Response, request
from werkzeug.datastructures import Headers

from ..backends import UpstreamRequest, UpstreamResponse
from ..errors import BackendError, InvalidRequest
from ..gateway import Gateway
from .clients import Clients, client_of, scoped
from .guard import DEFAULT_GUARD, PassthroughGuard
from .streaming import is_streaming
from .validate import load_json

#: RFC 9110 hop-by-hop headers, plus the ones the proxy recomputes for each hop.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
    }
)
#: Set by our own server on the way back; the backend's copies would be duplicates.
RESPONSE_OWN = frozenset({"date", "server"})

CLEANUP_KEY = "thunderproxy.cleanup"
Cleanup = Callable[[], Awaitable[None]]


def on_request_end(cleanup: Cleanup) -> None:
    """Run ``cleanup`` when this HTTP exchange ends, even if the client vanished before the
    response body was ever started (see http/app.py's connection class)."""
    add_cleanup(request.scope, cleanup)  # type: ignore[arg-type]


def add_cleanup(scope: dict[str, Any], cleanup: Cleanup) -> None:
    """``on_request_end`` for code that holds the ASGI scope itself (http/fastpath.py)."""
    scope.setdefault(CLEANUP_KEY, []).append(cleanup)


async def run_cleanups(scope: dict[str, Any]) -> None:
    """Run the exchange's cleanups as it ends, each shielded: the end may be a cancellation."""
    for cleanup in scope.get(CLEANUP_KEY, ()):
        with trio.CancelScope(shield=True):
            await cleanup()


def forward_headers(
    headers: Iterable[tuple[str, str]], *, drop: frozenset[str] = frozenset()
) -> list[tuple[str, str]]:
    items = list(headers)
    listed = {
        token.strip().lower()
        for name, value in items
        if name.lower() == "connection"
        for token in value.split(",")
    }
    skip = HOP_BY_HOP | listed | drop
    return [(name, value) for name, value in items if name.lower() not in skip]


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = load_json(raw)
    except UnicodeDecodeError:
        raise InvalidRequest(
            "Request body is not valid UTF-8; send JSON encoded as UTF-8."
        ) from None
    except ValueError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("Request body must be a JSON object.")
    return body


def response_headers(headers: Iterable[tuple[str, str]]) -> Headers:
    return Headers(forward_headers(headers, drop=RESPONSE_OWN))


#: Set on a request's scope once the gateway owns its call: the gateway records the outcome,
#: so the app's error handler must not record it again as a rejection.
RECORDED_KEY = "thunderproxy.recorded"


class Proxy:
    def __init__(
        self,
        *,
        gateway: Gateway,
        read_timeout: float,
        guard: PassthroughGuard = DEFAULT_GUARD,
        clients: Clients | None = None,
    ) -> None:
        self.gateway = gateway
        self.pool = gateway.pool
        self.read_timeout = read_timeout
        self.guard = guard
        #: With client keys, the caller was identified before (http/app.py) and its key is
        #: withheld from the backend.
        self.clients = clients

    async def passthrough(self, path: str) -> Response:
        """Any other path under --passthrough: relayed to the program's backend or the first
        healthy one. Not an LLM call: nothing is scheduled or recorded. Checked before a backend
        is chosen, so a refused path never costs one."""
        authorization = request.headers.get("authorization")
        path = self.guard.check(path, authorization)
        drop = frozenset({"authorization"} if self.guard.carries_admin_token(authorization) else ())
        program_id = request.headers.get("x-program-id")
        if program_id is not None:
            program_id = scoped(client_of(request.scope), program_id)
        program = None if program_id is None else self.gateway.scheduler.registry.find(program_id)
        node = self.pool.get(program.backend) if program is not None else None
        if node is None or not node.healthy:
            node = self.pool.first_healthy()
        headers = forward_headers(request.headers.items(), drop=drop)
        if self.clients is not None and self.clients.enabled:
            headers, client_key = self.clients.withheld(headers)
            headers = self.gateway.upstream_headers(node, headers, client_key)
        target = path
        if request.query_string:
            target += "?" + request.query_string.decode("latin-1")
        upstream = UpstreamRequest(
            request.method,
            target,
            headers,
            await request.get_data(False, False, False),
        )
        response = await self.gateway.send(node, upstream)
        on_request_end(response.aclose)
        answer_headers = response_headers(response.headers)
        length = plain_length(response.headers)
        if length is not None:
            answer_headers["content-length"] = length
        # Streams and plain answers alike go out chunk by chunk as they arrive: a client may be
        # reading a stream as it is produced, and holding a plain answer whole would cost its
        # size in memory per request (10 answers of 60 MB: 600 MB). A plain answer keeps the
        # backend's Content-Length, so a client can tell one cut short.
        body = relay(response, self.read_timeout)
        return Response(body, status=response.status_code, headers=answer_headers)


def plain_length(headers: Iterable[tuple[str, str]]) -> str | None:
    """The backend's Content-Length of a plain answer (digits only), to send on with it."""
    items = list(headers)
    if is_streaming(items):
        return None
    for name, value in items:
        if name.lower() == "content-length" and value.isascii() and value.isdigit():
            return value
    return None


async def relay(response: UpstreamResponse, read_timeout: float) -> AsyncGenerator[bytes, None]:
    """A passthrough body, chunk by chunk; a backend gone silent past ``read_timeout`` ends it."""
    # Closed here, however the relay ends (a client that leaves included), not by the GC.
    async with aclosing(response.aiter_raw()) as chunks:  # type: ignore[type-var]
        while True:
            try:
                with trio.fail_after(read_timeout):
                    chunk = await chunks.__anext__()
            except (StopAsyncIteration, trio.TooSlowError, BackendError):
                return
            yield chunk
