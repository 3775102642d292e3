"""The LLM routes as raw ASGI, in front of Quart.

``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/messages`` and ``/v1/responses`` are
most of what the proxy serves, and each used to pay for Quart's machinery: a ``Request`` and
its werkzeug headers, the request context, two tasks and a nursery per request (quart-trio),
URL routing, the before- and after-request hooks, a ``Response`` and its body wrapper, and one
more generator layer per relayed chunk. Here the ASGI scope goes straight to the same edge
(``Edges.handle``), and each chunk straight to the server's ``send``. Everything else (the
admin and listing routes, count_tokens, the passthrough, the council) still goes to Quart.
What it saved, and how much of a call's cost is the server's own: docs/BENCHMARKS.md, "Per
request: where the CPU goes".

What the Quart route did around the edge is done here too, in the same order, so both paths
answer alike (tests/http/test_relay_fastpath.py checks that these paths take this one):

- the drain's count of exchanges, and the exchange's cleanups run however it ends;
- 503 while draining (``ShuttingDown``), 431 past ``--max-header-bytes``, 413 past
  ``--max-body-bytes``, 408 when the body is slower than ``--client-timeout``, 401 without a
  configured client's key (``ClientUnauthorized``, http/clients.py), 503 until the backends
  are ready (``NotReady``); both after the body is read so the connection stays usable;
- errors through the one table (errors.py) in the route's protocol shape, recorded as a
  rejection unless the gateway already recorded the call; any other exception a 500;
- ``Connection: close`` on answers given while draining;
- a client that leaves cancels the exchange (the gateway records 499 and closes the lease).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import aclosing
from typing import Any

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable
from werkzeug.exceptions import InternalServerError

from ..errors import (
    BodyIncomplete,
    HeadersTooLarge,
    PayloadTooLarge,
    RequestTimeout,
    ShuttingDown,
    ThunderproxyError,
    describe,
    reason,
)
from ..protocols import Protocol
from .clients import CLIENT_KEY, Clients, client_of
from .drain import Drain
from .edges import Edges, Reply
from .errors import error_parts
from .proxy import RECORDED_KEY, run_cleanups
from .readiness import Readiness

log = logging.getLogger("thunderproxy.http")

#: The paths served here, and the protocol each speaks (POST only; anything else is Quart's).
FAST_ROUTES: dict[str, Protocol] = {
    "/v1/chat/completions": Protocol.CHAT,
    "/v1/completions": Protocol.COMPLETIONS,
    "/v1/messages": Protocol.MESSAGES,
    "/v1/responses": Protocol.RESPONSES,
}

#: An ASGI scope extension a server may offer (the front does, http/front.py): an async callable
#: that takes one body chunk with more to come, and does what ``send`` does with
#: ``{"type": "http.response.body", "body": chunk, "more_body": True}``. A relayed chunk then
#: costs no message to build and take apart; a server without it (Hypercorn) gets the messages.
BODY_WRITER = "thunderproxy.body_writer"

#: Reports a refusal that the gateway did not record: status, OpenAI type, message, program id,
#: method, path, reason (``errors.reason``), the client (``[clients]``; None: not identified).
Reject = Callable[[int, str, str, "str | None", str, str, str, "str | None"], None]


def payload_too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"Request body is larger than {limit} bytes (see --max-body-bytes).")


def body_incomplete(received: int, declared: str | None) -> BodyIncomplete:
    of = f" of the {declared} its Content-Length declared" if declared is not None else ""
    return BodyIncomplete(
        f"The client closed the connection after sending {received} body bytes{of}, before "
        "its body was whole; nothing was sent to a backend."
    )


def body_too_slow(timeout: float) -> RequestTimeout:
    return RequestTimeout(f"Request body not received within {timeout} s (see --client-timeout).")


def headers_too_large(size: int, limit: int) -> HeadersTooLarge:
    return HeadersTooLarge(
        f"Request headers are {size} bytes, more than {limit} (see --max-header-bytes)."
    )


def shutting_down() -> ShuttingDown:
    return ShuttingDown(
        "thunderproxy is shutting down (SIGTERM/SIGINT) and did not start this request; "
        "retry it after Retry-After, on another instance or once this one is back."
    )


def request_line_size(scope: Mapping[str, Any]) -> int:
    """The request line's bytes (``POST /path?query HTTP/1.1``, CRLF): part of the head the
    limit bounds. Left out, a 60 KB URL passed a limit of 8 KB."""
    target = len(scope.get("raw_path") or scope["path"].encode())
    query = scope.get("query_string") or b""
    if query:
        target += 1 + len(query)
    return len(scope["method"]) + 1 + target + len(" HTTP/1.1\r\n")


def header_size(items: list[tuple[str, str]], scope: dict[str, Any]) -> int:
    """The request head's size as ``--max-header-bytes`` counts it: the request line and the
    headers. Quart's request adds a ``Remote-Addr`` header of its own, which the limit has
    always counted: counted here too, so that a head is refused on one path exactly when it is
    on the other."""
    size = sum(len(name) + len(value) + 4 for name, value in items)
    remote = (scope.get("client") or ["<local>"])[0]
    return request_line_size(scope) + size + len("Remote-Addr") + len(remote) + 4


class FastRoutes:
    """Serves ``FAST_ROUTES`` as raw ASGI over the edges (see the module's docstring)."""

    def __init__(
        self,
        *,
        edges: Edges,
        drain: Drain,
        readiness: Readiness,
        reject: Reject,
        max_body_bytes: int,
        max_header_bytes: int,
        client_timeout: float,
        clients: Clients | None = None,
    ) -> None:
        self.edges = edges
        self.clients = clients or edges.clients
        self.drain = drain
        self.readiness = readiness
        self.reject = reject
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.client_timeout = client_timeout

    @staticmethod
    def route(scope: Any) -> Protocol | None:
        """The protocol of a request this path serves, or None for Quart."""
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            return None
        return FAST_ROUTES.get(scope["path"])

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        protocol: Protocol,
    ) -> None:
        with self.drain.exchange():
            try:
                await self._exchange(scope, receive, send, protocol)
            finally:
                await run_cleanups(scope)

    async def _exchange(
        self,
        scope: dict[str, Any],
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        protocol: Protocol,
    ) -> None:
        arrived_at = trio.current_time()
        path: str = scope["path"]
        items = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in scope["headers"]]
        try:
            if self.drain.draining:
                raise shutting_down()
            size = header_size(items, scope)
            if size > self.max_header_bytes:
                raise headers_too_large(size, self.max_header_bytes)
            raw = await self._read_body(receive, items)
            if self.clients.enabled:
                scope[CLIENT_KEY] = self.clients.identify(items)
            self.readiness.check()
        except BodyIncomplete as error:
            # Nothing was started and nobody is left to answer, but the request was made:
            # its row says how far it got.
            self._record(scope, error)
            return
        except ThunderproxyError as error:
            await self._refuse(scope, send, error, protocol)
            return
        # From here the only thing left to receive is the client's disconnect: one task waits
        # for it and cancels the exchange (quart-trio ran two tasks and a nursery for this).
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            try:
                reply = await self.edges.handle(protocol, path, raw, items, scope, arrived_at)
            except ThunderproxyError as error:
                await self._refuse(scope, send, error, protocol)
            except Exception:
                # As Quart answers an unexpected fault: logged, and a 500 through the table.
                log.exception("Exception on request POST %s", path)
                fault = ThunderproxyError(InternalServerError.description or "internal error")
                await self._refuse(scope, send, fault, protocol)
            else:
                writer = (scope.get("extensions") or {}).get(BODY_WRITER)
                await self._send_reply(send, reply, writer)
            nursery.cancel_scope.cancel()

    async def _read_body(self, receive: ASGIReceiveCallable, items: list[tuple[str, str]]) -> bytes:
        """The whole body, bounded like Quart's; BodyIncomplete if the client left first."""
        limit = self.max_body_bytes
        declared: str | None = None
        for name, value in items:
            if name.lower() == "content-length":
                declared = value
            # ASCII digits only (``"²".isdigit()`` holds, and ``int("²")`` raises), compared by
            # length first (``int`` refuses more than 4,300 digits).
            if (
                name.lower() == "content-length"
                and value.isascii()
                and value.isdigit()
                and (len(value) > len(str(limit)) or int(value) > limit)
            ):
                raise payload_too_large(limit)
        parts: list[bytes] = []
        size = 0
        with trio.move_on_after(self.client_timeout) as scope:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise body_incomplete(size, declared)
                part: bytes = message.get("body", b"")  # type: ignore[assignment]
                size += len(part)
                if size > limit:
                    raise payload_too_large(limit)
                parts.append(part)
                if not message.get("more_body", False):
                    break
        if scope.cancelled_caught:
            raise body_too_slow(self.client_timeout)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _record(self, scope: dict[str, Any], error: ThunderproxyError) -> None:
        """A ``rejections`` row for a request refused before the gateway had it."""
        if not scope.get(RECORDED_KEY):  # the gateway recorded the calls it was given
            status, error_type = describe(error)
            self.reject(
                status,
                error_type,
                error.message,
                error.program_id,
                "POST",
                scope["path"],
                reason(error),
                client_of(scope),
            )

    async def _refuse(
        self,
        scope: dict[str, Any],
        send: ASGISendCallable,
        error: ThunderproxyError,
        protocol: Protocol,
    ) -> None:
        status, headers, content = error_parts(error, protocol)
        self._record(scope, error)
        await self._send_reply(send, Reply(status, list(headers.items()), content))

    async def _send_reply(
        self,
        send: ASGISendCallable,
        reply: Reply,
        write_body: Callable[[bytes], Awaitable[None]] | None = None,
    ) -> None:
        # As Quart encodes them (UTF-8), so that both paths send the same bytes.
        headers = [(n.lower().encode(), v.encode()) for n, v in reply.headers]
        body = reply.body
        if isinstance(body, bytes):
            # What Quart's Response adds to a whole body: its length, and its default type.
            if not any(n == b"content-type" for n, _ in headers):
                headers.append((b"content-type", b"text/html; charset=utf-8"))
            headers.append((b"content-length", b"%d" % len(body)))
        if self.drain.draining:
            # A client must not send its next request on a connection about to close.
            headers = [(n, v) for n, v in headers if n != b"connection"]
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        if not isinstance(body, bytes):
            async with aclosing(body) as chunks:
                if write_body is not None:
                    async for chunk in chunks:
                        await write_body(chunk)
                else:
                    async for chunk in chunks:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
            body = b""
        # Shielded: sending the last body makes Hypercorn recycle the connection (see
        # ProxyHTTPConnection in http/app.py for why this send must not be cancelled).
        with trio.CancelScope(shield=True):
            await send({"type": "http.response.body", "body": body, "more_body": False})


async def _cancel_on_disconnect(receive: ASGIReceiveCallable, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
