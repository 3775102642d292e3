"""The hold ledger weighs waits on both sides (scheduling/costs.py): a held call's wait in the
proxy while the engine was full is no cost of holding (released, it would have waited in the
engine's queue), and a call's wait in the engine's queue is no cost of not holding (held, it
would have waited in the proxy)."""

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


def test_a_held_call_is_charged_only_its_wait_while_the_engine_had_room() -> None:
    ledger = measured().observe_call(
        waited_s=70.0,
        in_flight=9,
        reuse_tokens=0,
        missed_tokens=0,
        holding=True,
        first_token_s=5.5,
        uncached_tokens=20_000,
        displaced_s=45.0,
    )
    assert ledger.cost_on == pytest.approx(25.0)
    assert ledger.inputs()["engine_queue_s"] == pytest.approx(5.0)  # logged, not charged
    # Full for longer than the call waited (a poll's state carried to its next): all of it.
    whole = measured().observe_call(
        waited_s=10.0, in_flight=9, reuse_tokens=0, missed_tokens=0, holding=True,
        displaced_s=12.0,
    )  # fmt: skip
    assert whole.cost_on == 0.0
    assert whole.inputs()["displaced"] == 1.0


def test_the_engines_queue_under_a_growing_load_does_not_bring_holding_back() -> None:
    # Chat sessions: held newcomers waited 4 s each while the engine had room and kept no
    # history; holding stops. Then the load builds up and calls sent at once wait in the
    # engine's queue, a minute and more: held, they would have waited as long in the proxy.
    newcomers = [(4.0, 0.3)] * costs.MIN_CALLS
    ledger = measured()
    for waited, first_token in newcomers:
        ledger = ledger.observe_call(
            waited_s=waited, in_flight=8, reuse_tokens=0, missed_tokens=0,
            holding=ledger.holding, first_token_s=first_token, uncached_tokens=6_000,
        )  # fmt: skip
    assert not ledger.holding
    for n in range(1_000):
        ledger = ledger.observe_call(
            waited_s=0.0, in_flight=40, reuse_tokens=0, missed_tokens=0, holding=False,
            first_token_s=15.0 + n / 10, uncached_tokens=6_000,
        )  # fmt: skip
        assert not ledger.holding
    assert ledger.cost_off == 0.0
    assert ledger.inputs()["engine_queue_s"] > 100


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
            # Full from b's arrival until the first poll showing room is read: 12 s, give or
            # take a poll and a tick of the monitor (1 s each).
            assert 11.0 <= lease.displaced_s <= 14.0
            sched.close(lease, StepUsage(2_000, 10, 0), reason="response complete",
                        first_token_at=lease.sent_at + 0.1)  # fmt: skip
            ledger = sched.schedule_of(B0).hold
            assert ledger.displaced == pytest.approx(lease.displaced_s / waited)
            sched.close(hog, StepUsage(9_000, 10, 0), reason="response complete")
            nursery.cancel_scope.cancel()
