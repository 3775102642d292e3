"""Holding only where programs are seen to come back: tr holds programs back on a backend only
once at least half of the programs whose call ended there came back within the horizon, and
nothing before the first return (costs.HoldLedger.seen_returns, views.ViewSource.holding)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import trio

from thunderproxy.audit import DecisionRecord
from thunderproxy.programs import ProgramStatus
from thunderproxy.scheduling import costs
from thunderproxy.scheduling.costs import HoldLedger

from .test_scheduler import B0, Harness, open_harness
from .test_scheduler import CFG as SCHEDULER_CFG

#: The scheduler tests' configuration with the rule on (serve's default).
CFG = replace(SCHEDULER_CFG, return_evidence=True)


def test_the_share_back_is_nothing_before_a_return_and_follows_what_programs_do() -> None:
    ledger = HoldLedger()
    assert ledger.returns == 0.0
    assert not ledger.seen_returns
    ledger = ledger.observe_return(True).observe_return(True)
    assert not ledger.seen_returns  # two back against the prior's two not back: not yet
    ledger = ledger.observe_return(True)
    assert ledger.seen_returns  # agents back within a second hold after three returns
    # Sessions that end after a call or two, turns minutes apart: the share falls with them.
    for _ in range(10):
        ledger = ledger.observe_return(False)
    assert ledger.returns < costs.RETURNS_TO_HOLD
    assert not ledger.seen_returns
    inputs = ledger.inputs()
    assert inputs["returns"] == round(ledger.returns, 4)
    assert inputs["gone"] > inputs["returned"]


async def timed_step(harness: Harness, program_id: str, tokens: int) -> float:
    start = trio.current_time()
    await harness.step(program_id, tokens)
    return trio.current_time() - start


async def test_newcomers_are_not_held_for_idle_programs_before_any_returns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # An idle program's claim (9,000) and a newcomer's call (3,000) overflow the backend,
    # but no program has come back yet: the newcomer is not held for a cache that may never
    # be used. (tr holding from the start, --no-return-evidence, queues it.)
    for cfg, held in ((CFG, False), (SCHEDULER_CFG, True)):
        async with open_harness(cfg) as harness:
            await harness.step("a", 9_000)
            await trio.sleep(1)
            harness.records()
            waited = await timed_step(harness, "new", 3_000)
            decisions = harness.decisions()
            assert (waited > 0) is held, cfg
            assert (("queue", "new", "capacity_full") in decisions) is held
            if not held:
                assert decisions == [("admit", "new", "few_returns")]
            assert harness.scheduler.schedule_of(B0).hold.holding  # the ledger did not stop


async def test_once_programs_are_seen_to_return_newcomers_are_held_for_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_harness(CFG) as harness:
        for _ in range(4):  # three returns within the horizon
            await harness.step("a", 9_000)
            await trio.sleep(1)
        assert harness.scheduler.schedule_of(B0).hold.seen_returns
        harness.records()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(harness.step, "new", 3_000))
            await trio.sleep(0.5)
            assert harness.scheduler.registry.get("new").status is ProgramStatus.PAUSED
            queued = [
                (r.action, r.rule)
                for r in harness.records()
                if isinstance(r, DecisionRecord) and r.program_id == "new"
            ]
            assert queued == [("queue", "capacity_full")]
            harness.scheduler.release("a")
        assert harness.scheduler.registry.get("new").status is ProgramStatus.ACTING


async def test_one_call_programs_never_start_holding(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A stream of one-call programs, each released after its call, beside an idle program
    # that came back once: the share back stays under a half, and nobody is held for "a".
    async with open_harness(CFG) as harness:
        await harness.step("a", 7_000)
        await harness.step("a", 7_000)  # one return
        for n in range(20):
            await timed_step(harness, f"chat{n}", 1_000)
            harness.scheduler.release(f"chat{n}")
        harness.records()
        assert await timed_step(harness, "new", 4_000) == 0
        assert harness.decisions() == [("admit", "new", "few_returns")]
        ledger = harness.scheduler.schedule_of(B0).hold
        assert ledger.returned > 0
        assert not ledger.seen_returns


async def test_calls_let_through_for_want_of_returns_do_not_teach_the_ledger_to_stop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # First calls let through before any program came back cost nothing, held or not: they
    # are not learnt as the cost of not holding (which would make it look free, and stop
    # holding once MIN_CALLS_OFF of them were seen).
    async with open_harness(CFG) as harness:
        for n in range(costs.MIN_CALLS_OFF + 4):
            await harness.step(f"first{n}", 100)
        ledger = harness.scheduler.schedule_of(B0).hold
        assert not ledger.seen_returns
        assert ledger.off.n == 0
        assert ledger.holding
