"""Where an instance's hold ledger found that holding programs back does not pay, its calls still
never overfill a backend while other instances share it (scheduling/claims.py, ``holds`` and
``Ask.alone``): tr holds where its view shows another live instance, and the claim is made in
Redis where its view is a publication behind one. Two tr schedulers over one backend of 10,000
KV tokens share a real redis-server; trio's MockClock stands still, so nothing is published but
what a test publishes or a claim writes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import trio
import trio.lowlevel
import trio.testing

from tests.admission.conftest import RedisServer
from tests.admission.test_claims import Claimant, instance
from tests.scheduling.test_scheduler import CFG, Harness, begin, end, open_harness
from thunderproxy.admission.shared_kv import SharedBackends
from thunderproxy.programs import ProgramStatus, StepUsage
from thunderproxy.scheduling import Scheduler, claims
from thunderproxy.scheduling.costs import HoldLedger
from thunderproxy.scheduling.scheduler import StepLease
from thunderproxy.scheduling.tr import BackendView, PolicyConfig, ProgramView

B0 = "http://b0"
KV = 10_000
# -- the rule, pure ------------------------------------------------------------------------------


def test_holding_stops_only_while_no_other_instance_is_live() -> None:
    assert claims.holds(True, shared=False)
    assert claims.holds(True, shared=True)
    assert not claims.holds(False, shared=False)
    assert claims.holds(False, shared=True)


def test_a_call_where_holding_does_not_pay_is_still_asked_for_alone() -> None:
    b = BackendView(B0, True, KV, hold=False)
    me = ProgramView("p", ProgramStatus.REASONING, B0, 12_000, created_at=0.0)
    ask = claims.ask(b, [me], CFG, 0.0, first=True)
    assert ask == claims.Ask(B0, 12_000, KV, alone=True)
    # Granted past the target while no other instance is live (the ledger's decision stands),
    # tested as any other claim once one is, even one that claims nothing.
    assert claims.fits(ask, 0, shared=False)
    assert not claims.fits(ask, 0, shared=True)
    assert claims.fits(claims.Ask(B0, 4_000, KV, alone=True), 6_000, shared=True)
    held = claims.ask(BackendView(B0, True, KV), [me], CFG, 0.0, first=True)
    assert held == claims.Ask(B0, 12_000, KV, alone=False)
    assert not claims.fits(held, 0, shared=False)
    # Never holding (``--hold never``), nothing is asked: a refusal would be resumed at once.
    never = PolicyConfig(hold="never")
    assert claims.ask(b, [me], never, 0.0, first=True) is None


# -- the script, on a real redis-server -----------------------------------------------------------


async def test_redis_grants_an_alone_claim_unchecked_only_while_no_other_instance_is_live(
    redis_server: RedisServer,
) -> None:
    backend = "http://gpu0:8000"  # Claimant's
    async with instance(redis_server.url, "b", dict) as b:
        # Alone: past the target too, as the ledger decided; not so a held call.
        assert not b.shared()
        assert await b.claim(backend, 12_000, KV, alone=True)
        assert not await b.claim(backend, 12_000, KV)
        a = Claimant()
        async with instance(redis_server.url, "a", a.mine) as a.shared:
            # Another instance is live, though it claims nothing yet: tested.
            assert not await b.claim(backend, 12_000, KV, alone=True)
            assert b.shared()
            assert await b.claim(backend, 4_000, KV, alone=True)
            await a.call(6_000, KV)
            assert a.granted == [6_000]
            assert not await b.claim(backend, 6_000, KV, alone=True)
            assert b.others(backend) == 6_000
            assert await b.claim(backend, 4_000, KV, alone=True)
        assert (b.granted, b.refused) == (3, 3)


# -- two schedulers ------------------------------------------------------------------------------


@dataclass
class Instance:
    harness: Harness
    shared: SharedBackends

    @property
    def scheduler(self) -> Scheduler:
        return self.harness.scheduler

    def decisions(self) -> list[tuple[str, str, str]]:
        return self.harness.decisions()

    async def publish(self) -> None:
        """Write this instance's claims and read the others' (what a beat does)."""
        await self.shared.publish(self.scheduler.used_by_backend())

    def status(self, program_id: str) -> ProgramStatus:
        return self.scheduler.registry.get(program_id).status


@asynccontextmanager
async def open_instance(redis: str, name: str, *, holding: bool) -> AsyncIterator[Instance]:
    """A tr scheduler over B0 sharing its claims through ``redis``, its ledger deciding
    ``holding``."""
    # A long heartbeat: with the clock standing still no beat comes anyway.
    shared = SharedBackends(redis, name, heartbeat_s=60.0)
    async with (
        open_harness(CFG, capacity=KV, shared=shared) as harness,
        trio.open_nursery() as nursery,
    ):
        scheduler = harness.scheduler
        scheduler.schedule_of(B0).hold = HoldLedger(holding=holding)
        offset = time.time() - trio.current_time()  # Unix time, as every instance beats with
        await nursery.start(shared.serve, offset, scheduler.used_by_backend)
        yield Instance(harness, shared)
        nursery.cancel_scope.cancel()


async def until(condition: Callable[[], bool], what: str) -> None:
    """Let the Redis round trips run until ``condition`` holds (the trio clock stands still;
    the bound is on real seconds)."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        await trio.lowlevel.checkpoint()


class Call:
    """One call of ``tokens`` leased in the background: ``lease`` once it went out, and the
    decisions its instance logged meanwhile."""

    def __init__(self, at: Instance, program_id: str, tokens: int) -> None:
        self.at = at
        self.program_id = program_id
        self.tokens = tokens
        self.lease: StepLease | None = None
        self.decisions: list[tuple[str, str, str]] = []

    async def run(self) -> None:
        now = trio.current_time()
        self.lease = await begin(
            self.at.scheduler, self.program_id, arrived_at=now, context_chars=4 * self.tokens
        )

    def settled(self) -> bool:
        """Out, or held: queued or paused, and not resumed since."""
        self.decisions += self.at.decisions()
        if self.lease is not None:
            return True
        program = self.at.scheduler.registry.find(self.program_id)
        held = program is not None and program.status is ProgramStatus.PAUSED
        return held and bool(self.decisions) and self.decisions[-1][0] in ("queue", "pause")


async def release_then_resumed(a: Instance, a1: StepLease, b: Instance, call: Call) -> None:
    """A's program ends and is released; once both instances have published, B's held call
    goes out, resumed on the fit test (A is still live)."""
    end(a.scheduler, a1, 200, StepUsage(5_900, 100, 0))
    a.scheduler.release("a1")
    await a.publish()
    await b.publish()
    b.scheduler.rebalance(trio.current_time())
    await until(lambda: call.lease is not None, "b1 was not resumed")
    assert ("resume", "b1", "capacity_free") in b.decisions()


async def test_alone_the_ledger_decides_as_without_redis(
    redis_server: RedisServer, mock_clock: trio.testing.MockClock
) -> None:
    async with open_instance(redis_server.url, "b", holding=False) as b:
        # 12,000 tokens on 10,000: no other instance, so not holding is the ledger's to decide.
        await begin(b.scheduler, "b1", arrived_at=0.0, context_chars=4 * 6_000)
        await begin(b.scheduler, "b2", arrived_at=0.0, context_chars=4 * 6_000)
        assert not b.scheduler.views().backend(B0).hold
        assert b.decisions() == [
            ("admit", "b1", "hold_does_not_pay"),
            ("admit", "b2", "hold_does_not_pay"),
        ]
        assert (b.shared.granted, b.shared.refused) == (2, 0)  # checked all the same


# B starts first, so its view holds no other instance until it reads again ("stale"), or it
# has read since A started and claimed ("current").


@pytest.mark.parametrize(
    ("view", "decisions"),
    [
        # B's view shows A: it holds, and its own fit test queues the call.
        pytest.param("current", [("queue", "b1", "capacity_full")], id="view-current"),
        # B's view is from before A started: it lets the call through without a fit test,
        # and Redis refuses the claim.
        pytest.param(
            "stale",
            [("admit", "b1", "hold_does_not_pay"), ("queue", "b1", "claim_refused")],
            id="view-stale",
        ),
    ],
)
async def test_a_first_call_where_holding_does_not_pay_waits_for_the_others_room(
    redis_server: RedisServer,
    mock_clock: trio.testing.MockClock,
    view: str,
    decisions: list[tuple[str, str, str]],
) -> None:
    async with (
        open_instance(redis_server.url, "b", holding=False) as b,
        open_instance(redis_server.url, "a", holding=True) as a,
        trio.open_nursery() as nursery,
    ):
        a1 = await begin(a.scheduler, "a1", arrived_at=0.0, context_chars=4 * 6_000)
        assert ("admit", "a1", "fits") in a.decisions()
        if view == "current":
            await b.publish()
        assert b.scheduler.views().backend(B0).hold is (view == "current")
        call = Call(b, "b1", 6_000)
        nursery.start_soon(call.run)
        await until(call.settled, "b1 neither went out nor was held")
        assert call.lease is None, "b1 went out beside a1: 12,000 tokens on 10,000"
        assert call.decisions == decisions
        # Held, and not resumed at once: its view holds now (a refusal brings the others'
        # claims and count), whatever its ledger says.
        assert b.status("b1") is ProgramStatus.PAUSED
        assert b.scheduler.views().backend(B0).hold
        assert b.shared.refused == (1 if view == "stale" else 0)

        # A's program ends and is released: B's call goes out once B reads it, on the fit test
        # (A is still live).
        await release_then_resumed(a, a1, b, call)
        assert b.shared.granted == 1


@pytest.mark.parametrize(
    ("view", "rule"),
    [
        pytest.param("current", "no_room_on_return", id="view-current"),
        # The gate let it through (holding does not pay), and the claim its growth makes is
        # refused.
        pytest.param("stale", "claim_refused", id="view-stale"),
    ],
)
async def test_a_returning_call_where_holding_does_not_pay_waits_for_the_others_room(
    redis_server: RedisServer, mock_clock: trio.testing.MockClock, view: str, rule: str
) -> None:
    async with (
        open_instance(redis_server.url, "b", holding=False) as b,
        trio.open_nursery() as nursery,
    ):
        # B's program makes its first call alone, then runs a tool; then A starts, and its
        # program takes 6,000 tokens beside b1's 3,000.
        b1 = await begin(b.scheduler, "b1", arrived_at=0.0, context_chars=4 * 3_000)
        end(b.scheduler, b1, 200, StepUsage(2_900, 100, 0))
        async with open_instance(redis_server.url, "a", holding=True) as a:
            a1 = await begin(a.scheduler, "a1", arrived_at=0.0, context_chars=4 * 6_000)
            assert a.shared.granted == 1
            if view == "current":
                await b.publish()
            b.decisions()
            # Its next call carries 6,000 tokens: 12,000 with A's on 10,000.
            call = Call(b, "b1", 6_000)
            nursery.start_soon(call.run)
            await until(call.settled, "b1's return neither went out nor was held")
            assert call.lease is None, "b1's return went out beside a1: 12,000 tokens on 10,000"
            # Paused by its gate or its claim; the gate's pause weighs the program at its last
            # call's size, and a resume may follow at once: its claim, at its call's size,
            # pauses it then.
            assert call.decisions[0] == ("pause", "b1", rule)
            assert call.decisions[-1][:2] == ("pause", "b1")
            assert b.status("b1") is ProgramStatus.PAUSED

            await release_then_resumed(a, a1, b, call)
