"""What the edges share (header forwarding, body parsing, the end-of-exchange hook), and the
passthrough: any path that is not an LLM call goes straight to a backend.

The LLM calls themselves are http/edges.py's: each is handed to the gateway, which owns it from
then on.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import trio
from quart import Response, request
from werkzeug.datastructures import Headers

from ..backends import UpstreamRequest, UpstreamResponse
from ..errors import BackendError, InvalidRequest
from ..gateway import Gateway

DEFAULT_PROGRAM = "default"
MAX_PROGRAM_ID_CHARS = 256

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
    scope: dict[str, Any] = request.scope  # type: ignore[assignment]
    scope.setdefault(CLEANUP_KEY, []).append(cleanup)


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
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise InvalidRequest(
            "Request body is not valid UTF-8; send JSON encoded as UTF-8."
        ) from None
    except ValueError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("Request body must be a JSON object.")
    return body


def extract_program_id(body: dict[str, Any], header: str | None) -> str:
    """Take the program id from the body, ``extra_body`` or ``X-Program-Id`` (in that order) and
    strip it from the body, so the backend never sees a field it does not know."""
    found: list[Any] = []
    if "program_id" in body:
        found.append(body.pop("program_id"))
    extra = body.get("extra_body")
    if isinstance(extra, dict) and "program_id" in extra:
        found.append(extra.pop("program_id"))
        if not extra:
            del body["extra_body"]
    if header is not None:
        found.append(header)
    if not found:
        return DEFAULT_PROGRAM
    program_id = found[0]
    if not isinstance(program_id, str) or not program_id.strip():
        raise InvalidRequest("program_id must be a non-empty string.", param="program_id")
    if len(program_id) > MAX_PROGRAM_ID_CHARS:
        raise InvalidRequest(
            f"program_id is longer than {MAX_PROGRAM_ID_CHARS} characters.", param="program_id"
        )
    return program_id


def context_chars(body: dict[str, Any]) -> int:
    """Characters of prompt text in a chat or completion request (the seed's context_len)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        total = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(
                    len(part.get("text", ""))
                    for part in content
                    if isinstance(part, dict) and isinstance(part.get("text"), str)
                )
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) for p in prompt if isinstance(p, str))
    return 0


def validate_completion_body(body: dict[str, Any], endpoint: str) -> None:
    if endpoint.endswith("chat/completions") and not isinstance(body.get("messages"), list):
        raise InvalidRequest("'messages' must be a list of chat messages.", param="messages")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise InvalidRequest("'stream' must be true or false.", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options")


def response_headers(headers: Iterable[tuple[str, str]]) -> Headers:
    return Headers(forward_headers(headers, drop=RESPONSE_OWN))


#: Set on a request's scope once the gateway owns its call: the gateway records the outcome,
#: so the app's error handler must not record it again as a rejection.
RECORDED_KEY = "thunderproxy.recorded"


class Proxy:
    def __init__(self, *, gateway: Gateway, read_timeout: float) -> None:
        self.gateway = gateway
        self.pool = gateway.pool
        self.read_timeout = read_timeout

    async def passthrough(self, path: str) -> Response:
        """Any other path: relayed unchanged to the program's backend or the first healthy one.
        Not an LLM call: nothing is scheduled or recorded."""
        program_id = request.headers.get("x-program-id")
        program = None if program_id is None else self.gateway.scheduler.registry.find(program_id)
        node = self.pool.get(program.backend) if program is not None else None
        if node is None or not node.healthy:
            node = self.pool.first_healthy()
        target = path
        if request.query_string:
            target += "?" + request.query_string.decode("latin-1")
        upstream = UpstreamRequest(
            request.method,
            target,
            forward_headers(request.headers.items()),
            await request.get_data(False, False, False),
        )
        try:
            with trio.fail_after(self.gateway.first_byte_timeout):
                response = await node.backend.send(upstream)
        except trio.TooSlowError:
            error = self.gateway.timeout(node)
            node.health.failed(error)
            raise error from None
        except BackendError as exc:
            node.health.failed(exc)
            raise
        node.health.answered(response.status_code)
        on_request_end(response.aclose)
        return Response(
            relay(response, self.read_timeout),
            status=response.status_code,
            headers=response_headers(response.headers),
        )


async def relay(response: UpstreamResponse, read_timeout: float) -> AsyncIterator[bytes]:
    """A passthrough body, chunk by chunk; a backend gone silent past ``read_timeout`` ends it."""
    chunks = response.aiter_raw()
    while True:
        try:
            with trio.fail_after(read_timeout):
                chunk = await chunks.__anext__()
        except (StopAsyncIteration, trio.TooSlowError, BackendError):
            return
        yield chunk
