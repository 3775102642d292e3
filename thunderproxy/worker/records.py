"""The ``worker_events`` rows (migrations/006_worker.sql) and ``worker_seen`` rows
(migrations/012_worker_seen.sql), written through the AuditLog."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from ..audit.records import ToUnix


@dataclass(frozen=True)
class WorkerEventRecord:
    """One thing the worker did or refused; ``data`` is stored as JSON."""

    table: ClassVar[str] = "worker_events"
    at: float
    event: str
    message: str | None = None
    report_addr: str | None = None
    reqnum: int | None = None
    workload: float | None = None
    status: int | None = None
    data: Any = None

    def row(self, to_unix: ToUnix) -> dict[str, Any]:
        return {
            "at": to_unix(self.at),
            "event": self.event,
            "report_addr": self.report_addr,
            "reqnum": self.reqnum,
            "workload": self.workload,
            "status": self.status,
            "message": self.message,
            "data": None if self.data is None else json.dumps(self.data, sort_keys=True),
        }


@dataclass(frozen=True)
class WorkerSeenRecord:
    """A signed request accepted: its number is remembered across restarts against replays."""

    table: ClassVar[str] = "worker_seen"
    at: float
    reqnum: int
    request_idx: int
    path: str

    def row(self, to_unix: ToUnix) -> dict[str, Any]:
        return {
            "at": to_unix(self.at),
            "reqnum": self.reqnum,
            "request_idx": self.request_idx,
            "path": self.path,
        }
