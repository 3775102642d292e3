"""The metrics poller: every interval, read each backend's /health and /metrics, keep the newest
snapshot on the Backend, and log one ``backend_samples`` row per backend."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import trio

from ..audit import AuditLog, BackendSample
from ..errors import BackendError, BackendTimeout
from ..programs import ProgramRegistry
from ..programs.registry import BackendLoad
from .metrics import interpret
from .pool import Backend, BackendPool, map_httpx_errors

log = logging.getLogger("thunderproxy.backends")

#: A probe that takes longer than this counts as a failed health check.
PROBE_TIMEOUT_S = 5.0


async def poll_backend(backend: Backend, *, metrics: bool) -> None:
    """One health (and metrics) probe; updates ``backend`` in place, never raises."""
    try:
        with map_httpx_errors(backend.url), trio.fail_after(PROBE_TIMEOUT_S):
            health = await backend.client.get("/health")
            if health.status_code >= 500:
                backend.mark_failed(f"/health answered {health.status_code}")
                return
            if metrics:
                response = await backend.client.get("/metrics")
                if response.status_code == 200:
                    snapshot = interpret(response.text)
                    if snapshot is not None:
                        backend.snapshot = snapshot
        backend.mark_ok()
    except BackendTimeout as exc:
        # A backend too busy to answer in time is not a dead one: only repeated slow probes
        # (or slow requests) take it out of placement.
        backend.record_failure(exc.message)
    except BackendError as exc:
        backend.mark_failed(exc.message)
    finally:
        backend.last_poll_at = trio.current_time()


async def poll_all(pool: BackendPool, *, metrics: bool) -> None:
    async with trio.open_nursery() as nursery:
        for backend in pool:
            nursery.start_soon(partial(poll_backend, backend, metrics=metrics))


def backend_sample(backend: Backend, load: BackendLoad | None, now: float) -> BackendSample:
    """The ``backend_samples`` row for a backend as its latest poll left it."""
    snap = backend.snapshot
    return BackendSample(
        at=now,
        backend=backend.url,
        healthy=backend.healthy,
        capacity_tokens=None if snap is None else snap.capacity_tokens,
        kv_usage=None if snap is None else snap.kv_usage,
        running=None if snap is None or snap.running is None else int(snap.running),
        waiting=None if snap is None or snap.waiting is None else int(snap.waiting),
        prefix_queries_total=None if snap is None else snap.prefix_queries_total,
        prefix_hits_total=None if snap is None else snap.prefix_hits_total,
        preemptions_total=None if snap is None else snap.preemptions_total,
        programs=0 if load is None else load.total,
        active_tokens=0 if load is None else load.active_tokens,
        error=backend.last_error,
    )


async def wait_until_ready(pool: BackendPool, *, interval: float = 0.5) -> None:
    """Poll /health until every backend answers (health-gated start); the caller bounds the
    wait. Progress goes to the log every few seconds."""
    next_report = trio.current_time() + 5.0
    while True:
        await poll_all(pool, metrics=False)
        waiting = [b.url for b in pool if not b.healthy]
        if not waiting:
            return
        if trio.current_time() >= next_report:
            log.info("waiting for backends to answer /health: %s", ", ".join(waiting))
            next_report = trio.current_time() + 5.0
        await trio.sleep(interval)


async def serve_metrics_poller(
    pool: BackendPool,
    registry: ProgramRegistry,
    audit: AuditLog,
    *,
    interval: float,
    metrics: bool = True,
    on_poll: Callable[[], None] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Poll forever. Ready (``task_status.started()``) after the first round, so the proxy never
    starts scheduling on capacity it has not read yet."""
    started = False
    while True:
        await poll_all(pool, metrics=metrics)
        loads = registry.load_by_backend()
        now = trio.current_time()
        for backend in pool:
            audit.record(backend_sample(backend, loads.get(backend.url), now))
        if on_poll is not None:
            on_poll()
        if not started:
            started = True
            task_status.started()
        await trio.sleep(interval)
