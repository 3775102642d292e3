"""Rows the audit channel cannot take are dropped (serving never waits for SQLite), and every
drop is counted and reported."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from tests.conftest import running_proxy
from thunderproxy.audit import AuditLog
from thunderproxy.audit.records import AuditRecord, RejectionRecord
from thunderproxy.sim import SimConfig, open_simulator


def rejection(i: int) -> RejectionRecord:
    return RejectionRecord(
        at=0.0, method="GET", path=f"/{i}", status=400, error_type="x", message="m"
    )


def test_a_full_channel_drops_and_counts() -> None:
    send, receive = trio.open_memory_channel[AuditRecord](3)
    audit = AuditLog(send, run_id=1)
    for i in range(10):
        audit.record(rejection(i))
    stats = audit.statistics()
    assert (stats.accepted, stats.dropped, stats.queued) == (3, 7, 3)
    receive.close()
    audit.record(rejection(11))  # a closed channel drops too, and never raises
    assert audit.statistics().dropped == 8


async def test_drops_are_reported_in_health_and_metrics(tmp_path: Path) -> None:
    async with (
        open_simulator(SimConfig()) as sim,
        running_proxy(tmp_path / "a.db", backends=sim.url, audit_queue=1) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        # No checkpoint between these: the writer cannot drain the one-row channel meanwhile.
        for i in range(10):
            proxy.audit.record(rejection(i))
        dropped = proxy.audit.statistics().dropped
        assert dropped >= 8
        assert (await client.get("/metrics")).json()["audit"]["dropped"] >= dropped
        assert (await client.get("/health")).json()["audit"]["dropped"] >= dropped
