"""The ``readouts`` blueprint: what the proxy shows of itself, read from one frozen snapshot
(``Services.snapshot()``): the root's description, ``/health``, ``/metrics`` (JSON, or
Prometheus' text to a scraper), ``/programs`` in pages, and ``/profiles``. With
``--protect-reads`` all but the root and the status of ``/health`` need the admin token."""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response, jsonify, request

from ... import __version__
from ...errors import ProfilingDisabled, ProgramUnknown
from ...programs import Program, ProgramStatus
from ...snapshot import Snapshot
from ..auth import require_admin
from ..guard import reads_allowed
from ..readouts import prometheus
from ..readouts.listing import next_link, page, parse_query, view_status
from ..services import Services

#: What ``GET /`` lists.
ENDPOINTS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/responses",
    "/v1/models",
    "/health",
    "/metrics",
    "/programs",
]


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


def health_body(
    services: Services, stats: Snapshot, status: str, starting: str | None
) -> dict[str, Any]:
    """``/health`` for a reader allowed to see who runs what."""
    return {
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
        "profile_enabled": services.settings.profile,
        "audit": _audit_json(stats),
        "admission": stats.admission,
        "shared_kv": stats.shared_kv,
        "degraded": stats.degraded,
        "components": _components_json(stats),
        "explorer": None if services.explorer is None else services.explorer(),
        "descriptors": stats.descriptors,
    }


def metrics_body(services: Services, stats: Snapshot) -> dict[str, Any]:
    """The JSON ``/metrics``: each backend's load, cache and engine figures, and the proxy's."""
    settings = services.settings
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
    return {
        "metrics_enabled": settings.metrics,
        "metrics_interval": settings.metrics_interval,
        "backends": backends,
        "audit": _audit_json(stats),
        "admission": stats.admission,
        "components": _components_json(stats),
    }


def create_blueprint(services: Services) -> Blueprint:
    bp = Blueprint("readouts", __name__)
    settings = services.settings

    def may_read() -> bool:
        return reads_allowed(
            request.headers.get("authorization"),
            protect_reads=settings.protect_reads,
            admin_token=settings.admin_token,
        )

    def require_reader() -> None:
        if settings.protect_reads:
            require_admin(request.headers.get("authorization"), settings.admin_token)

    @bp.get("/programs")
    async def list_programs() -> Response:
        require_reader()
        args = request.args.to_dict()
        found = page(services.scheduler.registry, parse_query(args))
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

    @bp.get("/health")
    async def health() -> Response:
        stats = services.snapshot()
        starting = services.readiness.reason()
        if starting is not None:
            status = "starting"
        else:
            status = "ok" if stats.healthy_backends and not stats.degraded else "degraded"
        # Load balancers need the status only; who runs what is for token holders.
        body = health_body(services, stats, status, starting) if may_read() else {"status": status}
        response = jsonify(body)
        if starting is not None:
            # Not ready for traffic: a load balancer's readiness probe should wait.
            response.status_code = 503
        return response

    @bp.get(prometheus.PROMETHEUS_PATH)
    async def metrics_prometheus() -> Response:
        require_reader()
        view = services.counters.view(services.snapshot())
        return Response(prometheus.render(view), content_type=prometheus.CONTENT_TYPE)

    @bp.get("/metrics")
    async def metrics() -> Response:
        require_reader()
        if prometheus.wants_prometheus(request.headers.get("accept"), request.path):
            return await metrics_prometheus()
        return jsonify(metrics_body(services, services.snapshot()))

    @bp.get("/profiles")
    async def list_profiles() -> Response:
        require_reader()
        if not settings.profile:
            raise ProfilingDisabled()
        return jsonify({pid: profile.as_dict() for pid, profile in services.profiles.items()})

    @bp.get("/profiles/<path:program_id>")
    async def get_profile(program_id: str) -> Response:
        require_reader()
        if not settings.profile:
            raise ProfilingDisabled()
        profile = services.profiles.get(program_id)
        if profile is None:
            raise ProgramUnknown(program_id)
        return jsonify(profile.as_dict())

    @bp.route("/", methods=["GET", "HEAD"])
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
                "endpoints": ENDPOINTS,
            }
        )

    return bp
