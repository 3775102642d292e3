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
- the request checks both paths ask (http/checks.py): 503 while draining (``ShuttingDown``),
  431 past ``--max-header-bytes``, 413 past ``--max-body-bytes``, 408 when the body is slower
  than ``--client-timeout``, 401 without a configured client's key (``ClientUnauthorized``,
  http/clients.py), 503 until the backends are ready (``NotReady``); both after the body is
  read so the connection stays usable;
- errors through the one table (errors.py) in the route's protocol shape, recorded as a
  rejection (``RejectionRecord.refused``) unless the gateway already recorded the call; any
  other exception a 500;
- ``Connection: close`` on answers given while draining;
- a client that leaves cancels the exchange (the gateway records 499 and closes the lease).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable
from werkzeug.exceptions import InternalServerError

from ..audit.records import RejectionRecord
from ..errors import BodyIncomplete, ThunderproxyError
from ..protocols import Protocol
from .checks import (
    Bounds,
    body_incomplete,
    body_too_large,
    body_too_slow,
    declared_length,
    declared_too_large,
    header_items,
    refuse_head,
)
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

#: Records a refusal that the gateway did not record (``AuditLog.record``).
Reject = Callable[[RejectionRecord], None]


class FastRoutes:
    """Serves ``FAST_ROUTES`` as raw ASGI over the edges (see the module's docstring)."""

    def __init__(
        self,
        *,
        edges: Edges,
        drain: Drain,
        readiness: Readiness,
        reject: Reject,
        bounds: Bounds,
        clients: Clients | None = None,
    ) -> None:
        self.edges = edges
        self.clients = clients or edges.clients
        self.drain = drain
        self.readiness = readiness
        self.reject = reject
        self.bounds = bounds

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
        items = header_items(scope)
        try:
            refusal = refuse_head(scope, items, draining=self.drain.draining, bounds=self.bounds)
            if refusal is not None:
                raise refusal
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
        bounds = self.bounds
        refusal = declared_too_large(items, bounds)
        if refusal is not None:
            raise refusal
        parts: list[bytes] = []
        size = 0
        with trio.move_on_after(bounds.client_timeout) as scope:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise body_incomplete(size, declared_length(items))
                part: bytes = message.get("body", b"")  # type: ignore[assignment]
                size += len(part)
                refusal = body_too_large(size, bounds)
                if refusal is not None:
                    raise refusal
                parts.append(part)
                if not message.get("more_body", False):
                    break
        if scope.cancelled_caught:
            raise body_too_slow(bounds.client_timeout)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _record(self, scope: dict[str, Any], error: ThunderproxyError) -> None:
        """A ``rejections`` row for a request refused before the gateway had it."""
        if not scope.get(RECORDED_KEY):  # the gateway recorded the calls it was given
            self.reject(
                RejectionRecord.refused(
                    error,
                    at=trio.current_time(),
                    method="POST",
                    path=scope["path"],
                    program_id=error.program_id,
                    client=client_of(scope),
                )
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
