"""The ASGI middleware in front of the proxy's app in worker mode: one seam for every route.

In order, for each HTTP request: unwrap and verify the autoscaler's signature (``{"auth_data",
"payload"}`` bodies, ``serverless_*`` query parameters), refuse replays, refuse work whose
estimated wait is too long (429), take its turn under ``--no-parallel``, then hand the plain
request to the app and count its workload by how it ended. ``GET /health`` is answered without a
signature, with the worker's phase and error added, so a failed worker stays visible.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import trio
from hypercorn.typing import ASGIFramework

from ..http.errors import error_body
from ..http.validate import MAX_JSON_DEPTH, deeper_than
from .auth import (
    QUERY_PREFIX,
    AuthData,
    AuthDataError,
    binding_mismatch,
    own_origins,
    payload_bytes,
    signature_valid,
)
from .ledger import Outcome
from .state import Phase, WorkerState

log = logging.getLogger("thunderproxy.worker")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Any
Send = Any

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
#: Answered without a signature: read-only, and what an operator needs when all else fails.
OPEN_PATHS = frozenset({"/health"})
#: How deep a body's arrays and objects may nest: what the app takes, plus the ``{"auth_data",
#: "payload"}`` wrapper's level. Deeper is refused before it is parsed any further (a body
#: nested 200,000 deep made the parser raise RecursionError: a bare 500).
MAX_BODY_DEPTH = MAX_JSON_DEPTH + 1


class Refusal(Exception):
    """A request the worker answers itself, with an OpenAI-shaped error."""

    def __init__(
        self,
        status: int,
        error_type: str,
        message: str,
        *,
        event: str,
        workload: float | None = None,
        reqnum: int | None = None,
        retry_after: float | None = None,
        request_idx: int | None = None,
    ) -> None:
        super().__init__(message)
        self.request_idx = request_idx
        self.status = status
        self.error_type = error_type
        self.message = message
        self.event = event
        self.workload = workload
        self.reqnum = reqnum
        self.retry_after = retry_after


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    extra: list[tuple[bytes, bytes]] = (),  # type: ignore[assignment]
) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The whole request body, and whether the client left while sending it."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks), True
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise Refusal(
                413,
                "invalid_request_error",
                f"Request body is larger than {limit} bytes (see --max-body-bytes).",
                event="rejected",
            )
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False


def _strip_auth_params(query: bytes) -> tuple[dict[str, str], bytes]:
    """The ``serverless_*`` parameters, and the query string without them (the others kept
    byte for byte, so the backend sees exactly what the client sent)."""
    from urllib.parse import unquote_plus

    auth: dict[str, str] = {}
    kept: list[bytes] = []
    for part in query.split(b"&") if query else []:
        raw_key, _, raw_value = part.partition(b"=")
        key = unquote_plus(raw_key.decode("latin-1"))
        if key.startswith(QUERY_PREFIX):
            auth[key] = unquote_plus(raw_value.decode("latin-1"))
        else:
            kept.append(part)
    return auth, b"&".join(kept)


def _with_body(scope: Scope, body: bytes) -> Scope:
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    return {**scope, "headers": headers}


class WorkerMiddleware:
    def __init__(self, app: ASGIFramework, state: WorkerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and self.state.secured:
            # A websocket carries no auth_data: none may bypass the signature check.
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
            self.state.event("unsigned", "websocket refused: it cannot carry a signature")
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # type: ignore[arg-type]
            return
        if scope["path"] in OPEN_PATHS and scope["method"] in ("GET", "HEAD"):
            await self._health(scope, receive, send)
            return
        try:
            scope, receive, auth = await self._admit(scope, receive)
        except Refusal as refusal:
            await self._refuse(scope, send, refusal)
            return
        await self._serve(scope, receive, send, auth)

    # -- admission -------------------------------------------------------------------------

    async def _admit(
        self, scope: Scope, receive: Receive
    ) -> tuple[Scope, Receive, AuthData | None]:
        state = self.state
        auth: AuthData | None = None
        method = scope["method"]
        #: What a signed body digest binds: the body the app gets, or the query it gets.
        signed = b""
        try:
            if method in BODY_METHODS:
                body, gone = await _read_body(receive, state.config.max_body_bytes)
                auth, body = self._unwrap(body)
                scope = _with_body(scope, body)
                receive = _replay_body(body, gone, receive)
                signed = body
            else:
                params, query = _strip_auth_params(scope.get("query_string", b""))
                if params:
                    auth = AuthData.from_query(params)
                    scope = {**scope, "query_string": query}
                    signed = query
        except AuthDataError as exc:
            # 401 in --unsecured mode too: a signature was offered, and it is not readable.
            raise Refusal(
                401,
                "authentication_error",
                f"Malformed autoscaler signature data: {exc}.",
                event="signature_failed",
            ) from None
        if auth is None:
            if state.secured:
                raise Refusal(
                    401,
                    "authentication_error",
                    "Unsigned request refused: this worker serves only requests signed by the "
                    'autoscaler ({"auth_data", "payload"} bodies, serverless_* query '
                    "parameters). Start with --unsecured for local development.",
                    event="unsigned",
                    workload=1.0,
                )
            return scope, receive, None
        if state.secured:
            self._verify(auth, scope, signed)
        return scope, receive, auth

    def _unwrap(self, body: bytes) -> tuple[AuthData | None, bytes]:
        try:
            data = json.loads(body) if body else None
        except RecursionError:
            raise _too_deep() from None
        except (ValueError, UnicodeDecodeError):
            return None, body
        # Few brackets cannot nest deep; past them the depth is measured level by level.
        brackets = body.count(b"[") + body.count(b"{")
        if brackets > MAX_BODY_DEPTH and deeper_than(data, MAX_BODY_DEPTH):
            raise _too_deep()
        if not isinstance(data, dict) or "auth_data" not in data:
            return None, body
        if "payload" not in data:
            raise AuthDataError("the body has auth_data but no payload")
        auth = AuthData.from_json(data["auth_data"])
        return auth, payload_bytes(data["payload"])

    def _verify(self, auth: AuthData, scope: Scope, body: bytes) -> None:
        state = self.state
        path = scope["path"]
        key = state.public_key
        workload = auth.workload
        if key is None:
            raise Refusal(
                503,
                "service_unavailable",
                "The autoscaler's signing key has not been fetched yet "
                f"({state.key_error or 'first fetch in progress'}); signed requests are refused "
                "until it is. The worker keeps retrying from "
                + ", ".join(a + "/pubkey/" for a in state.config.report_addrs)
                + ".",
                event="no_signing_key",
                workload=workload,
                reqnum=auth.reqnum,
                retry_after=5,
            )
        replayed = state.replay.check(auth.reqnum)
        if replayed is not None:
            raise Refusal(
                401, "authentication_error", f"Refused: {replayed}.",
                event="replay", workload=workload, reqnum=auth.reqnum,
            )  # fmt: skip
        if not signature_valid(key, auth):
            raise Refusal(
                401,
                "authentication_error",
                f"Invalid autoscaler signature for reqnum {auth.reqnum}: the request was not "
                "signed by the autoscaler whose key this worker fetched.",
                event="signature_failed",
                workload=workload,
                reqnum=auth.reqnum,
            )
        origins = own_origins(
            state.config.public_url, scope.get("scheme", "http"), scope.get("server")
        )
        mismatch = binding_mismatch(auth, origins=origins, path=path, body=body)
        if mismatch is not None:
            event, why = mismatch
            # Not remembered as seen: it was not served, and the worker, route and body it was
            # signed for may still come.
            raise Refusal(
                401,
                "authentication_error",
                f"Refused reqnum {auth.reqnum}: {why}. A signature is good only for the "
                "worker, route and body it was signed for.",
                event=event,
                workload=workload,
                reqnum=auth.reqnum,
            )
        state.accepted(auth.reqnum, auth.request_idx, path)

    async def _refuse(self, scope: Scope, send: Send, refusal: Refusal) -> None:
        state = self.state
        if refusal.workload is not None:
            state.ledger.reject(refusal.workload, refusal.request_idx)
        # Debug only: refusals can come in floods; each one is a worker_events row anyway.
        log.debug("refused %s %s: %s", scope["method"], scope["path"], refusal.message)
        state.event(
            refusal.event,
            refusal.message,
            reqnum=refusal.reqnum,
            workload=refusal.workload,
            status=refusal.status,
            data={"method": scope["method"], "path": scope["path"]},
        )
        extra = []
        if refusal.retry_after is not None:
            extra.append((b"retry-after", str(max(1, math.ceil(refusal.retry_after))).encode()))
        body = error_body(refusal.message, error_type=refusal.error_type, status=refusal.status)
        await _respond(send, refusal.status, body, extra)

    # -- serving ---------------------------------------------------------------------------

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, auth: AuthData | None
    ) -> None:
        state = self.state
        ledger = state.ledger
        workload = 1.0 if auth is None else auth.workload
        reqnum = None if auth is None else auth.reqnum
        wait = ledger.would_wait_too_long(state.config.max_wait_time)
        if wait is not None:
            await self._refuse(
                scope,
                send,
                Refusal(
                    429,
                    "rate_limit_error",
                    f"This worker's estimated wait is {wait:.1f} s (pending workload "
                    f"{ledger.pending:g} at {ledger.max_throughput:g}/s), over --max-wait-time "
                    f"{state.config.max_wait_time:g} s; retry later or on another worker.",
                    event="queue_full",
                    workload=workload,
                    reqnum=reqnum,
                    retry_after=wait - state.config.max_wait_time,
                    # Verified (or unsecured): the autoscaler may drop it from its books.
                    request_idx=None if auth is None else auth.request_idx,
                ),
            )
            return
        ticket = ledger.start(workload, None if auth is None else auth.request_idx)
        status: int | None = None
        complete = False
        disconnected = False

        async def watch_receive() -> Message:
            nonlocal disconnected
            message: Message = await receive()
            if message["type"] == "http.disconnect" and not complete:
                disconnected = True
            return message

        async def watch_send(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                complete = True
            await send(message)

        outcome = Outcome.ERRORED
        try:
            if state.config.parallel:
                await self.app(scope, watch_receive, watch_send)  # type: ignore[arg-type]
            else:
                async with state.turn:
                    await self.app(scope, watch_receive, watch_send)  # type: ignore[arg-type]
            if complete and status is not None:
                # 499: the proxy's own word for a client that left before the answer.
                if status == 499:
                    outcome = Outcome.CANCELLED
                elif status < 500:
                    outcome = Outcome.SERVED
            elif disconnected:
                outcome = Outcome.CANCELLED
        except trio.Cancelled:
            outcome = Outcome.CANCELLED
            raise
        finally:
            if disconnected and outcome is Outcome.ERRORED and not complete:
                outcome = Outcome.CANCELLED
            ledger.finish(ticket, outcome)

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app's /health with a ``worker`` section; 503 while the worker is a beacon."""
        head: Message = {}
        chunks: list[bytes] = []

        async def buffer(message: Message) -> None:
            if message["type"] == "http.response.start":
                head.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, buffer)  # type: ignore[arg-type]
        try:
            health = json.loads(b"".join(chunks))
        except ValueError:
            health = {}
        state = self.state
        health["worker"] = state.health_view()
        status = head.get("status", 200)
        if state.phase is Phase.ERRORED:
            health["status"] = "error"
            status = 503
        body = json.dumps(health).encode()
        await _respond(send, status, b"" if scope["method"] == "HEAD" else body)


def _too_deep() -> Refusal:
    return Refusal(
        400,
        "invalid_request_error",
        f"Request body nests arrays and objects more than {MAX_BODY_DEPTH} levels deep "
        "(the auth_data/payload wrapper included); send a flatter body.",
        event="rejected",
    )


def _replay_body(body: bytes, gone: bool, receive: Receive) -> Receive:
    """A receive that hands the app ``body`` once (or the disconnect that cut it short), then
    defers to the real one, so the app still learns when the client leaves."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            if gone:
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": body, "more_body": False}
        message: Message = await receive()
        return message

    return replay
