"""``create_app``: the Quart-Trio app. Routes only translate HTTP into calls on the services
and their answers back into JSON, in the shapes README's "HTTP API" table gives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable
from quart import Request, Response, has_request_context, jsonify, request, websocket
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from .. import __version__, snapshot
from ..admission.service import AdmissionService
from ..admission.shared_kv import SharedBackends
from ..audit.records import RejectionRecord
from ..backends import BackendPool
from ..clock import WallClock
from ..config import Settings
from ..errors import (
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    ProfilingDisabled,
    ProgramUnknown,
    ThunderproxyError,
    describe,
    reason,
)
from ..gateway import Gateway
from ..programs import Program, ProgramStatus
from ..programs.profile import Profiles
from ..protocols import Protocol
from ..protocols.recognition import ProgramRecognizer
from ..scheduling import Scheduler
from ..snapshot import Snapshot
from ..statistics import Counters
from ..supervision import Components
from .auth import admin_allowed, require_admin
from .clients import CLIENT_KEY, Clients, client_of, scoped
from .drain import Drain
from .edges import Edges, error_shape
from .errors import error_response
from .fastpath import (
    FastRoutes,
    Reject,
    body_incomplete,
    body_too_slow,
    headers_too_large,
    payload_too_large,
    request_line_size,
    shutting_down,
)
from .guard import PassthroughGuard, parse_prefixes, reads_allowed
from .proxy import RECORDED_KEY, Proxy, parse_json_object, run_cleanups
from .readiness import Readiness
from .readouts import prometheus
from .readouts.listing import next_link, page, parse_query, view_status

ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
#: The routes that need a backend, refused while the runtime waits for its backends.
BACKEND_ENDPOINTS = (
    "chat_completions",
    "completions",
    "messages",
    "count_tokens",
    "responses",
    "list_models",
    "passthrough",
)


@dataclass
class Services:
    """Everything a route may use; built by the runtime, never by the routes."""

    settings: Settings
    gateway: Gateway
    profiles: Profiles
    clock: WallClock
    #: Ready unless the runtime is still waiting for its backends.
    readiness: Readiness = field(default_factory=Readiness)
    #: Which program each call without a program id belongs to (one per proxy: it learns).
    recognizer: ProgramRecognizer = field(default_factory=ProgramRecognizer)
    #: Steps, pauses, resumes and latency histograms, fed by the audit log (Prometheus).
    counters: Counters = field(default_factory=Counters)
    #: The supervised long-lived components and how they fare (supervision.py).
    components: Components = field(default_factory=Components)
    #: The explorer's process state for /health (explore/mount.py); None without Datasette.
    explorer: Callable[[], dict[str, Any]] | None = None

    @property
    def scheduler(self) -> Scheduler:
        return self.gateway.scheduler

    @property
    def pool(self) -> BackendPool:
        return self.gateway.pool

    def statistics(self) -> Snapshot:
        """One frozen snapshot of programs, backends and the audit log."""
        return snapshot.take(
            router=self.scheduler.policy.name,
            registry=self.scheduler.registry,
            pool=self.pool,
            audit=self.gateway.audit.statistics(),
            admission=self.gateway.admission.statistics(trio.current_time())
            if isinstance(self.gateway.admission, AdmissionService)
            else None,
            shared_kv=self.scheduler.affinity.statistics()
            if isinstance(self.scheduler.affinity, SharedBackends)
            else None,
            components=self.components.snapshot(),
        )


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
            status, error_type = describe(error)
            reject(
                status,
                error_type,
                error.message,
                None,
                request.method,
                request.path,
                reason(error),
                client_of(request.scope),
            )


class ThunderproxyApp(QuartTrio):
    asgi_http_class = ProxyHTTPConnection
    #: Set by create_app; the runtime begins it on SIGTERM (http/drain.py).
    drain: Drain
    #: The LLM routes as raw ASGI (http/fastpath.py); None sends everything to Quart.
    fast: FastRoutes | None = None
    #: Writes a ``rejections`` row; set by create_app.
    record_rejection: Reject | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        fast = self.fast
        if fast is not None:
            protocol = fast.route(scope)
            if protocol is not None:
                await fast(scope, receive, send, protocol)
                return
        await super().__call__(scope, receive, send)


def program_view(program: Program, services: Services, *, with_profile: bool) -> dict[str, Any]:
    acting_since = program.acting_since
    view: dict[str, Any] = {
        "backend": program.backend,
        # Tokens, as the backend counts them: the last call's prompt as it reported it (or, for
        # a call not answered yet, its characters at the rate the program's calls showed).
        "context_len": round(program.context_len / program.chars_per_token),
        "context_chars": program.context_len,
        "total_tokens": program.total_tokens,
        "step_count": program.step_count,
        "status": view_status(program),
        "state": program.status.lifecycle,
        "tool_finished": program.tool_finished,
        "acting_since": None if acting_since is None else services.clock.unix(acting_since),
        "in_flight": program.in_flight,
        "marked_for_pause": program.marked_for_pause,
        "source": program.source,
    }
    if with_profile:
        profile = services.profiles.get(program.program_id)
        if profile is not None:
            view["profile"] = profile.as_dict()
    return view


def _audit_json(stats: Snapshot) -> dict[str, Any]:
    return stats.audit.as_dict()


def _components_json(stats: Snapshot) -> dict[str, Any]:
    return {c.name: c.as_dict() for c in stats.components}


def create_app(services: Services) -> ThunderproxyApp:
    """The proxy's HTTP app over already-running services."""
    app = ThunderproxyApp("thunderproxy")
    app.drain = drain = Drain()
    # Streams of long generations must not be cut by Quart's 60 s response timeout; backend
    # silence is bounded by --first-byte-timeout and --read-timeout instead.
    settings = services.settings
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = settings.client_timeout
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    scheduler = services.scheduler
    registry = scheduler.registry
    audit = services.gateway.audit
    clients = Clients(settings.clients, services.recognizer)
    proxy = Proxy(
        gateway=services.gateway,
        read_timeout=settings.read_timeout,
        guard=PassthroughGuard(parse_prefixes(settings.passthrough), settings.admin_token),
        clients=clients,
    )
    edges = Edges(gateway=services.gateway, recognizer=services.recognizer, clients=clients)

    def record_rejection(
        status: int,
        error_type: str,
        message: str,
        program_id: str | None,
        method: str,
        path: str,
        why: str,
        client: str | None = None,
    ) -> None:
        audit.record(
            RejectionRecord(
                at=trio.current_time(),
                method=method,
                path=path,
                status=status,
                error_type=error_type,
                message=message,
                program_id=program_id,
                reason=why,
                client=client,
            )
        )

    def asked() -> Any:
        # The request or websocket being refused: no route serves websockets, and Quart's 404
        # for one comes to these handlers outside any request context.
        return request if has_request_context() else websocket

    def reject(error: ThunderproxyError) -> None:
        status, error_type = describe(error)
        record_rejection(
            status,
            error_type,
            error.message,
            error.program_id,
            asked().method,
            asked().path,
            reason(error),
            client_of(asked().scope),
        )

    app.record_rejection = record_rejection
    app.fast = FastRoutes(
        edges=edges,
        drain=drain,
        readiness=services.readiness,
        reject=record_rejection,
        max_body_bytes=settings.max_body_bytes,
        max_header_bytes=settings.max_header_bytes,
        client_timeout=settings.client_timeout,
    )

    @app.errorhandler(ThunderproxyError)
    async def handle_error(error: ThunderproxyError) -> Response:
        if not asked().scope.get(RECORDED_KEY):  # the gateway recorded the calls it was given
            reject(error)
        return error_response(error, error_shape(asked().path))

    @app.errorhandler(HTTPException)
    async def handle_http_error(error: HTTPException) -> Response:
        # Quart's own refusals (413 body too large, 408 body too slow, 405, 404), as ours.
        status = error.code or 500
        ours: ThunderproxyError | None = {
            413: payload_too_large(settings.max_body_bytes),
            408: body_too_slow(settings.client_timeout),
            405: MethodNotAllowed(f"{asked().method} is not allowed on {asked().path}."),
        }.get(status)
        if ours is None:
            text = error.description or error.name
            if status == 404:
                ours = NotFound(text)
            elif status >= 500:
                ours = ThunderproxyError(text)  # a fault of ours, not of the request
            else:
                ours = InvalidRequest(text)
        return await handle_error(ours)

    @app.before_request
    async def refuse_when_draining() -> None:
        if drain.draining:
            raise shutting_down()

    @app.after_request
    async def close_when_draining(response: Response) -> Response:
        # A client must not send its next request on a connection that is about to close.
        if drain.draining:
            response.headers["Connection"] = "close"
        return response

    @app.before_request
    async def limit_headers() -> None:
        # hypercorn bounds only a head still arriving; a complete one may be larger.
        size = request_line_size(request.scope) + sum(
            len(name) + len(value) + 4 for name, value in request.headers.items()
        )
        if size > settings.max_header_bytes:
            raise headers_too_large(size, settings.max_header_bytes)

    @app.before_request
    async def require_client() -> None:
        # With [clients], every route that reaches a backend or runs a council job is a
        # client's: identified here, before the readiness check, so that a caller without a key
        # learns nothing of the proxy's state.
        if not clients.enabled:
            return
        endpoint = request.endpoint or ""
        if endpoint not in BACKEND_ENDPOINTS and not endpoint.startswith("council."):
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
        if services.readiness.ready or request.endpoint not in BACKEND_ENDPOINTS:
            return
        # Drain the body first: a keep-alive connection left with an unread body stalls the
        # client's next request on it.
        await request.get_data(cache=False)
        services.readiness.check()

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await edges.call(Protocol.CHAT, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await edges.call(Protocol.COMPLETIONS, "/v1/completions")

    @app.post("/v1/messages")
    async def messages() -> Response:
        return await edges.call(Protocol.MESSAGES, "/v1/messages")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        return await edges.count_tokens("/v1/messages/count_tokens")

    @app.post("/v1/responses")
    async def responses() -> Response:
        return await edges.call(Protocol.RESPONSES, "/v1/responses")

    def may_read() -> bool:
        return reads_allowed(
            request.headers.get("authorization"),
            protect_reads=settings.protect_reads,
            admin_token=settings.admin_token,
        )

    def require_reader() -> None:
        if settings.protect_reads:
            require_admin(request.headers.get("authorization"), settings.admin_token)

    @app.get("/programs")
    async def list_programs() -> Response:
        require_reader()
        args = request.args.to_dict()
        found = page(registry, parse_query(args))
        response = jsonify(
            {
                p.program_id: program_view(p, services, with_profile=settings.profile)
                for p in found.programs
            }
        )
        if found.next_cursor is not None:
            response.headers["Link"] = next_link(request.path, args, found.next_cursor)
            response.headers["X-Next-Cursor"] = found.next_cursor
        return response

    @app.post("/programs/release")
    async def release_program() -> Response:
        authorization = request.headers.get("authorization")
        # With [clients], a client releases its own programs (the id it sent them with); the
        # admin token, when one is set, names any program by its full id (``client:id``).
        client = None
        if clients.enabled and not (
            settings.admin_token and admin_allowed(authorization, settings.admin_token)
        ):
            client = clients.identify(request.headers.items())
        else:
            require_admin(authorization, settings.admin_token)
        body = parse_json_object(await request.get_data(False, False, False))
        program_id = body.get("program_id")
        if not isinstance(program_id, str) or not program_id:
            raise InvalidRequest("program_id must be a non-empty string.", param="program_id")
        tracked = scoped(client, program_id)
        scheduler.release(tracked)
        clients.forget(tracked)  # a later call continuing it starts anew
        return jsonify({"program_id": program_id, "released": True})

    @app.get("/v1/models")
    async def list_models() -> Response:
        """The union of what the healthy backends serve (their own entries), and the aliases
        that reach them."""
        cards: dict[str, Any] = {}
        for node in services.pool.healthy():
            for name, card in node.model_cards.items():
                cards.setdefault(name, card)
        created = int(services.clock.unix(trio.current_time()))
        for name in services.pool.served_models():
            if name not in cards:
                targets = services.pool.aliases.get(name, ())
                cards[name] = {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "thunderproxy",
                    "root": targets[0] if targets else name,
                }
        return jsonify({"object": "list", "data": list(cards.values())})

    @app.get("/health")
    async def health() -> Response:
        stats = services.statistics()
        starting = services.readiness.reason()
        if starting is not None:
            status = "starting"
        else:
            status = "ok" if stats.healthy_backends and not stats.degraded else "degraded"
        if not may_read():
            # Load balancers need the status only; who runs what is for token holders.
            response = jsonify({"status": status})
            response.status_code = 503 if starting is not None else 200
            return response
        response = jsonify(
            {
                "status": status,
                "reason": starting,
                "version": __version__,
                "router_mode": stats.router,
                "scheduling_enabled": stats.router != "default",
                "backends": [b.url for b in stats.backends],
                "healthy_backends": stats.healthy_backends,
                "models": list(stats.served_models),
                "programs_count": stats.programs,
                "reasoning_count": stats.by_status[ProgramStatus.REASONING],
                "acting_count": stats.by_status[ProgramStatus.ACTING],
                "paused_count": stats.by_status[ProgramStatus.PAUSED],
                "per_backend": {
                    b.url: {
                        "total": b.load.total,
                        "reasoning": b.load.reasoning,
                        "acting": b.load.acting,
                        "paused": b.load.paused,
                        "marked_for_pause": b.load.marked_for_pause,
                        "future_paused_tokens": b.load.future_paused_tokens,
                    }
                    for b in stats.backends
                },
                "profile_enabled": settings.profile,
                "audit": _audit_json(stats),
                "admission": stats.admission,
                "shared_kv": stats.shared_kv,
                "degraded": stats.degraded,
                "components": _components_json(stats),
                "explorer": None if services.explorer is None else services.explorer(),
                "descriptors": stats.descriptors,
            }
        )
        if starting is not None:
            # Not ready for traffic: a load balancer's readiness probe should wait.
            response.status_code = 503
        return response

    @app.get(prometheus.PROMETHEUS_PATH)
    async def metrics_prometheus() -> Response:
        require_reader()
        view = services.counters.view(services.statistics())
        return Response(prometheus.render(view), content_type=prometheus.CONTENT_TYPE)

    @app.get("/metrics")
    async def metrics() -> Response:
        require_reader()
        if prometheus.wants_prometheus(request.headers.get("accept"), request.path):
            return await metrics_prometheus()
        stats = services.statistics()
        backends: dict[str, Any] = {}
        for b in stats.backends:
            load, snap, capacity = b.load, b.engine, b.capacity_tokens
            active = load.active_tokens
            backends[b.url] = {
                "url": b.url,
                "healthy": b.healthy,
                "models": None if b.models is None else list(b.models),
                "monitoring": settings.metrics,
                "last_error": b.last_error,
                "in_flight_requests": b.in_flight,
                "active_program_tokens": active,
                "reasoning_program_tokens": load.reasoning_tokens,
                "acting_program_tokens": load.acting_tokens,
                "active_program_count": load.active_count,
                "active_program_tokens_ratio": active / capacity if capacity else None,
                "cache_config": None
                if snap is None
                else {
                    "block_size": snap.block_size,
                    "num_gpu_blocks": snap.num_gpu_blocks,
                    "total_tokens_capacity": snap.capacity_tokens,
                },
                "metrics": None
                if snap is None
                else {
                    "num_requests_running": snap.running,
                    "num_requests_waiting": snap.waiting,
                    "kv_cache_usage_perc": snap.kv_usage,
                    "prefix_cache_hit_rate": snap.prefix_hit_rate,
                    "num_preemptions": snap.preemptions_total,
                },
            }
        return jsonify(
            {
                "metrics_enabled": settings.metrics,
                "metrics_interval": settings.metrics_interval,
                "backends": backends,
                "audit": _audit_json(stats),
                "admission": stats.admission,
                "components": _components_json(stats),
            }
        )

    @app.get("/profiles")
    async def list_profiles() -> Response:
        require_reader()
        if not settings.profile:
            raise ProfilingDisabled()
        return jsonify({pid: profile.as_dict() for pid, profile in services.profiles.items()})

    @app.get("/profiles/<path:program_id>")
    async def get_profile(program_id: str) -> Response:
        require_reader()
        if not settings.profile:
            raise ProfilingDisabled()
        profile = services.profiles.get(program_id)
        if profile is None:
            raise ProgramUnknown(program_id)
        return jsonify(profile.as_dict())

    @app.route("/", methods=["GET", "HEAD"])
    async def about() -> Response:
        """What answers here and where its APIs are: clients probe the root (Claude Code sends
        ``HEAD /`` at start) and people open it in a browser; neither is a backend's call."""
        root = request.host_url.rstrip("/")
        return jsonify(
            {
                "name": "thunderproxy",
                "version": __version__,
                "description": "a program-aware proxy for agentic LLM inference",
                "openai_base_url": root + "/v1",
                "anthropic_base_url": root,
                "endpoints": [
                    "/v1/chat/completions",
                    "/v1/completions",
                    "/v1/messages",
                    "/v1/responses",
                    "/v1/models",
                    "/health",
                    "/metrics",
                    "/programs",
                ],
            }
        )

    @app.route("/", methods=ALL_METHODS, defaults={"path": ""})
    @app.route("/<path:path>", methods=ALL_METHODS)
    async def passthrough(path: str) -> Response:
        return await proxy.passthrough("/" + path)

    return app
