"""``Snapshot``: the running proxy's state at one moment (programs by state, backends, the audit
writer, admission, shared KV claims, components, file descriptors), taken in one place.

``/health``, JSON ``/metrics`` and worker mode's load reports read it instead of each walking
the registry and the pool; Prometheus' figures are built from it (``statistics.ProxyStatistics``,
which adds what the proxy counted since it started). It is cheap to take and never changes
after.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import trio

from . import descriptors
from .audit.writer import AuditStatistics
from .backends import BackendPool
from .backends.metrics import EngineSnapshot
from .programs import ProgramRegistry, ProgramStatus
from .programs.registry import BackendLoad
from .supervision import ComponentStatistics


@dataclass(frozen=True)
class BackendSnapshot:
    """One backend as the pool knows it now: health, calls in flight, models, its last metrics
    and the load its programs put on it."""

    url: str
    healthy: bool
    last_error: str | None
    in_flight: int
    models: tuple[str, ...] | None
    engine: EngineSnapshot | None
    load: BackendLoad

    @property
    def capacity_tokens(self) -> int | None:
        return None if self.engine is None else self.engine.capacity_tokens


@dataclass(frozen=True)
class Snapshot:
    """The proxy's state at one moment (``take``)."""

    router: str
    programs: int
    by_status: dict[ProgramStatus, int]
    backends: tuple[BackendSnapshot, ...]
    served_models: tuple[str, ...]
    audit: AuditStatistics
    #: Limits, usage and queues per model and class (docs/LIMITS.md); None without [limits].
    admission: Mapping[str, Any] | None = None
    #: The KV claims shared with other instances through Redis; None without --redis.
    shared_kv: Mapping[str, Any] | None = None
    #: The supervised long-lived components (supervision.py).
    components: tuple[ComponentStatistics, ...] = ()
    #: The proxy's own file descriptors (descriptors.py): open, limit, refusals, problem.
    descriptors: Mapping[str, Any] | None = None

    @property
    def healthy_backends(self) -> list[str]:
        return [b.url for b in self.backends if b.healthy]

    @property
    def degraded(self) -> list[str]:
        """What keeps the proxy from being fully well, besides its backends: a component
        failed or waiting to restart, or running but not answering (the explorer), audit rows
        being lost (a db deleted, full or read-only), the proxy out of file descriptors
        (``/health``'s ``degraded``)."""
        reasons = [f"{c.name} {c.state.value}: {c.last_error}" for c in self.components if not c.up]
        reasons += [f"{c.name}: {c.problem}" for c in self.components if c.up and c.problem]
        if self.audit.degraded is not None:
            reasons.append(self.audit.degraded)
        problem = None if self.descriptors is None else self.descriptors.get("problem")
        if problem:
            reasons.append(str(problem))
        return reasons


def take(
    *,
    router: str,
    registry: ProgramRegistry,
    pool: BackendPool,
    audit: AuditStatistics,
    admission: Mapping[str, Any] | None = None,
    shared_kv: Mapping[str, Any] | None = None,
    components: tuple[ComponentStatistics, ...] = (),
) -> Snapshot:
    loads = registry.load_by_backend()
    shown: Mapping[str, Any] | None = None
    try:
        trio.current_time()
    except RuntimeError:  # taken outside a trio run (a report after it ended)
        pass
    else:
        # Counting takes a descriptor, and its failure is noted: the clock is read after it.
        found = descriptors.usage()
        shown = descriptors.current().as_dict(trio.current_time(), found)
    return Snapshot(
        router=router,
        programs=len(registry),
        by_status=registry.counts(),
        backends=tuple(
            BackendSnapshot(
                url=node.url,
                healthy=node.healthy,
                last_error=node.last_error,
                in_flight=node.in_flight,
                models=None if node.models is None else tuple(sorted(node.models)),
                engine=node.snapshot,
                load=loads.get(node.url, BackendLoad()),
            )
            for node in pool
        ),
        served_models=tuple(pool.served_models()),
        audit=audit,
        admission=admission,
        shared_kv=shared_kv,
        components=components,
        descriptors=shown,
    )
