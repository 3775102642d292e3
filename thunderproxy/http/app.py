"""``create_app``: the Quart-Trio app. Routes only translate HTTP into calls on the services
and their answers back into JSON; the shapes follow the seed API (seed 001)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable
from quart import Response, jsonify, request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from .. import __version__
from ..audit.records import RejectionRecord
from ..backends import BackendPool
from ..clock import WallClock
from ..config import Settings
from ..errors import (
    HeadersTooLarge,
    InvalidRequest,
    ProfilingDisabled,
    ProgramUnknown,
    ThunderproxyError,
)
from ..programs import Program, ProgramStatus
from ..programs.profile import Profiles
from ..programs.registry import BackendLoad
from ..scheduling import Scheduler
from .auth import require_admin
from .errors import error_body, error_response
from .proxy import CLEANUP_KEY, Proxy, parse_json_object

ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


@dataclass
class Services:
    """Everything a route may use; built by the runtime, never by the routes."""

    settings: Settings
    scheduler: Scheduler
    pool: BackendPool
    profiles: Profiles
    clock: WallClock


class ProxyHTTPConnection(TrioASGIHTTPConnection):
    """Runs the exchange's cleanups however it ends. Quart closes a streamed body only once it
    has started sending it; a client that leaves earlier would otherwise leave a step open."""

    async def __call__(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        try:
            await super().__call__(receive, send)
        finally:
            scope: dict[str, Any] = self.scope  # type: ignore[assignment]
            for cleanup in scope.get(CLEANUP_KEY, ()):
                with trio.CancelScope(shield=True):
                    await cleanup()


class ThunderproxyApp(QuartTrio):
    asgi_http_class = ProxyHTTPConnection


def program_view(program: Program, services: Services, *, with_profile: bool) -> dict[str, Any]:
    acting_since = program.acting_since
    view: dict[str, Any] = {
        "backend": program.backend,
        "context_len": program.context_len,
        "total_tokens": program.total_tokens,
        "step_count": program.step_count,
        "status": "reasoning" if program.status is ProgramStatus.REASONING else "acting",
        "state": program.status.lifecycle,
        "tool_finished": program.tool_finished,
        "acting_since": None if acting_since is None else services.clock.unix(acting_since),
        "in_flight": program.in_flight,
        "marked_for_pause": program.marked_for_pause,
    }
    if with_profile:
        profile = services.profiles.get(program.program_id)
        if profile is not None:
            view["profile"] = profile.as_dict()
    return view


def _error_type(status: int) -> str:
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        405: "invalid_request_error",
        408: "timeout_error",
        413: "invalid_request_error",
    }.get(status, "internal_error" if status >= 500 else "invalid_request_error")


def create_app(services: Services) -> QuartTrio:
    """The proxy's HTTP app over already-running services."""
    app = ThunderproxyApp("thunderproxy")
    # Streams of long generations must not be cut by Quart's 60 s response timeout; backend
    # silence is bounded by --first-byte-timeout and --read-timeout instead.
    settings = services.settings
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = settings.client_timeout
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    scheduler = services.scheduler
    registry = scheduler.registry
    proxy = Proxy(
        scheduler=scheduler,
        pool=services.pool,
        first_byte_timeout=settings.first_byte_timeout,
        read_timeout=settings.read_timeout,
    )

    def reject(status: int, error_type: str, message: str, program_id: str | None) -> None:
        scheduler.audit.record(
            RejectionRecord(
                at=trio.current_time(),
                method=request.method,
                path=request.path,
                status=status,
                error_type=error_type,
                message=message,
                program_id=program_id,
            )
        )

    @app.errorhandler(ThunderproxyError)
    async def handle_error(error: ThunderproxyError) -> Response:
        response = error_response(error)
        if not error.step_recorded:
            reject(response.status_code, error.error_type, error.message, error.program_id)
        return response

    @app.errorhandler(HTTPException)
    async def handle_http_error(error: HTTPException) -> Response:
        # Quart's own refusals (413 body too large, 408 body too slow, 405) in OpenAI's shape.
        status = error.code or 500
        message = {
            413: f"Request body is larger than {settings.max_body_bytes} bytes "
            "(see --max-body-bytes).",
            408: f"Request body not received within {settings.client_timeout} s "
            "(see --client-timeout).",
        }.get(status, error.description or error.name)
        error_type = _error_type(status)
        reject(status, error_type, message, None)
        body = error_body(message, error_type=error_type, status=status)
        return Response(body, status=status, content_type="application/json")

    @app.before_request
    async def limit_headers() -> None:
        # hypercorn bounds only a head still arriving; a complete one may be larger.
        size = sum(len(name) + len(value) + 4 for name, value in request.headers.items())
        if size > settings.max_header_bytes:
            raise HeadersTooLarge(
                f"Request headers are {size} bytes, more than {settings.max_header_bytes} "
                "(see --max-header-bytes)."
            )

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await proxy.completion("/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await proxy.completion("/v1/completions")

    @app.get("/programs")
    async def list_programs() -> Response:
        return jsonify(
            {
                p.program_id: program_view(p, services, with_profile=settings.profile)
                for p in registry
            }
        )

    @app.post("/programs/release")
    async def release_program() -> Response:
        require_admin(request.headers.get("authorization"), settings.admin_token)
        body = parse_json_object(await request.get_data(False, False, False))
        program_id = body.get("program_id")
        if not isinstance(program_id, str) or not program_id:
            raise InvalidRequest("program_id must be a non-empty string.", param="program_id")
        scheduler.release(program_id)
        return jsonify({"program_id": program_id, "released": True})

    @app.get("/health")
    async def health() -> Response:
        counts = registry.counts()
        loads = registry.load_by_backend()
        return jsonify(
            {
                "status": "ok" if services.pool.healthy() else "degraded",
                "version": __version__,
                "router_mode": scheduler.mode,
                "scheduling_enabled": scheduler.scheduling_enabled,
                "backends": services.pool.urls,
                "healthy_backends": [b.url for b in services.pool.healthy()],
                "programs_count": len(registry),
                "reasoning_count": counts[ProgramStatus.REASONING],
                "acting_count": counts[ProgramStatus.ACTING],
                "paused_count": counts[ProgramStatus.PAUSED],
                "per_backend": {
                    url: {
                        "total": load.total,
                        "reasoning": load.reasoning,
                        "acting": load.acting,
                        "paused": load.paused,
                        "marked_for_pause": load.marked_for_pause,
                        "future_paused_tokens": load.future_paused_tokens,
                    }
                    for url, load in ((u, loads.get(u, BackendLoad())) for u in services.pool.urls)
                },
                "profile_enabled": settings.profile,
                "audit": scheduler.audit.statistics().as_dict(),
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        loads = registry.load_by_backend()
        backends: dict[str, Any] = {}
        for backend in services.pool:
            load = loads.get(backend.url, BackendLoad())
            snap = backend.snapshot
            capacity = backend.capacity_tokens
            active = load.active_tokens
            backends[backend.url] = {
                "url": backend.url,
                "healthy": backend.healthy,
                "monitoring": settings.metrics,
                "last_error": backend.last_error,
                "in_flight_requests": backend.in_flight,
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
        stats = scheduler.audit.statistics()
        return jsonify(
            {
                "metrics_enabled": settings.metrics,
                "metrics_interval": settings.metrics_interval,
                "backends": backends,
                "audit": stats.as_dict(),
            }
        )

    @app.get("/profiles")
    async def list_profiles() -> Response:
        if not settings.profile:
            raise ProfilingDisabled()
        return jsonify({pid: profile.as_dict() for pid, profile in services.profiles.items()})

    @app.get("/profiles/<path:program_id>")
    async def get_profile(program_id: str) -> Response:
        if not settings.profile:
            raise ProfilingDisabled()
        profile = services.profiles.get(program_id)
        if profile is None:
            raise ProgramUnknown(program_id)
        return jsonify(profile.as_dict())

    @app.route("/", methods=ALL_METHODS, defaults={"path": ""})
    @app.route("/<path:path>", methods=ALL_METHODS)
    async def passthrough(path: str) -> Response:
        return await proxy.passthrough("/" + path)

    return app
