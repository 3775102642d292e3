"""``create_app``: the Quart-Trio app. Its routes are blueprints (http/routes/), registered
in order: the LLM APIs, the readouts, the admin route, then the passthrough for any other path;
the council's joins them in the runtime. The checks every request passes before a route are the
app's hooks here, asking the one module of request checks (http/checks.py) that the LLM routes'
fast path in front of Quart (http/fastpath.py) asks too; every refusal either records is a
``RejectionRecord.refused`` row."""

from __future__ import annotations

from typing import Any

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable
from quart import Request, Response, has_request_context, request, websocket
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from ..audit.records import RejectionRecord
from ..errors import ThunderproxyError
from .checks import (
    Bounds,
    body_incomplete,
    header_items,
    needs_backend,
    needs_client,
    quart_refusal,
    refuse_head,
)
from .clients import CLIENT_KEY, Clients, client_of
from .drain import Drain
from .edges import Edges, error_shape
from .errors import error_response
from .fastpath import FastRoutes, Reject
from .guard import PassthroughGuard, parse_prefixes
from .proxy import RECORDED_KEY, Proxy, run_cleanups
from .routes import admin, llm, passthrough, readouts
from .services import Services

__all__ = ["ProxyHTTPConnection", "Services", "ThunderproxyApp", "create_app"]


class ProxyHTTPConnection(TrioASGIHTTPConnection):
    """Runs the exchange's cleanups however it ends. Quart closes a streamed body only once it
    has started sending it; a client that leaves earlier would otherwise leave a step open."""

    #: Whether the answer has started: a request answered before its body was read (a refusal)
    #: has its row already.
    answered = False

    async def __call__(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        drain: Drain = self.app.drain  # type: ignore[attr-defined]

        async def send_end_shielded(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.answered = True
            # Sending the last body makes Hypercorn recycle the connection: it reports the
            # disconnect, on which quart-trio cancels this exchange, then starts the watcher
            # that closes the idle connection on shutdown. Started in a cancelled scope, that
            # watcher died at once, and one idle client held every stop for the whole grace.
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        try:
            with drain.exchange():
                await super().__call__(receive, send_end_shielded)
        finally:
            await run_cleanups(self.scope)  # type: ignore[arg-type]

    async def handle_messages(  # type: ignore[override]
        self, nursery: trio.Nursery, request: Request, receive: ASGIReceiveCallable
    ) -> None:
        # A client that leaves before its body is whole cancels the exchange before any route
        # or error handler runs: the row that says so is written here (the fast path's routes
        # write their own, http/fastpath.py).
        received = 0
        whole = False

        async def counting() -> Any:
            nonlocal received, whole
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                whole = not message.get("more_body", False)
            return message

        await super().handle_messages(nursery, request, counting)
        reject: Reject | None = self.app.record_rejection  # type: ignore[attr-defined]
        if not whole and not self.answered and reject is not None:
            error = body_incomplete(received, request.headers.get("content-length"))
            reject(
                RejectionRecord.refused(
                    error,
                    at=trio.current_time(),
                    method=request.method,
                    path=request.path,
                    program_id=None,
                    client=client_of(request.scope),
                )
            )


class ThunderproxyApp(QuartTrio):
    asgi_http_class = ProxyHTTPConnection
    #: Set by create_app; the runtime begins it on SIGTERM (http/drain.py).
    drain: Drain
    #: The LLM routes as raw ASGI (http/fastpath.py); None sends everything to Quart.
    fast: FastRoutes | None = None
    #: Records a ``rejections`` row (the audit log's ``record``); set by create_app.
    record_rejection: Reject | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        fast = self.fast
        if fast is not None:
            protocol = fast.route(scope)
            if protocol is not None:
                await fast(scope, receive, send, protocol)
                return
        await super().__call__(scope, receive, send)


def create_app(services: Services) -> ThunderproxyApp:
    """The proxy's HTTP app over already-running services."""
    app = ThunderproxyApp("thunderproxy")
    app.drain = Drain()
    settings = services.settings
    bounds = Bounds.of(settings)
    # Streams of long generations must not be cut by Quart's 60 s response timeout; backend
    # silence is bounded by --first-byte-timeout and --read-timeout instead.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = bounds.client_timeout
    app.config["MAX_CONTENT_LENGTH"] = bounds.max_body_bytes
    clients = Clients(settings.clients, services.recognizer)
    proxy = Proxy(
        gateway=services.gateway,
        read_timeout=settings.read_timeout,
        guard=PassthroughGuard(parse_prefixes(settings.passthrough), settings.admin_token),
        clients=clients,
    )
    edges = Edges(gateway=services.gateway, recognizer=services.recognizer, clients=clients)
    app.record_rejection = services.gateway.audit.record
    app.fast = FastRoutes(
        edges=edges,
        drain=app.drain,
        readiness=services.readiness,
        reject=app.record_rejection,
        bounds=bounds,
    )
    _handle_errors(app, bounds)
    _check_requests(app, services, clients, bounds)
    app.register_blueprint(llm.create_blueprint(services, edges))
    app.register_blueprint(readouts.create_blueprint(services))
    app.register_blueprint(admin.create_blueprint(services, clients))
    # Last: any other path, and at ``/`` the methods the readouts' root does not answer.
    app.register_blueprint(passthrough.create_blueprint(proxy))
    return app


def _asked() -> Any:
    # The request or websocket being refused: no route serves websockets, and Quart's 404
    # for one comes to these handlers outside any request context.
    return request if has_request_context() else websocket


def _handle_errors(app: ThunderproxyApp, bounds: Bounds) -> None:
    """Every refusal through the one table (errors.py), in the shape of the route's API, and
    recorded unless the gateway recorded the call itself."""
    record = app.record_rejection
    assert record is not None

    @app.errorhandler(ThunderproxyError)
    async def handle_error(error: ThunderproxyError) -> Response:
        asked = _asked()
        if not asked.scope.get(RECORDED_KEY):  # the gateway recorded the calls it was given
            record(
                RejectionRecord.refused(
                    error,
                    at=trio.current_time(),
                    method=asked.method,
                    path=asked.path,
                    program_id=error.program_id,
                    client=client_of(asked.scope),
                )
            )
        return error_response(error, error_shape(asked.path))

    @app.errorhandler(HTTPException)
    async def handle_http_error(error: HTTPException) -> Response:
        # Quart's own refusals (413 body too large, 408 body too slow, 405, 404), as ours.
        asked = _asked()
        text = error.description or error.name
        ours = quart_refusal(error.code or 500, text, asked.method, asked.path, bounds)
        return await handle_error(ours)


def _check_requests(
    app: ThunderproxyApp, services: Services, clients: Clients, bounds: Bounds
) -> None:
    """The request checks (http/checks.py) as Quart's hooks, in the fast path's order."""
    drain = app.drain

    @app.before_request
    async def refuse_head_when_due() -> None:
        # Draining, then the head's bound: hypercorn bounds only a head still arriving; a
        # complete one may be larger.
        scope = request.scope
        refusal = refuse_head(scope, header_items(scope), draining=drain.draining, bounds=bounds)
        if refusal is not None:
            raise refusal

    @app.after_request
    async def close_when_draining(response: Response) -> Response:
        # A client must not send its next request on a connection that is about to close.
        if drain.draining:
            response.headers["Connection"] = "close"
        return response

    @app.before_request
    async def require_client() -> None:
        # With [clients], every route that reaches a backend or runs a council job is a
        # client's: identified here, before the readiness check, so that a caller without a key
        # learns nothing of the proxy's state.
        if not clients.enabled or not needs_client(request.endpoint):
            return
        try:
            scope: dict[str, Any] = request.scope  # type: ignore[assignment]
            scope[CLIENT_KEY] = clients.identify(request.headers.items())
        except ThunderproxyError:
            # Drain the body first: a keep-alive connection left with an unread body stalls
            # the client's next request on it.
            await request.get_data(cache=False)
            raise

    @app.before_request
    async def refuse_until_ready() -> None:
        # Calls that need a backend get 503 while starting; the proxy's own endpoints answer.
        if services.readiness.ready or not needs_backend(request.endpoint):
            return
        # Drain the body first: a keep-alive connection left with an unread body stalls the
        # client's next request on it.
        await request.get_data(cache=False)
        services.readiness.check()
