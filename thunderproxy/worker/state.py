"""Worker mode's configuration (settings plus what the Vast.ai platform sets in the
environment) and its live state, shared by the middleware, the reporter and the startup task."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import trio
from cryptography.hazmat.primitives.asymmetric import rsa

from .auth import ReplayGuard
from .ledger import Ledger
from .records import WorkerEventRecord, WorkerSeenRecord

if TYPE_CHECKING:
    from ..audit.records import AuditRecord
    from ..config import Settings

log = logging.getLogger("thunderproxy.worker")

#: Signed request numbers remembered against replays (about 1 MB of ints).
REPLAY_WINDOW = 100_000


@dataclass(frozen=True)
class WorkerConfig:
    report_addrs: tuple[str, ...]
    unsecured: bool = False
    max_wait_time: float = 10.0
    parallel: bool = True
    benchmark: str = ""
    benchmark_cache: str = "thunderproxy-benchmark.json"
    ready_timeout: float = 1200.0
    program_tokens: int = 20_000
    max_body_bytes: int = 32 * 1024 * 1024
    #: The platform's identity for this worker (CONTAINER_ID) and its token (MASTER_TOKEN).
    worker_id: int | str = 0
    master_token: str = field(default="", repr=False)
    #: Where the autoscaler reaches this worker: PUBLIC_IPADDR and VAST_TCP_PORT_<port>;
    #: None when the platform did not say (the listening address is reported instead).
    public_url: str | None = None


def _container_id(raw: str | None) -> int | str:
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        return raw


def worker_config(settings: Settings, environ: Mapping[str, str]) -> WorkerConfig | None:
    """Worker mode's configuration, or None when no report address is configured (off)."""
    raw = settings.report_addr or environ.get("REPORT_ADDR", "")
    addrs = tuple(a.strip().rstrip("/") for a in raw.split(",") if a.strip())
    if not addrs:
        return None
    scheme = "https" if settings.certfile else "http"
    public_ip = environ.get("PUBLIC_IPADDR")
    public_port = environ.get(f"VAST_TCP_PORT_{settings.port}")
    public_url = f"{scheme}://{public_ip}:{public_port}" if public_ip and public_port else None
    return WorkerConfig(
        report_addrs=addrs,
        unsecured=settings.unsecured,
        max_wait_time=settings.max_wait_time,
        parallel=settings.parallel,
        benchmark=settings.benchmark,
        benchmark_cache=settings.benchmark_cache,
        ready_timeout=settings.worker_ready_timeout,
        program_tokens=settings.program_tokens,
        max_body_bytes=settings.max_body_bytes,
        worker_id=_container_id(environ.get("CONTAINER_ID")),
        master_token=environ.get("MASTER_TOKEN", ""),
        public_url=public_url,
    )


class Phase(StrEnum):
    LOADING = "loading"  # waiting for the backend, or benchmarking it
    READY = "ready"
    ERRORED = "errored"  # beacon: serving /health and reporting the error


@dataclass
class Capacity:
    """What the startup benchmark learned about the backends."""

    max_throughput: float
    kv_capacity_tokens: int | None
    programs: int | None
    cached: bool
    details: list[dict[str, Any]] = field(default_factory=list)


class WorkerState:
    def __init__(
        self,
        config: WorkerConfig,
        record: Callable[[AuditRecord], None] = lambda _r: None,
    ) -> None:
        self.config = config
        self.ledger = Ledger()
        self.replay = ReplayGuard(REPLAY_WINDOW)
        self.public_key: rsa.RSAPublicKey | None = None
        #: Why there is no key yet (the last fetch's error), for 503s and /health.
        self.key_error: str | None = None
        self.phase = Phase.LOADING
        self.error: str | None = None
        self.capacity: Capacity | None = None
        #: Seconds from start to ready: reported once, cleared by the report that carried it.
        self.loadtime: float | None = None
        self.started_at = trio.current_time()
        #: Serialises requests under --no-parallel; trio's Lock is fair (first come, first in).
        self.turn = trio.Lock()
        #: Set once the startup task has finished, ready or errored.
        self.settled = trio.Event()
        self._record = record

    def event(self, event: str, message: str | None = None, **fields: Any) -> None:
        record = WorkerEventRecord(at=trio.current_time(), event=event, message=message, **fields)
        self._record(record)

    def accepted(self, reqnum: int, request_idx: int, path: str) -> None:
        """A signed request passed every check: remember its number, here and in the audit db
        (read back at the next start, so a replay after a restart is refused too)."""
        self.replay.add(reqnum)
        self._record(WorkerSeenRecord(trio.current_time(), reqnum, request_idx, path))

    @property
    def secured(self) -> bool:
        return not self.config.unsecured

    def mark_ready(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self.ledger.max_throughput = capacity.max_throughput
        self.loadtime = trio.current_time() - self.started_at
        self.phase = Phase.READY
        self.ledger.changed = True
        self.settled.set()

    def mark_errored(self, message: str) -> None:
        """Beacon mode: keep serving /health and reporting ``message``."""
        log.error("worker errored, reporting it to the autoscaler: %s", message)
        self.error = message
        self.phase = Phase.ERRORED
        self.ledger.changed = True
        self.settled.set()
        self.event("errored", message)

    def health_view(self) -> dict[str, Any]:
        ledger = self.ledger
        capacity = self.capacity
        return {
            "phase": self.phase.value,
            "error": self.error,
            "secured": self.secured,
            "signing_key": "loaded"
            if self.public_key is not None
            else ("not needed" if not self.secured else f"missing: {self.key_error or 'fetching'}"),
            "max_throughput": ledger.max_throughput,
            "kv_capacity_tokens": None if capacity is None else capacity.kv_capacity_tokens,
            "programs_capacity": None if capacity is None else capacity.programs,
            "pending_workload": ledger.pending,
            "wait_estimate_s": ledger.wait_estimate(),
            "requests_working": len(ledger.working),
            "report_addrs": list(self.config.report_addrs),
        }
