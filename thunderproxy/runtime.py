"""``run``: the one nursery that owns every long-lived task of a proxy run.

Before anything starts, the port is bound and the audit db path checked, so a busy port or an
unwritable ``--db`` is one clear error rather than a half-started proxy. Then: (embedded
simulator) -> audit writer -> HTTP, listening at once -> wait for the backends' /health
(LLM calls are answered 503 meanwhile) -> metrics poller -> resume monitor -> ready. Each
reports readiness through ``task_status.started()``; ``run`` itself reports once traffic flows.

Stop order, on SIGINT/SIGTERM/SIGHUP or ``shutdown.set()``: Hypercorn stops accepting and drains
in-flight requests for up to ``shutdown_grace`` seconds; then the pollers are cancelled, the audit
channel is closed, and the writer flushes every accepted row before the nursery exits.

Every background service is a supervised component (``_component``, ``supervision.py``): a
failure after it started is its own (logged, shown in /health and /metrics, restarted with
backoff), so only a signal or a fatal startup error stops ``run``.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from . import __version__
from .audit import AuditLog, serve_audit_writer
from .audit.writer import check_database_path
from .backends import BackendPool, open_backend_pool
from .backends.poller import wait_until_ready
from .clock import WallClock
from .config import RECOGNITION_SOURCES, Settings, load_settings, recognition_sources
from .core import Core, Service, build_core, recording_registry
from .council import Council, open_council, serve_council
from .council.gateway_client import GatewayChatClient
from .descriptors import quiet_trio_accept_log
from .errors import ConfigError
from .explore import mount_datasette
from .http.app import create_app
from .http.drain import drain_then_stop
from .http.front import serve_front
from .http.readiness import Readiness
from .http.services import Services
from .programs import ProgramRegistry, restore
from .protocols.recognition import ProgramRecognizer, RecognitionConfig
from .statistics import Counters
from .supervision import RESTART, Components, Restart, supervised
from .worker import (
    WorkerMiddleware,
    WorkerState,
    restore_seen,
    serve_worker,
    signals_from_services,
    worker_config,
)

if TYPE_CHECKING:
    from .sim import SimConfig

log = logging.getLogger("thunderproxy")


@dataclass(frozen=True)
class RunningProxy:
    """Handed to ``task_status.started()``: where the proxy listens and its live services."""

    url: str
    services: Services
    audit: AuditLog
    shutdown: trio.Event
    #: Worker mode's live state (docs/WORKER.md); None when worker mode is off.
    worker: WorkerState | None = None


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that drain and stop the proxy. SIGHUP too: a closed terminal or a supervisor
    that hangs up would otherwise kill the process at once (exit 129), cutting its streams and
    its audit rows; but not where it is ignored (``nohup``), as it is then meant to be."""
    hup = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGINT, signal.SIGTERM, *hup)


#: Hundreds of agents may connect at once; a backlog of 100 (hypercorn's) resets the rest.
BACKLOG = 4096


def recognition_config(settings: Settings) -> RecognitionConfig:
    """The recognizer's switches from the ``recognition`` setting: the sources it names are on."""
    on = recognition_sources(settings.recognition)
    return RecognitionConfig(**{name: name in on for name in RECOGNITION_SOURCES})


def bind_listener(
    host: str, port: int, *, reuse_port: bool = False, listen: bool = True
) -> socket.socket:
    """The proxy's listening socket, bound before anything else starts; a port that cannot be
    had is a ConfigError that names it and the remedy. ``reuse_port``: one of the processes of
    ``serve --workers N``, which the kernel spreads connections among (``thunderproxy.scaleout``);
    ``listen=False`` only holds the port (the supervisor's socket, which takes no connection)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            remedy = "stop the process that holds it or pass --port with a free port (0: any)"
            problem = "is already in use"
        elif exc.errno == errno.EACCES:
            remedy = "pass --port 1024 or higher (lower ports need privileges)"
            problem = "cannot be opened (permission denied)"
        else:
            remedy = "pass --host with an address of this machine, e.g. 127.0.0.1 or 0.0.0.0"
            problem = f"cannot be opened ({exc.strerror or exc})"
        raise ConfigError(f"Port {port} on {host} {problem}; {remedy}.") from None
    sock.setblocking(False)
    return sock


def hypercorn_config(settings: Settings, listener: socket.socket | None = None) -> HypercornConfig:
    config = HypercornConfig()
    if listener is not None:
        # Hypercorn takes over the socket bound at startup: the fd is its to close now.
        config.bind = [f"fd://{listener.detach()}"]
    else:
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        config.bind = [f"{host}:{settings.port}"]
    config.graceful_timeout = settings.shutdown_grace
    config.accesslog = None
    config.errorlog = logging.getLogger("thunderproxy.http")
    # A slow sender gets --client-timeout for its request head (hypercorn treats a connection
    # whose request is incomplete as idle) and again for its body (Quart's BODY_TIMEOUT).
    config.keep_alive_timeout = settings.client_timeout
    config.h11_max_incomplete_size = settings.max_header_bytes
    config.backlog = BACKLOG
    if settings.certfile:
        config.certfile = settings.certfile
        config.keyfile = settings.keyfile
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


def _component(
    background: Background,
    components: Components,
    name: str,
    service: Callable[..., Awaitable[Any]],
    restart: Restart = RESTART,
) -> Callable[..., Awaitable[None]]:
    """A background service as a supervised component (``supervision.py``): its failure after
    it started is its own (logged, shown in /health and /metrics, restarted with backoff),
    never the nursery's; it stops with the other background services."""
    return partial(_in_scope, background, supervised(components, name, service, restart=restart))


async def _stop_on_signals(
    shutdown: trio.Event, force: trio.CancelScope, background: Background
) -> None:
    with background.scope(), trio.open_signal_receiver(*stop_signals()) as signals:
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


async def _embedded_simulator(
    nursery: trio.Nursery, background: Background, overrides: Mapping[str, Any]
) -> str:
    from .sim import SimConfig, serve_simulator
    from .sim.config import EMBEDDED

    # A workstation card's KV, cached tokens reported (EMBEDDED says why), then --sim's values.
    config = SimConfig(**{**EMBEDDED, **overrides})

    url: str = await nursery.start(
        _in_scope, background, partial(serve_simulator, config, host="127.0.0.1", port=0)
    )
    log.warning(
        "No --backends given: started an embedded SIMULATED vLLM at %s (no GPU, no model; "
        "context %d tokens, KV %d tokens; --sim NAME=VALUE changes them). "
        "Pass --backends URL to proxy a real server.",
        url,
        config.max_model_len,
        config.resolved_num_gpu_blocks() * config.resolved_block_size(),
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


async def _wait_for_backends(pool: BackendPool, limit_s: float) -> None:
    with trio.move_on_after(limit_s) as waiting:
        await wait_until_ready(pool)
    if waiting.cancelled_caught:
        log.warning(
            "backends not ready after %.0f s: %s; serving anyway (their requests fail "
            "with 503 until they answer /health)",
            limit_s,
            ", ".join(b.url for b in pool if not b.healthy),
        )


def _unknown_models_line(pool: BackendPool) -> str:
    """What the startup line says of calls naming a model nothing serves, when they are not
    refused: a client's own model name (Claude Code's) then works, and the user knows why."""
    default = pool.unknown_names_go_to()
    if default is None:
        return ""
    model, why = default
    return f"; calls naming a model no backend serves go to {model!r} ({why})"


class _Starter:
    """Starts the run's long-lived tasks in its nursery, each as a supervised component."""

    def __init__(self, nursery: trio.Nursery, background: Background) -> None:
        self.nursery = nursery
        self.background = background
        self.components = Components()

    async def component(self, name: str, service: Service, restart: Restart = RESTART) -> None:
        await self.nursery.start(
            _component(self.background, self.components, name, service, restart)
        )


async def _check_startup(settings: Settings, reuse_port: bool) -> socket.socket:
    """The listening socket, once the port and the ``--db`` path are known to be usable."""
    listener = bind_listener(settings.host, settings.port, reuse_port=reuse_port)
    try:
        await trio.to_thread.run_sync(check_database_path, settings.db)
    except BaseException:
        listener.close()
        raise
    return listener


async def _add_backends(
    settings: Settings, pool: BackendPool, nursery: trio.Nursery, background: Background
) -> None:
    """The configured backends, or an embedded simulator when none are given."""
    for spec in settings.backend_specs:
        pool.add(spec.url, models=spec.models)
    if not settings.backends:
        pool.add(await _embedded_simulator(nursery, background, settings.sim))


async def _start_audit(settings: Settings, pool: BackendPool, start: _Starter) -> AuditLog:
    """The audit writer: the db migrated and this run's row written, then its write loop."""
    run_info = {
        "version": __version__,
        "router": settings.router,
        "backends": pool.urls,
        "settings": settings.public(),
    }
    audit: AuditLog = await start.nursery.start(
        partial(
            serve_audit_writer,
            settings.db,
            run_info=run_info,
            queue_size=settings.audit_queue,
            components=start.components,
        )
    )
    return audit


async def _start_core(
    settings: Settings, pool: BackendPool, audit: AuditLog, clock: WallClock, start: _Starter
) -> Core:
    """The core (``core.py``) over the programs restored from the db, and its Redis
    heartbeats, each ready after its first beat."""
    registry = recording_registry(audit)
    if settings.restore:
        await _restore_programs(registry, settings.db, clock)
    core = build_core(settings, pool, audit, registry=registry, offset=clock.unix(0.0))
    for name, service in core.shared:
        await start.component(name, service)
    return core


async def _worker_state(settings: Settings, audit: AuditLog) -> WorkerState | None:
    """Worker mode's state (docs/WORKER.md), with the request numbers already served; None
    when worker mode is off."""
    worker_cfg = worker_config(settings, os.environ)
    worker = None if worker_cfg is None else WorkerState(worker_cfg, audit.record)
    if worker is not None:
        # Request numbers accepted before a restart: their replays are refused too.
        await restore_seen(worker, settings.db)
    if worker_cfg is not None and worker_cfg.unsecured:
        log.warning(
            "worker mode with --unsecured: requests are NOT checked for the "
            "autoscaler's signature; anyone who can reach this port can use it. "
            "For local development only."
        )
    return worker


def _services(settings: Settings, core: Core, clock: WallClock, start: _Starter) -> Services:
    """What the routes use: the core, readiness (not ready until the backends answer) and the
    counters every audit record feeds."""
    pool = core.pool
    counters = Counters()
    core.audit.observers.append(counters.observe)
    return Services(
        settings=settings,
        gateway=core.gateway,
        profiles=core.profiles,
        clock=clock,
        readiness=Readiness(lambda: [b.url for b in pool if not b.healthy]),
        recognizer=ProgramRecognizer(recognition_config(settings)),
        counters=counters,
        components=start.components,
    )


@dataclass(frozen=True)
class _Http:
    """What the HTTP server serves and how it stops."""

    settings: Settings
    services: Services
    council: Council
    worker: WorkerState | None
    listener: socket.socket
    shutdown: trio.Event
    background: Background

    async def serve(self, *, task_status: trio.TaskStatus[list[str]]) -> None:
        """Serve until the shutdown event, drained (http/drain.py); then stop the background
        services and let the writer flush."""
        settings = self.settings
        gateway = self.services.gateway
        app = create_app(self.services)
        app.register_blueprint(self.council.blueprint)
        # The front serves the LLM routes itself and Hypercorn the rest (http/front.py);
        # TLS is Hypercorn's alone.
        front = settings.http_front == "fast" and not settings.certfile
        config = hypercorn_config(settings, None if front else self.listener)

        async def stopping() -> None:
            await self.shutdown.wait()
            gateway.stopping = True  # calls cut from now on are not the clients' doing
            # The app drains first, Hypercorn stops after it (see http/drain.py).
            await drain_then_stop(self.shutdown, app.drain, config, settings.shutdown_grace)

        async with mount_datasette(app, settings, self.services) as served:
            outer = served if self.worker is None else WorkerMiddleware(served, self.worker)
            if front:
                await serve_front(
                    outer,  # type: ignore[arg-type]
                    config,
                    self.listener,
                    shutdown_trigger=stopping,
                    task_status=task_status,
                )
            else:
                quiet_trio_accept_log()
                await serve(
                    outer,  # type: ignore[arg-type]
                    config,
                    shutdown_trigger=stopping,  # type: ignore[arg-type]
                    task_status=task_status,
                )
        # Requests are drained: stop the pollers, then let the writer flush.
        self.background.cancel()
        await self.council.aclose()
        await gateway.audit.aclose()


async def _start_pollers(
    settings: Settings, core: Core, worker: WorkerState | None, start: _Starter
) -> None:
    """Wait for the backends (the worker waits itself), then the metrics poller and the
    resume monitor; a stop while starting ends the wait at once."""
    with start.background.scope():
        if worker is None:
            await _wait_for_backends(core.pool, settings.ready_timeout)
        await start.component("metrics_poller", core.metrics_poller())
        await start.component("resume_monitor", core.resume_monitor())


def _log_listening(settings: Settings, pool: BackendPool, url: str, reuse_port: bool) -> None:
    log.info(
        "thunderproxy %s %s %s (router=%s, backends=%s, db=%s)%s",
        __version__,
        # One of several processes on the port: the supervisor says when all listen.
        "worker serving on" if reuse_port else "listening on",
        url,
        settings.router,
        ",".join(pool.urls),
        settings.db,
        _unknown_models_line(pool),
    )


async def run(
    settings: Settings,
    *,
    shutdown: trio.Event | None = None,
    handle_signals: bool = False,
    reuse_port: bool = False,
    task_status: trio.TaskStatus[RunningProxy] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the proxy until ``shutdown`` is set (or a signal arrives, with ``handle_signals``).

    The port opens as soon as the audit db is ready; ``task_status.started()`` comes once the
    backends answered /health (or ``ready_timeout`` passed) and LLM calls are served."""
    shutdown = shutdown or trio.Event()
    # Everything a newcomer can get wrong is checked before anything starts (simulator too).
    listener = await _check_startup(settings, reuse_port)
    background = Background()
    clock = WallClock()
    pool_ctx = open_backend_pool(
        connect_timeout=settings.connect_timeout,
        max_connections=settings.max_connections,
        aliases=settings.aliases,
        default_model=settings.default_model,
    )
    with trio.CancelScope() as force, listener:
        async with pool_ctx as pool, trio.open_nursery() as nursery:
            start = _Starter(nursery, background)
            await _add_backends(settings, pool, nursery, background)
            audit = await _start_audit(settings, pool, start)
            core = await _start_core(settings, pool, audit, clock, start)
            worker = await _worker_state(settings, audit)
            services = _services(settings, core, clock, start)
            if handle_signals:
                nursery.start_soon(_stop_on_signals, shutdown, force, background)
            council = await open_council(settings, db_generation=lambda: audit.generation)
            http = _Http(settings, services, council, worker, listener, shutdown, background)
            binds: list[str] = await nursery.start(http.serve)
            url = binds[0]
            log.info("accepting connections at %s; LLM calls get 503 until backends are ready", url)
            if worker is not None:
                # Reports and the beacon run from now on; the worker waits for the backends
                # itself, up to --worker-ready-timeout, and benchmarks them.
                signals = signals_from_services(services)
                await start.component(
                    "worker", partial(serve_worker, worker, pool, url=url, signals=signals)
                )
            await _start_pollers(settings, core, worker, start)
            if background.cancelled:
                return
            services.readiness.set_ready()
            # Council jobs call the gateway in process; they start (or resume) once LLM calls
            # are served, like any client's.
            client = GatewayChatClient(core.gateway)
            await start.component(
                "council",
                partial(serve_council, council, settings, shutdown=shutdown, client=client),
            )
            _log_listening(settings, pool, url, reuse_port)
            task_status.started(RunningProxy(url, services, audit, shutdown, worker))


@asynccontextmanager
async def open_demo(
    sim_config: SimConfig,
    values: Mapping[str, Any],
    *,
    wait: bool,
    echo: Callable[[str], None],
) -> AsyncIterator[tuple[RunningProxy, str]]:
    """A proxy in front of a simulator of its own, both in this process, as ``thunderproxy
    demo`` runs them: yields the running proxy and the simulator's URL.

    ``values`` are the proxy's settings, less ``backends`` (the simulator); it logs warnings
    only, so that the demo's own lines are what the terminal shows. After the block, with
    ``wait`` the proxy keeps serving until Ctrl-C, else it stops at once; the simulator goes
    only once the proxy has drained and flushed its audit log."""
    from .sim import serve_simulator

    async with trio.open_nursery() as outer:
        sim_url: str = await outer.start(
            partial(serve_simulator, sim_config, host="127.0.0.1", port=0)
        )
        settings = load_settings({"log_level": "warning", **values, "backends": sim_url})
        async with trio.open_nursery() as inner:
            proxy: RunningProxy = await inner.start(partial(run, settings, handle_signals=True))
            yield proxy, sim_url
            if wait:
                echo("the proxy keeps serving so you can look around; Ctrl-C stops it")
                await proxy.shutdown.wait()
            else:
                proxy.shutdown.set()
        # The proxy has drained and flushed its audit log; the simulator can go.
        outer.cancel_scope.cancel()
