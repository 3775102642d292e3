"""``run``: the one nursery that owns every long-lived task of a proxy run.

Start order: (embedded simulator) -> audit writer -> metrics poller -> resume monitor -> HTTP.
Each reports readiness through ``task_status.started()``, so the port opens only once the audit
log is migrated and the backends have been polled once.

Stop order, on SIGINT/SIGTERM or ``shutdown.set()``: Hypercorn stops accepting and drains
in-flight requests for up to ``shutdown_grace`` seconds; then the pollers are cancelled, the audit
channel is closed, and the writer flushes every accepted row before the nursery exits.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from . import __version__
from .audit import AuditLog, serve_audit_writer
from .audit.records import TransitionRecord
from .backends import open_backend_pool
from .backends.poller import serve_metrics_poller, wait_until_ready
from .clock import WallClock
from .config import Settings
from .explore import mount_datasette
from .http.app import Services, create_app
from .jobs import open_council, serve_council
from .programs import ProgramRegistry, restore
from .programs.profile import Profiles
from .scheduling import Scheduler
from .scheduling.scheduler import serve_resume_monitor

log = logging.getLogger("thunderproxy")


@dataclass(frozen=True)
class RunningProxy:
    """Handed to ``task_status.started()``: where the proxy listens and its live services."""

    url: str
    services: Services
    audit: AuditLog
    shutdown: trio.Event


def hypercorn_config(settings: Settings) -> HypercornConfig:
    config = HypercornConfig()
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    config.bind = [f"{host}:{settings.port}"]
    config.graceful_timeout = settings.shutdown_grace
    config.accesslog = None
    config.errorlog = logging.getLogger("thunderproxy.http")
    # A slow sender gets --client-timeout for its request head (hypercorn treats a connection
    # whose request is incomplete as idle) and again for its body (Quart's BODY_TIMEOUT).
    config.keep_alive_timeout = settings.client_timeout
    config.h11_max_incomplete_size = settings.max_header_bytes
    # Hundreds of agents may connect at once; hypercorn's default backlog of 100 resets the rest.
    config.backlog = 4096
    return config


class Background:
    """The services that stop when the HTTP server has drained (pollers, monitor, simulator)."""

    def __init__(self) -> None:
        self._scopes: list[trio.CancelScope] = []
        self.cancelled = False

    def scope(self) -> trio.CancelScope:
        scope = trio.CancelScope()
        if self.cancelled:
            scope.cancel()
        self._scopes.append(scope)
        return scope

    def cancel(self) -> None:
        self.cancelled = True
        for scope in self._scopes:
            scope.cancel()


async def _in_scope(
    background: Background,
    service: Callable[..., Awaitable[Any]],
    *,
    task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
) -> None:
    with background.scope():
        await service(task_status=task_status)


async def _stop_on_signals(
    shutdown: trio.Event, force: trio.CancelScope, background: Background
) -> None:
    with background.scope(), trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            if not shutdown.is_set():
                log.info(
                    "%s: draining in-flight requests, then stopping", signal.Signals(signum).name
                )
                shutdown.set()
            else:
                log.warning("second signal: stopping now without waiting for requests")
                force.cancel()
                return


async def _embedded_simulator(nursery: trio.Nursery, background: Background) -> str:
    from .sim import SimConfig, serve_simulator

    # Report cached tokens per request, as vLLM does with --enable-prompt-tokens-details
    # (the flag a real deployment behind thunderproxy should run with).
    config = SimConfig(enable_prompt_tokens_details=True)

    url: str = await nursery.start(
        _in_scope, background, partial(serve_simulator, config, host="127.0.0.1", port=0)
    )
    log.warning(
        "No --backends given: started an embedded SIMULATED vLLM at %s (no GPU, no model). "
        "Pass --backends URL to proxy a real server.",
        url,
    )
    return url


async def _restore_programs(registry: ProgramRegistry, db: str, clock: WallClock) -> None:
    found = await trio.to_thread.run_sync(restore.load, db)
    now = trio.current_time()
    wall_now = clock.unix(now)
    for item in found:
        program = restore.rebuild(item, now=now, wall_now=wall_now)
        registry.adopt(program, previous=item.previous_status, reason="restored after restart")
    if found:
        log.info("restored %d programs from %s", len(found), db)


async def run(
    settings: Settings,
    *,
    shutdown: trio.Event | None = None,
    handle_signals: bool = False,
    task_status: trio.TaskStatus[RunningProxy] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the proxy until ``shutdown`` is set (or a signal arrives, with ``handle_signals``)."""
    shutdown = shutdown or trio.Event()
    background = Background()
    clock = WallClock()
    pool_ctx = open_backend_pool(
        settings.backends,
        connect_timeout=settings.connect_timeout,
        max_connections=settings.max_connections,
    )
    with trio.CancelScope() as force:
        async with pool_ctx as pool, trio.open_nursery() as nursery:
            if not settings.backends:
                pool.add(await _embedded_simulator(nursery, background))
            run_info = {
                "version": __version__,
                "router": settings.router,
                "backends": pool.urls,
                "settings": settings.public(),
            }
            audit: AuditLog = await nursery.start(
                partial(
                    serve_audit_writer,
                    settings.db,
                    run_info=run_info,
                    queue_size=settings.audit_queue,
                )
            )
            registry = ProgramRegistry(lambda t: audit.record(TransitionRecord(t)))
            if settings.restore:
                await _restore_programs(registry, settings.db, clock)
            profiles = Profiles()
            scheduler = Scheduler(
                mode=settings.router,
                registry=registry,
                pool=pool,
                audit=audit,
                profiles=profiles,
                config=settings.policy(),
            )
            with trio.move_on_after(settings.ready_timeout) as waiting:
                await wait_until_ready(pool)
            if waiting.cancelled_caught:
                log.warning(
                    "backends not ready after %.0f s: %s; serving anyway (their requests fail "
                    "with 503 until they answer /health)",
                    settings.ready_timeout,
                    ", ".join(b.url for b in pool if not b.healthy),
                )
            await nursery.start(
                _in_scope,
                background,
                partial(
                    serve_metrics_poller,
                    pool,
                    registry,
                    audit,
                    interval=settings.metrics_interval,
                    metrics=settings.metrics,
                ),
            )
            await nursery.start(
                _in_scope,
                background,
                partial(serve_resume_monitor, scheduler, interval=settings.monitor_interval),
            )
            services = Services(
                settings=settings, scheduler=scheduler, pool=pool, profiles=profiles, clock=clock
            )
            if handle_signals:
                nursery.start_soon(_stop_on_signals, shutdown, force, background)
            council = await open_council(settings)

            async def serve_http(*, task_status: trio.TaskStatus[list[str]]) -> None:
                app = create_app(services)
                app.register_blueprint(council.blueprint)
                async with mount_datasette(app, settings) as served:
                    await serve(
                        served,
                        hypercorn_config(settings),
                        shutdown_trigger=shutdown.wait,  # type: ignore[arg-type]
                        task_status=task_status,
                    )
                # Requests are drained: stop the pollers, then let the writer flush.
                background.cancel()
                await audit.aclose()

            binds: list[str] = await nursery.start(serve_http)
            # Council jobs call the proxy's own URL, so it starts once the proxy listens.
            await nursery.start(
                _in_scope,
                background,
                partial(serve_council, council, settings, binds[0], shutdown=shutdown),
            )
            log.info(
                "thunderproxy %s listening on %s (router=%s, backends=%s, db=%s)",
                __version__,
                binds[0],
                settings.router,
                ",".join(pool.urls),
                settings.db,
            )
            task_status.started(RunningProxy(binds[0], services, audit, shutdown))
