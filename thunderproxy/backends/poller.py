"""The metrics poller: every interval, read each backend's /health, /metrics and /v1/models,
keep the newest snapshot and served models on its node, and log one ``backend_samples`` row per
backend. Probes go through the backend seam, so the same poller runs over HTTP or in-process."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import trio

from ..audit import AuditLog, BackendSample
from ..errors import BackendError
from .base import UpstreamRequest, UpstreamResponse
from .metrics import interpret
from .pool import BackendNode, BackendPool

log = logging.getLogger("thunderproxy.backends")

#: A probe that takes longer than this counts as a failed health check.
PROBE_TIMEOUT_S = 5.0
#: Largest /metrics or /v1/models answer read (a misbehaving backend cannot exhaust memory).
MAX_PROBE_BYTES = 8 * 1024 * 1024

#: Programs and their active tokens per backend URL, for the samples (from the registry).
LoadProbe = Callable[[], Mapping[str, tuple[int, int]]]


async def _get(node: BackendNode, target: str) -> tuple[int, bytes]:
    response: UpstreamResponse = await node.backend.send(UpstreamRequest("GET", target))
    try:
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > MAX_PROBE_BYTES:
                break
        return response.status_code, bytes(body)
    finally:
        await response.aclose()


def model_cards(body: bytes) -> dict[str, dict[str, Any]]:
    """The entries of an OpenAI ``/v1/models`` answer, by id (unreadable entries skipped)."""
    try:
        data = json.loads(body).get("data")
    except (ValueError, AttributeError):
        return {}
    if not isinstance(data, list):
        return {}
    return {
        card["id"]: card
        for card in data
        if isinstance(card, dict) and isinstance(card.get("id"), str)
    }


async def poll_backend(node: BackendNode, *, metrics: bool, models: bool = True) -> None:
    """One health (and metrics, models) probe; updates ``node`` in place, never raises."""
    try:
        with trio.fail_after(PROBE_TIMEOUT_S):
            status, _ = await _get(node, "/health")
            if status >= 500:
                node.health.down(f"/health answered {status}")
                return
            if metrics:
                status, body = await _get(node, "/metrics")
                if status == 200:
                    snapshot = interpret(body.decode("utf-8", "replace"))
                    if snapshot is not None:
                        node.snapshot = snapshot
            if models and not node.models_configured:
                status, body = await _get(node, "/v1/models")
                cards = model_cards(body) if status == 200 else {}
                if cards:
                    node.models = frozenset(cards)
                    node.model_cards = cards
        node.health.ok()
    except trio.TooSlowError:
        # A backend too busy to answer in time is not a dead one: only repeated slow probes
        # (or slow requests) take it out of placement.
        node.health.slow(
            f"Backend {node.url} did not answer its health probe within {PROBE_TIMEOUT_S:g} s."
        )
    except BackendError as exc:
        node.health.failed(exc)
    finally:
        node.last_poll_at = trio.current_time()


async def poll_all(pool: BackendPool, *, metrics: bool, models: bool = True) -> None:
    async with trio.open_nursery() as nursery:
        for node in pool:
            nursery.start_soon(partial(poll_backend, node, metrics=metrics, models=models))


def backend_sample(node: BackendNode, load: tuple[int, int] | None, now: float) -> BackendSample:
    """The ``backend_samples`` row for a backend as its latest poll left it."""
    snap = node.snapshot
    return BackendSample(
        at=now,
        backend=node.url,
        healthy=node.healthy,
        capacity_tokens=None if snap is None else snap.capacity_tokens,
        kv_usage=None if snap is None else snap.kv_usage,
        running=None if snap is None or snap.running is None else int(snap.running),
        waiting=None if snap is None or snap.waiting is None else int(snap.waiting),
        prefix_queries_total=None if snap is None else snap.prefix_queries_total,
        prefix_hits_total=None if snap is None else snap.prefix_hits_total,
        preemptions_total=None if snap is None else snap.preemptions_total,
        programs=0 if load is None else load[0],
        active_tokens=0 if load is None else load[1],
        error=node.last_error,
        cpu_capacity_tokens=None if snap is None else snap.cpu_capacity_tokens,
        offload_load_bytes_total=None if snap is None else _loads(snap.offload_bytes),
        offload_load_seconds_total=None if snap is None else _loads(snap.offload_seconds),
    )


def _loads(by_transfer: tuple[tuple[str, float], ...]) -> float | None:
    """The CPU->GPU part of a connector counter (None: the backend has no connector)."""
    return dict(by_transfer).get("CPU_to_GPU")


async def wait_until_ready(pool: BackendPool, *, interval: float = 0.5) -> None:
    """Poll /health until every backend answers (health-gated start); the caller bounds the
    wait. Progress goes to the log every few seconds."""
    next_report = trio.current_time() + 5.0
    while True:
        await poll_all(pool, metrics=False)
        waiting = [n.url for n in pool if not n.healthy]
        if not waiting:
            return
        if trio.current_time() >= next_report:
            log.info("waiting for backends to answer /health: %s", ", ".join(waiting))
            next_report = trio.current_time() + 5.0
        await trio.sleep(interval)


async def serve_metrics_poller(
    pool: BackendPool,
    audit: AuditLog,
    *,
    interval: float,
    loads: LoadProbe,
    metrics: bool = True,
    on_poll: Callable[[], None] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Poll forever. Ready (``task_status.started()``) after the first round, so the proxy never
    starts scheduling on capacity it has not read yet."""
    started = False
    while True:
        await poll_all(pool, metrics=metrics)
        by_backend = loads()
        now = trio.current_time()
        for node in pool:
            audit.record(backend_sample(node, by_backend.get(node.url), now))
        if on_poll is not None:
            on_poll()
        if not started:
            started = True
            task_status.started()
        await trio.sleep(interval)
