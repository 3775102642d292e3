"""The worker_signals run end to end, small: the reports carry program signals that follow the
agents (slow: a few seconds of real time)."""

from __future__ import annotations

import pytest

from thunderproxy.bench.studies.worker_signals import main


@pytest.mark.slow
async def test_reports_follow_the_agents() -> None:
    reports = await main(programs=4, rate=2.0, time_scale=0.05, concurrency=4)
    signals = [r["thunderproxy"]["programs"] for r in reports]
    assert max(s["programs_running"] + s["programs_acting"] + s["programs_paused"]
               for s in signals) >= 2  # fmt: skip
    assert max(s["kv_demand_ratio"] or 0 for s in signals) > 0
    assert sum(r["cur_perf"] for r in reports) > 0
