"""The hold ledger (scheduling/costs.py): whether holding programs back pays on a backend,
decided from the calls themselves, and only on evidence."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, replace
from functools import partial

import pytest
import trio

from thunderproxy.programs import StepUsage
from thunderproxy.scheduling import Scheduler, costs
from thunderproxy.scheduling.costs import HoldLedger, Mean
from thunderproxy.scheduling.scheduler import serve_resume_monitor
from thunderproxy.scheduling.tr import PolicyConfig

from .test_scheduler import B0, begin, open_harness
from .test_scheduler import CFG as SCHEDULER_CFG

RATE = 25e-6  # prefill seconds per uncached token (20,000 tokens in 0.5 s)


@dataclass(frozen=True)
class Call:
    waited: float
    reuse: int = 0
    missed: int = 0
    in_flight: int = 9


def feed(ledger: HoldLedger, calls: Iterable[Call]) -> tuple[HoldLedger, list[bool]]:
    """The ledger after ``calls``, each sent in the state the ledger had decided, and that
    state after each call."""
    states = []
    for c in calls:
        ledger = ledger.observe_call(
            waited_s=c.waited if ledger.holding else 0.0,
            in_flight=c.in_flight,
            reuse_tokens=c.reuse,
            missed_tokens=c.missed,
            holding=ledger.holding,
        )
        states.append(ledger.holding)
    return ledger, states


def measured() -> HoldLedger:
    return HoldLedger().observe_prefill(20_000, 0.5)


def test_the_mean_is_plain_at_first_then_weighted_towards_the_last_calls() -> None:
    m = Mean().add(1.0).add(3.0)
    assert (m.n, m.mean, m.var) == (2, 2.0, 1.0)
    assert m.weight == 2
    for _ in range(10_000):
        m = m.add(5.0)
    assert m.mean == pytest.approx(5.0)
    assert m.weight == pytest.approx(127.0)  # (2 - α) / α: the last 64 or so count
    assert not costs.exceeds(Mean().add(2.0).add(4.0), Mean().add(1.0).add(3.0))
    low = Mean()
    high = Mean()
    for i in range(100):
        low, high = low.add(1.0 + i % 2), high.add(3.0 + i % 2)
    assert costs.exceeds(high, low)
    assert not costs.exceeds(low, high)


def test_the_prefill_rate_is_the_engines_speed_not_its_queue() -> None:
    ledger = HoldLedger().observe_prefill(20_000, 2.0)  # a queued call: 100 µs per token
    ledger = ledger.observe_prefill(20_000, 0.5)  # the engine's own speed: 25 µs
    ledger = ledger.observe_prefill(100, 0.0001)  # too small to say anything
    # The engine overloaded: every call's first token waits in its queue for a minute.
    for _ in range(500):
        ledger = ledger.observe_prefill(20_000, 60.0)
    assert ledger.prefill_s_per_token == RATE


def test_recomputing_a_history_costs_per_token_what_prefills_of_its_length_did() -> None:
    # vLLM's CPU build with a 4-layer model: attention makes long prefills dearer per token.
    ledger = HoldLedger()
    assert ledger.recompute_s_per_token(10_000) == 0.0  # nothing seen: nothing to price
    for tokens, rate in ((2_000, 100e-6), (4_000, 150e-6), (9_000, 250e-6)):
        ledger = ledger.observe_prefill(tokens, tokens * rate)
    assert ledger.prefill_s_per_token == pytest.approx(100e-6)  # the fastest: the short one
    assert ledger.recompute_s_per_token(1_500) == pytest.approx(100e-6)
    # Lengths go by doublings from 1K: 2K to 4K is the 4,000-token prefill's, and 4K to 8K,
    # where none was seen, the next shorter one's.
    assert ledger.recompute_s_per_token(3_000) == pytest.approx(150e-6)
    assert ledger.recompute_s_per_token(5_000) == pytest.approx(150e-6)
    assert ledger.recompute_s_per_token(14_000) == pytest.approx(250e-6)
    # Longer than any prefill seen: the longest length's rate, not the fastest.
    assert ledger.recompute_s_per_token(100_000) == pytest.approx(250e-6)
    # Per token, a longer history never costs less than a shorter one.
    ledger = ledger.observe_prefill(40_000, 40_000 * 120e-6)
    assert ledger.recompute_s_per_token(40_000) == pytest.approx(250e-6)


def test_a_prefill_after_a_long_cached_context_prices_no_length() -> None:
    # 2,000 new tokens after 20,000 cached ones took 2 s attending to the context: what a
    # short prompt costs there, not what recomputing 2,000 tokens from scratch does.
    ledger = HoldLedger().observe_prefill(2_000, 0.2)
    ledger = ledger.observe_prefill(2_000, 2.0, cached_tokens=20_000)
    assert ledger.recompute_s_per_token(2_000) == pytest.approx(100e-6)
    ledger = HoldLedger().observe_prefill(2_000, 2.0, cached_tokens=20_000)
    assert ledger.prefill_by_length == (None,) * costs.PREFILL_LENGTHS
    assert ledger.prefill_s_per_token == pytest.approx(1e-3)  # still the fastest seen


def test_one_slow_prefill_cannot_price_a_length_on_its_own() -> None:
    # A 16K prefill that also waited a minute in the engine's queue: at most twice the rate
    # of the next shorter length seen (the cost per token at worst grows with the length).
    ledger = HoldLedger().observe_prefill(8_000, 8_000 * 100e-6)
    ledger = ledger.observe_prefill(16_000, 60.0)
    assert ledger.recompute_s_per_token(16_000) == pytest.approx(200e-6)
    # And a queue does not stick: a faster prefill of that length lowers it.
    ledger = ledger.observe_prefill(16_000, 16_000 * 150e-6)
    assert ledger.recompute_s_per_token(16_000) == pytest.approx(150e-6)


@pytest.mark.parametrize(("long_prefills", "holds"), [(False, False), (True, True)])
def test_kept_history_is_priced_at_its_own_length(long_prefills: bool, holds: bool) -> None:
    # Every call waits 120 s and keeps 14K of history, 30 calls sharing the engine. Priced at
    # the fastest prefill (100 µs a token, short prompts), keeping it is worth 2 · 14,000 ·
    # 100 µs · 31 = 86.8 s: less than the wait, holding stops. Prefills of 8K and more were
    # seen at 250 µs a token: it is worth 217 s, and holding pays.
    ledger = HoldLedger().observe_prefill(2_000, 2_000 * 100e-6)
    if long_prefills:
        ledger = ledger.observe_prefill(4_000, 4_000 * 150e-6)
        ledger = ledger.observe_prefill(9_000, 9_000 * 250e-6)
    ledger, _ = feed(ledger, [Call(120.0, 14_000, 0, in_flight=30)] * (2 * costs.MIN_CALLS))
    assert ledger.holding is holds
    assert ledger.inputs()["gain_s"] == pytest.approx(217.0 - 120.0 if holds else 86.8 - 120.0)


def test_a_stream_of_one_call_programs_ends_with_holding_off_and_keeps_it_off() -> None:
    # Chat sessions (the Mooncake trace): three quarters are one call; the others come back
    # minutes later, after the horizon (no history holding could keep: reuse 0), or, some,
    # at once with their history evicted. Held newcomers wait up to the bound.
    rng = random.Random(1)

    def chat(n: int) -> list[Call]:
        calls = []
        for _ in range(n):
            r = rng.random()
            if r < 0.05:  # back within the horizon, its 6K history evicted all the same
                calls.append(Call(rng.uniform(0, 120), 6_000, 6_000, in_flight=40))
            else:
                calls.append(Call(rng.uniform(0, 120), in_flight=40))
        return calls

    ledger, states = feed(measured(), chat(costs.MIN_CALLS - 1))
    assert all(states)  # too few calls to say anything: tr's default
    ledger, states = feed(ledger, chat(3_000))
    assert not ledger.holding
    stopped = states.index(False)
    assert stopped < 10  # the evidence is overwhelming as soon as it counts
    assert not any(states[stopped:])  # never back on
    assert ledger.calls_off > 2_900
    inputs = ledger.inputs()
    assert inputs["calls_off"] == ledger.calls_off
    assert inputs["prefill_us_per_token"] == 25.0
    assert inputs["cost_off_s"] < inputs["cost_on_s"]


def test_a_stream_of_returning_agents_keeps_holding_on() -> None:
    # SWE-agent programs: every call comes back within the horizon with 20K tokens of history,
    # holding keeps most of it (a few thousand missed), at the price of waits of 0 to 16 s.
    # Kept history: about 18K · 25 µs · 10 calls = 4.5 s per call, counted twice: 9 s against
    # 8 s of waiting on average. Noise around that margin must not switch anything.
    rng = random.Random(2)
    calls = [
        Call(rng.uniform(0, 16), 20_000, rng.choice((0, 1_000, 2_000, 5_000))) for _ in range(3_000)
    ]
    ledger, states = feed(measured(), calls)
    assert all(states)
    assert ledger.estimate_off is not None
    assert ledger.cost_on is not None
    assert ledger.estimate_off > ledger.cost_on


def test_noise_around_the_threshold_switches_nothing() -> None:
    # Held calls wait 0 or 20 s (10 s on average) and save 5 s of recompute each (counted
    # twice: 10 s): the gain is zero on average, its sign any call's draw.
    rng = random.Random(3)
    calls = [Call(rng.choice((0.0, 20.0)), 20_000, 0) for _ in range(3_000)]
    _, states = feed(measured(), calls)
    assert all(states)
    # The old rule, a threshold on the moving means, crossed it about once every 100 calls.


def test_holding_stops_when_it_costs_more_waiting_than_the_recompute_it_keeps() -> None:
    # Kept history worth 2 · 5 s, waits of 12 s: 2 s lost per call, every call.
    calls = [Call(12.0, 20_000, 0)] * costs.MIN_CALLS
    ledger, states = feed(measured(), calls)
    assert states[:-1] == [True] * (costs.MIN_CALLS - 1)
    assert not ledger.holding
    assert ledger.inputs()["gain_s"] == -2.0


def test_without_holding_the_measured_cost_decides_after_enough_calls() -> None:
    ledger, _ = feed(measured(), [Call(12.0, 20_000, 0)] * costs.MIN_CALLS)
    assert not ledger.holding
    # Without holding, evictions cascade: calls find all of their 20K history gone and 40
    # calls share the engine (20,000 · 25 µs · 40 = 20 s each, against 12 s of waiting).
    thrash = [Call(0.0, 20_000, 20_000, in_flight=39)] * (costs.MIN_CALLS_OFF - 1)
    ledger, states = feed(ledger, thrash)
    assert not any(states)  # stays off until measured: not on and off call after call
    ledger, states = feed(ledger, thrash[:1])
    assert ledger.holding  # measured dearer than holding: back on
    assert ledger.cost_off == 20.0
    # And on, it stays: the stale cost without holding is well above the cost with it.
    ledger, states = feed(ledger, [Call(12.0, 20_000, 0)] * 500)
    assert all(states)


def test_measured_cheaper_without_holding_it_stays_off() -> None:
    ledger, _ = feed(measured(), [Call(12.0, 20_000, 0)] * costs.MIN_CALLS)
    # Without holding, calls lose 16K of their history: 16,000 · 25 µs · 10 = 4 s each, a
    # third of the waits holding cost them.
    ledger, states = feed(ledger, [Call(0.0, 20_000, 16_000)] * 1_000)
    assert not any(states)
    assert ledger.cost_off == pytest.approx(4.0)
    # Once measured both ways, holding stops again where it had come back but costs more.
    back = HoldLedger(
        holding=True,
        on=Mean(n=200, mean=12.0, var=1.0),
        off=Mean(n=200, mean=4.0, var=1.0),
        calls=400,
        prefill_s_per_token=RATE,
    )
    ledger, states = feed(back, [Call(12.0, 20_000, 0)])
    assert not ledger.holding


def test_a_wait_counts_against_holding_even_where_holding_stopped_while_it_waited() -> None:
    ledger = HoldLedger(holding=False, calls=100, prefill_s_per_token=RATE)
    # A call queued while holding, released when it stopped: its 90 s is holding's cost.
    released = ledger.observe_call(
        waited_s=90.0, in_flight=9, reuse_tokens=0, missed_tokens=0, holding=False
    )
    assert released.cost_on == 90.0
    assert released.cost_off is None
    # A call that went straight out, as without any proxy in between.
    straight = ledger.observe_call(
        waited_s=0.001, in_flight=9, reuse_tokens=0, missed_tokens=0, holding=False
    )
    assert straight.cost_off == 0.001
    assert straight.cost_on is None


def test_a_ledger_needs_enough_calls_and_a_prefill_rate_before_it_stops_holding() -> None:
    few, states = feed(measured(), [Call(100.0, 1_000)] * (costs.MIN_CALLS - 1))
    assert all(states)
    assert not feed(few, [Call(100.0, 1_000)])[0].holding
    # No prefill measured: what holding keeps has no price yet.
    blind, states = feed(HoldLedger(), [Call(100.0, 1_000)] * 500)
    assert all(states)


def test_the_horizon_is_where_tr_stops_counting_an_idle_cache() -> None:
    assert costs.horizon_s(PolicyConfig(acting_half_life_s=5.0)) == 20.0
    assert costs.horizon_s(PolicyConfig(acting_half_life_s=0.0, idle_lease_s=600)) == 600


#: The scheduler tests' configuration, with idle claims that halve every 5 s.
CFG = replace(SCHEDULER_CFG, acting_half_life_s=5.0)


@pytest.fixture
async def scheduler() -> AsyncIterator[Scheduler]:
    async with open_harness(CFG) as harness:
        yield harness.scheduler


async def test_a_program_back_after_the_horizon_carries_no_history_holding_could_keep(
    scheduler: Scheduler, autojump_clock: trio.testing.MockClock
) -> None:
    sched = scheduler

    async def call(name: str) -> int:
        lease = await begin(sched, name, arrived_at=trio.current_time(), context_chars=8_000)
        sched.close(lease, StepUsage(2_000, 10, 0), reason="response complete")
        return lease.reuse_tokens

    assert await call("chat") == 0  # a first call
    await trio.sleep(costs.horizon_s(CFG) - 1)
    assert await call("chat") == 2_010  # back in time: its history is what holding keeps
    await trio.sleep(costs.horizon_s(CFG) + 1)
    assert await call("chat") == 0  # back after the horizon: recomputed, held or not
    ledger = sched.schedule_of(B0).hold
    assert ledger.returns < 1.0


async def test_one_call_programs_behind_a_long_call_turn_holding_off_for_good(
    scheduler: Scheduler, autojump_clock: trio.testing.MockClock
) -> None:
    # A long call fills the backend; one-call programs arrive every 2 s, are held until the
    # bound forces them out, and never come back. Holding stops once the ledger has seen
    # enough, and stays off: they go straight to the engine from then on.
    sched = scheduler
    hog = await begin(sched, "hog", arrived_at=trio.current_time(), context_chars=6_000 * 4)
    waits: list[float] = []

    async def one_call(name: str) -> None:
        lease = await begin(sched, name, arrived_at=trio.current_time(), context_chars=6_000 * 4)
        waits.append(lease.sent_at - lease.arrived_at)
        await trio.sleep(2)
        usage = StepUsage(6_000, 10, 0)
        sched.close(lease, usage, reason="response complete", first_token_at=lease.sent_at + 1)
        sched.release(name)

    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_resume_monitor, sched, interval=1.0))
        async with trio.open_nursery() as calls:
            for n in range(400):
                calls.start_soon(one_call, f"chat{n}")
                await trio.sleep(2)
        nursery.cancel_scope.cancel()
    ledger = sched.schedule_of(B0).hold
    assert not ledger.holding
    assert ledger.calls == 400
    assert max(waits[:32]) > 0  # held while the ledger learned
    assert waits[-100:] == [0.0] * 100
    sched.close(hog, StepUsage(6_000, 10, 0), reason="response complete")
