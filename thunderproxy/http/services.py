"""``Services``: everything a route may use, built by the runtime (``runtime.run``) over the
core (``core.build_core``), never by the routes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from .. import snapshot
from ..admission.service import AdmissionService
from ..admission.shared_kv import SharedBackends
from ..backends import BackendPool
from ..clock import WallClock
from ..config import Settings
from ..gateway import Gateway
from ..programs.profile import Profiles
from ..protocols.recognition import ProgramRecognizer
from ..scheduling import Scheduler
from ..snapshot import Snapshot
from ..statistics import Counters
from ..supervision import Components
from .readiness import Readiness


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

    def snapshot(self) -> Snapshot:
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
