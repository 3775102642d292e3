"""The hold ledger weighs waits on both sides (scheduling/costs.py): a held call's wait in the
proxy where the engine was full anyway is no cost of holding, and a call sent without holding
is charged its wait in the engine's queue."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import trio

from thunderproxy.programs import StepUsage
from thunderproxy.scheduling import costs
from thunderproxy.scheduling.costs import HoldLedger
from thunderproxy.scheduling.learners import SATURATED_KV, Saturation
from thunderproxy.scheduling.scheduler import serve_resume_monitor

from .test_scheduler import B0, CFG, begin, open_harness, snapshot

RATE = 25e-6  # prefill seconds per uncached token (20,000 tokens in 0.5 s)


def measured() -> HoldLedger:
    return HoldLedger().observe_prefill(20_000, 0.5)


def held(ledger: HoldLedger, n: int, *, displaced_s: float) -> tuple[HoldLedger, list[bool]]:
    """``n`` calls of 64 agents on an engine at capacity (the SWE-agent trace at 432K): each
    waited 70 s in the proxy, found 11K of its 17K history still cached and was sent into an
    engine whose queue it did not wait in; ``displaced_s`` of its wait the engine was full."""
    states = []
    for _ in range(n):
        ledger = ledger.observe_call(
            waited_s=70.0,
            in_flight=63,
            reuse_tokens=17_000,
            missed_tokens=6_000,
            holding=ledger.holding,
            first_token_s=0.3,
            uncached_tokens=6_000,
            displaced_s=displaced_s,
        )
        states.append(ledger.holding)
    return ledger, states


def test_saturation_counts_the_seconds_the_engine_was_seen_full() -> None:
    s = Saturation()
    assert s.seconds(100.0) == 0.0
    s = s.observe(0.0, 0.5, 0)  # room: nothing counts
    assert s.seconds(10.0) == 0.0
    s = s.observe(10.0, SATURATED_KV, 0)  # full from here, until a poll says otherwise
    assert s.seconds(13.0) == 3.0
    assert s.observe(10.0, 0.1, 0) == s  # the same poll read again at the next tick
    s = s.observe(15.0, 0.6, 3)  # calls queued in the engine: full, whatever its KV use
    assert s.seconds(15.0) == 5.0
    s = s.observe(20.0, 0.6, 0)
    assert s.seconds(20.0) == 10.0
    assert s.seconds(1_000.0) == 10.0
    assert s.observe(21.0, None, None).seconds(30.0) == 10.0  # a poll that said nothing


def test_a_hold_while_the_engine_is_full_anyway_keeps_holding() -> None:
    # Kept history: 11,000 · 25 µs · 64 = 17.6 s a call, counted twice: 35.2 s against a
    # 70 s wait, 64% of which the engine was full (what the polls of the 64-agent run showed
    # over the held calls' waits before its ledger stopped holding): released, the call would
    # have waited those 45 s in the engine's queue.
    ledger, states = held(measured(), 1_000, displaced_s=45.0)
    assert all(states)
    assert ledger.inputs()["gain_s"] == pytest.approx(35.2 - 25.0)
    assert ledger.inputs()["displaced"] == round(45.0 / 70.0, 3)


def test_a_hold_while_the_engine_has_room_still_stops() -> None:
    # The same calls where the engine had room all along: the whole wait is holding's.
    ledger, states = held(measured(), costs.MIN_CALLS, displaced_s=0.0)
    assert not ledger.holding
    assert states.index(False) == costs.MIN_CALLS - 1
    assert ledger.inputs()["gain_s"] == pytest.approx(35.2 - 70.0)


def test_without_holding_a_call_is_charged_its_wait_in_the_engines_queue() -> None:
    ledger, _ = held(measured(), costs.MIN_CALLS, displaced_s=0.0)
    assert not ledger.holding

    # Sent at once, calls now lose only 2K of their history (2,000 · 25 µs · 64 = 3.2 s)
    # but wait 60 s in the engine's queue before their 0.5 s prefill: dearer than the 70.6
    # s held calls cost (their wait and 1.2 s of recompute)? No: 63.7 s, cheaper; at 80 s
    # in the queue, dearer.
    def off(ledger: HoldLedger, n: int, first_token_s: float) -> tuple[HoldLedger, list[bool]]:
        states = []
        for _ in range(n):
            ledger = ledger.observe_call(
                waited_s=0.0,
                in_flight=63,
                reuse_tokens=17_000,
                missed_tokens=2_000,
                holding=ledger.holding,
                first_token_s=first_token_s,
                uncached_tokens=20_000,
            )
            states.append(ledger.holding)
        return ledger, states

    cheaper, states = off(ledger, 500, 60.5)
    assert not any(states)
    assert cheaper.cost_off == pytest.approx(60.0 + 3.2)
    assert cheaper.inputs()["engine_queue_s"] == pytest.approx(60.0, abs=0.1)
    dearer, states = off(ledger, costs.MIN_CALLS_OFF, 80.5)
    assert dearer.holding  # measured dearer without holding: back on
    assert states.index(True) == costs.MIN_CALLS_OFF - 1
    assert dearer.cost_off == pytest.approx(80.0 + 3.2)


def test_a_held_call_is_charged_its_wait_in_the_engines_queue_too() -> None:
    base = measured()
    ledger = base.observe_call(
        waited_s=10.0,
        in_flight=9,
        reuse_tokens=0,
        missed_tokens=0,
        holding=True,
        first_token_s=5.5,
        uncached_tokens=20_000,
    )
    assert ledger.cost_on == pytest.approx(15.0)
    # A first token not seen (the call failed first) charges no queue.
    blind = base.observe_call(
        waited_s=10.0, in_flight=9, reuse_tokens=0, missed_tokens=0, holding=True
    )
    assert blind.cost_on == 10.0


async def test_a_held_call_learns_how_long_the_polls_showed_its_engine_full(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A hog fills the backend; b is queued behind it until the bound (20 s) sends it out.
    # The polls show the engine full for the first 12 s of b's wait, then with room.
    async with open_harness(replace(CFG, max_wait_s=20)) as harness:
        sched = harness.scheduler
        node = sched.pool.get(B0)
        assert node is not None
        full = True

        async def poller(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            task_status.started()
            while True:
                kv = 0.97 if full else 0.5
                node.snapshot = replace(snapshot(10_000), kv_usage=kv)
                node.last_poll_at = trio.current_time()
                await trio.sleep(1)

        async with trio.open_nursery() as nursery:
            await nursery.start(poller)
            await nursery.start(partial(serve_resume_monitor, sched, interval=1.0))
            hog = await begin(sched, "hog", arrived_at=trio.current_time(), context_chars=36_000)
            lease = None

            async def b() -> None:
                nonlocal lease
                lease = await begin(sched, "b", arrived_at=trio.current_time(), context_chars=8_000)

            nursery.start_soon(b)
            await trio.sleep(12)
            full = False
            await trio.sleep(20)
            assert lease is not None
            waited = lease.sent_at - lease.arrived_at
            assert waited == pytest.approx(20.0)
            # Full from b's arrival until the first poll showing room (12 s, to a tick).
            assert 11.0 <= lease.displaced_s <= 13.0
            sched.close(lease, StepUsage(2_000, 10, 0), reason="response complete",
                        first_token_at=lease.sent_at + 0.1)  # fmt: skip
            ledger = sched.schedule_of(B0).hold
            assert ledger.displaced == pytest.approx(lease.displaced_s / waited)
            sched.close(hog, StepUsage(9_000, 10, 0), reason="response complete")
            nursery.cancel_scope.cancel()
