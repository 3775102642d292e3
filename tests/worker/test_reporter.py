"""The load reporter's timing and windowed counters, on trio's MockClock. The autoscaler
stand-in is the same ASGI app the end-to-end tests serve on loopback, called in-process here
so that virtual time is the only time."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import httpx
import pytest
import trio

from tests.worker.autoscaler import Autoscaler
from thunderproxy.worker.ledger import Outcome
from thunderproxy.worker.records import WorkerEventRecord
from thunderproxy.worker.reporter import (
    REPORT_ATTEMPTS,
    REPORT_RETRY_DELAY_S,
    report_due,
    serve_load_reporter,
)
from thunderproxy.worker.signals import ProgramSignals
from thunderproxy.worker.state import Capacity, WorkerConfig, WorkerState

ADDR = "http://autoscaler.test"


@asynccontextmanager
async def reporting(
    scaler: Autoscaler, state: WorkerState, **kwargs: object
) -> AsyncIterator[None]:
    transport = httpx.ASGITransport(app=scaler)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport) as client, trio.open_nursery() as nursery:
        await nursery.start(
            partial(serve_load_reporter, state, client, url="http://w", disk=lambda: 5.0, **kwargs)
        )
        yield
        nursery.cancel_scope.cancel()


def ready_state(events: list[WorkerEventRecord] | None = None) -> WorkerState:
    state = WorkerState(
        WorkerConfig(report_addrs=(ADDR,), worker_id=42, master_token="tok"),
        record=(events.append if events is not None else lambda _r: None),
    )
    state.mark_ready(Capacity(max_throughput=10.0, kv_capacity_tokens=80_000, programs=4,
                              cached=False))  # fmt: skip
    return state


def test_report_due() -> None:
    assert report_due(5.0, None, changed=False)
    assert report_due(5.0, 4.5, changed=True)
    assert not report_due(14.9, 5.0, changed=False)
    assert report_due(15.0, 5.0, changed=False)


async def test_every_second_when_changed_else_every_ten_seconds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scaler = Autoscaler()
    state = ready_state()
    t0 = trio.current_time()
    async with reporting(scaler, state):
        await trio.sleep(22.5)
        state.ledger.start(3.0)  # a change: reported on the next tick, not 10 s later
        await trio.sleep(5.0)
    assert [t - t0 for t in scaler.report_times] == [1.0, 11.0, 21.0, 23.0]
    first = scaler.reports[0]
    assert first["id"] == 42
    assert first["mtoken"] == "tok"
    assert first["url"] == "http://w"
    assert first["max_perf"] == 10.0
    assert scaler.reports[3]["cur_load"] == 3.0
    assert scaler.reports[3]["num_requests_working"] == 1


async def test_loadtime_is_reported_exactly_once(autojump_clock: trio.testing.MockClock) -> None:
    scaler = Autoscaler()
    state = WorkerState(WorkerConfig(report_addrs=(ADDR,)))
    async with reporting(scaler, state):
        await trio.sleep(30.0)  # loading: reports every 10 s, no load time yet
        state.mark_ready(Capacity(max_throughput=2.0, kv_capacity_tokens=None, programs=None,
                                  cached=True))  # fmt: skip
        await trio.sleep(25.0)
    loadtimes = [r["loadtime"] for r in scaler.reports]
    assert loadtimes.count(0.0) == len(loadtimes) - 1
    assert [lt for lt in loadtimes if lt] == [30.0]
    assert scaler.reports[0]["thunderproxy"]["phase"] == "loading"
    assert scaler.reports[-1]["thunderproxy"]["phase"] == "ready"


async def test_failed_reports_keep_the_window_and_nothing_is_counted_twice(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scaler = Autoscaler()
    events: list[WorkerEventRecord] = []
    state = ready_state(events)
    ledger = state.ledger
    served = 0.0
    async with reporting(scaler, state):
        for cost in (1.0, 2.0, 4.0):
            ledger.finish(ledger.start(cost), Outcome.SERVED)
            served += cost
            await trio.sleep(1.5)
        scaler.report_status = 503  # the autoscaler goes away
        outage_start = trio.current_time()
        for cost in (8.0, 16.0):
            ledger.finish(ledger.start(cost), Outcome.SERVED)
            served += cost
            await trio.sleep(3.0)
        ledger.reject(5.0)
        ledger.finish(ledger.start(32.0), Outcome.CANCELLED)
        await trio.sleep(10.0)
        assert ledger.window.served == 24.0  # kept through every failed report
        scaler.report_status = 200
        recovered = trio.current_time()
        await trio.sleep(12.0)
    assert scaler.served_total() == served == ledger.totals.served
    assert sum(r["rej_load"] for r in scaler.reports) == 5.0
    # new_load is received minus cancelled, per window.
    assert sum(r["new_load"] for r in scaler.reports) == served
    assert ledger.window.served == 0.0
    failed = [e for e in events if e.event == "report_failed"]
    assert failed
    assert all("503" in (e.message or "") for e in failed)
    assert all(e.report_addr == ADDR for e in failed)
    assert not [t for t in scaler.report_times if outage_start <= t < recovered]
    # Each failed report spent its retries, spaced by the retry delay, before giving up.
    first_failure = next(e for e in events if e.event == "report_failed")
    assert first_failure.at >= outage_start + (REPORT_ATTEMPTS - 1) * REPORT_RETRY_DELAY_S


async def test_program_signals_ride_along(autojump_clock: trio.testing.MockClock) -> None:
    scaler = Autoscaler()
    state = ready_state()
    signals = ProgramSignals(running=3, acting=2, paused=4, kv_demand_tokens=120_000,
                             kv_capacity_tokens=80_000, queue_wait_p90_s=7.25)  # fmt: skip
    async with reporting(scaler, state, signals=lambda: signals):
        await trio.sleep(1.5)
    extra = scaler.reports[0]["thunderproxy"]
    assert extra["programs"] == {
        "programs_running": 3,
        "programs_acting": 2,
        "programs_paused": 4,
        "kv_demand_tokens": 120_000,
        "kv_capacity_tokens": 80_000,
        "kv_demand_ratio": 1.5,
        "queue_wait_p90_s": 7.25,
    }
    assert extra["programs_capacity"] == 4


@pytest.mark.parametrize("unsecured", [False, True])
async def test_a_missing_signing_key_is_reported_as_the_error(
    autojump_clock: trio.testing.MockClock, unsecured: bool
) -> None:
    scaler = Autoscaler()
    state = WorkerState(WorkerConfig(report_addrs=(ADDR,), unsecured=unsecured))
    state.key_error = "http://autoscaler.test/pubkey/: answered 500"
    async with reporting(scaler, state):
        await trio.sleep(1.5)
    error = scaler.reports[0]["error_msg"]
    assert (error == "") is unsecured
    assert unsecured or "cannot verify requests" in error


async def test_a_backend_that_goes_down_after_startup_is_reported_until_it_is_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from thunderproxy.backends import BackendPool

    scaler = Autoscaler()
    state = ready_state()
    pool = BackendPool()
    node = pool.add("http://127.0.0.1:9")
    t0 = trio.current_time()
    try:
        async with reporting(scaler, state, pool=pool):
            await trio.sleep(12.5)  # reports at 1 and 11
            node.health.down("connection refused")
            await trio.sleep(2.0)  # reported on the next tick, not after 10 s
            node.health.ok()
            await trio.sleep(2.0)
    finally:
        await pool.aclose()
    assert [t - t0 for t in scaler.report_times] == [1.0, 11.0, 13.0, 15.0]
    errors = [r["error_msg"] for r in scaler.reports]
    assert errors == ["", "", "no healthy backend: http://127.0.0.1:9: connection refused", ""]


async def test_ended_signed_requests_are_handed_back_and_kept_through_an_outage(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from thunderproxy.worker.reporter import serve_request_cleanup

    scaler = Autoscaler()
    events: list[WorkerEventRecord] = []
    state = ready_state(events)
    ledger = state.ledger
    transport = httpx.ASGITransport(app=scaler)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport) as client, trio.open_nursery() as nursery:
        await nursery.start(serve_request_cleanup, state, client)
        ledger.finish(ledger.start(1.0, 7), Outcome.SERVED)
        ledger.finish(ledger.start(1.0, 8), Outcome.ERRORED)
        ledger.finish(ledger.start(1.0), Outcome.SERVED)  # unsigned: the autoscaler never knew it
        ledger.reject(2.0, 9)
        await trio.sleep(1.5)
        assert scaler.deletes == [
            {"worker_id": 42, "mtoken": "tok", "request_idxs": [7], "success": True},
            {"worker_id": 42, "mtoken": "tok", "request_idxs": [8, 9], "success": False},
        ]
        scaler.report_status = 503
        ledger.finish(ledger.start(1.0, 10), Outcome.CANCELLED)
        await trio.sleep(10.0)
        assert len(scaler.deletes) == 2
        assert ledger.done == [(10, True)]
        scaler.report_status = 200
        await trio.sleep(6.0)
        assert scaler.deletes[2:] == [
            {"worker_id": 42, "mtoken": "tok", "request_idxs": [10], "success": True}
        ]
        assert ledger.done == []
        nursery.cancel_scope.cancel()
    assert any(e.event == "cleanup_failed" for e in events)


def test_acknowledge_leaves_what_arrived_during_the_send_and_skips_what_was_dropped() -> None:
    from thunderproxy.worker.ledger import Ledger

    ledger = Ledger()
    ledger.done = [(1, True), (2, True), (3, False)]
    ledger.acknowledge(2, ledger.done_dropped)  # took 1 and 2; 3 arrived meanwhile
    assert ledger.done == [(3, False)]
    ledger.done = [(4, True), (5, True), (6, True)]
    before = ledger.done_dropped
    ledger.done_dropped += 2  # 4 and 5 were dropped for room while the batch was in flight
    del ledger.done[:2]
    ledger.done.append((7, True))
    ledger.acknowledge(3, before)  # took 4, 5, 6: only 6 is still there
    assert ledger.done == [(7, True)]
