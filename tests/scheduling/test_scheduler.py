"""The scheduler's trio glue on trio's MockClock: real registry, pool and audit channel, no
sockets and no SQLite (records are read straight off the audit channel)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import pytest
import trio

from thunderproxy.admission.shared_kv import SharedBackends
from thunderproxy.audit import AuditLog, DecisionRecord
from thunderproxy.audit.records import AuditRecord, TransitionRecord
from thunderproxy.backends import BackendPool, EngineSnapshot, open_backend_pool
from thunderproxy.errors import ProgramReleased
from thunderproxy.programs import ProgramRegistry, ProgramStatus, StepUsage
from thunderproxy.scheduling import Scheduler, TrPolicy
from thunderproxy.scheduling.scheduler import StepLease, serve_resume_monitor
from thunderproxy.scheduling.tr import PolicyConfig, call_bound

B0, B1 = "http://b0", "http://b1"


def snapshot(capacity: int | None, preemptions: float = 0.0) -> EngineSnapshot:
    return EngineSnapshot(
        flavour="vllm",
        engines=1,
        capacity_tokens=capacity,
        block_size=16,
        num_gpu_blocks=None if capacity is None else capacity // 16,
        kv_usage=0.0,
        running=0,
        waiting=0,
        prefix_queries_total=0,
        prefix_hits_total=0,
        preemptions_total=preemptions,
    )


@dataclass
class Harness:
    scheduler: Scheduler
    pool: BackendPool
    receive: trio.MemoryReceiveChannel[AuditRecord]

    def records(self) -> list[AuditRecord]:
        out = []
        while True:
            try:
                out.append(self.receive.receive_nowait())
            except trio.WouldBlock:
                return out

    def decisions(self) -> list[tuple[str, str, str]]:
        return [
            (r.action, r.program_id, r.rule)
            for r in self.records()
            if isinstance(r, DecisionRecord)
        ]

    async def step(self, program_id: str, tokens: int, *, status: int = 200) -> None:
        lease = await begin(self.scheduler, program_id, arrived_at=trio.current_time(),
                            context_chars=tokens * 4)  # fmt: skip
        usage = StepUsage(tokens - 100, 100, 0) if status == 200 else StepUsage()
        end(self.scheduler, lease, status, usage)


async def begin(
    sched: Scheduler, program_id: str, *, arrived_at: float, context_chars: int
) -> StepLease:
    route = sched.pool.route(None)
    return await sched.lease(program_id, route, arrived_at=arrived_at, context_chars=context_chars)


def end(sched: Scheduler, lease: StepLease, status: int, usage: StepUsage | None = None) -> bool:
    reason = "response complete" if status < 400 else f"request failed ({status})"
    return sched.close(lease, usage or StepUsage(), reason=reason)


CFG = PolicyConfig(
    decode_buffer=0,
    pause_cooldown_s=0,
    resume_cooldown_s=0,
    acting_half_life_s=0,
    target_fill=1.0,
    max_wait_s=20,
    resume_protection_s=10,
    idle_lease_s=300,
    # tr holds from the first call: these tests are about holding, not about whether
    # programs come back for it (test_returns.py).
    return_evidence=False,
)


@asynccontextmanager
async def open_harness(
    cfg: PolicyConfig = CFG, *, capacity: int = 10_000, shared: SharedBackends | None = None
) -> AsyncIterator[Harness]:
    """A tr scheduler with ``cfg`` over one backend of ``capacity`` KV tokens, and its
    records; ``shared``: the claims and placements it shares with other instances."""
    send, receive = trio.open_memory_channel[AuditRecord](100_000)
    async with open_backend_pool([B0]) as pool:
        pool.get(B0).snapshot = snapshot(capacity)  # type: ignore[union-attr]
        # The Scheduler class itself, built here rather than by core.build_core: these tests
        # hand it a policy config of their own and the SharedBackends they made (over a test
        # Redis), which build_core would make itself from a URL.
        scheduler = Scheduler(
            policy=TrPolicy(cfg),
            registry=ProgramRegistry(lambda t: send.send_nowait(TransitionRecord(t))),
            pool=pool,
            audit=AuditLog(send, run_id=1),
            other_tokens=None if shared is None else shared.others,
            affinity=shared,
            claims=shared,
        )
        yield Harness(scheduler, pool, receive)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    async with open_harness() as harness:
        yield harness


@pytest.mark.parametrize(
    ("status", "usage"),
    [
        pytest.param(499, None, id="client-disconnect"),
        pytest.param(500, None, id="backend-error"),
        pytest.param(400, None, id="bad-request"),
        pytest.param(200, StepUsage(), id="no-usage-reported"),
    ],
)
async def test_every_outcome_ends_the_step(
    harness: Harness, status: int, usage: StepUsage | None
) -> None:
    # Defect 1: a program left REASONING after a failed call is a phantom on the GPU.
    sched = harness.scheduler
    lease = await begin(sched, "p", arrived_at=0.0, context_chars=400)
    assert sched.registry.get("p").status is ProgramStatus.REASONING
    assert end(sched, lease, status, usage)
    assert not end(sched, lease, status, usage)  # a second close changes nothing
    program = sched.registry.get("p")
    assert program.status is ProgramStatus.ACTING
    assert program.in_flight == 0
    assert sched.registry.load_by_backend()[B0].reasoning == 0


async def test_over_capacity_pauses_an_idle_program_and_the_newcomer_queues(
    harness: Harness, autojump_clock: trio.testing.MockClock
) -> None:
    sched = harness.scheduler
    await harness.step("a", 6_000)
    await trio.sleep(1)
    await harness.step("b", 3_000)
    harness.records()
    # c does not fit (6000 + 3000 + 2000 > 10000): it queues as PAUSED.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(harness.step, "c", 2_000))
        await trio.sleep(0.5)
        assert sched.registry.get("c").status is ProgramStatus.PAUSED
        assert ("queue", "c", "capacity_full") in harness.decisions()
        sched.release("a")  # frees 6000: c is resumed at once and its call goes out
    assert sched.registry.get("c").status is ProgramStatus.ACTING
    assert ("resume", "c", "capacity_free") in harness.decisions()


async def test_a_waiting_request_is_force_resumed_at_max_wait(
    harness: Harness, autojump_clock: trio.testing.MockClock
) -> None:
    # Defect 3: waits are bounded by a setting, not by a hard-coded 30 minutes. The hog was
    # force-resumed itself (protected), so no room can be made: the bound is what ends the
    # wait, kept by the request's own deadline (no resume monitor runs here).
    sched = harness.scheduler
    await harness.step("hog", 9_900)
    sched.registry.get("hog").protected_until = 1e9
    start = trio.current_time()
    await harness.step("late", 5_000)
    assert trio.current_time() - start == CFG.max_wait_s
    program = sched.registry.get("late")
    assert program.protected_until == pytest.approx(trio.current_time() + 10, abs=1.0)
    assert ("force_resume", "late", "max_wait") in harness.decisions()


async def test_room_is_made_at_half_the_bound_instead_of_an_overload_at_it(
    harness: Harness, autojump_clock: trio.testing.MockClock
) -> None:
    sched = harness.scheduler
    await harness.step("hog", 9_900)  # idle (acting) from now on, its claim does not decay
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_resume_monitor, sched, interval=1.0))
        start = trio.current_time()
        await harness.step("late", 5_000)
        waited = trio.current_time() - start
        nursery.cancel_scope.cancel()
    # Paused at half the bound to make room, so the late call went out inside it, and fit.
    assert CFG.max_wait_s / 2 <= waited < CFG.max_wait_s
    decisions = harness.decisions()
    assert ("pause", "hog", "make_room") in decisions
    assert ("resume", "late", "capacity_free") in decisions
    assert not [d for d in decisions if d[0] == "force_resume"]


async def test_no_call_waits_past_the_bound_under_contention(
    harness: Harness, autojump_clock: trio.testing.MockClock
) -> None:
    # Eight programs whose contexts are each 40% of the cache, calls of 3 to 11 s, tools of
    # 0 to 6 s: at most two fit at a time. Every call's wait in the scheduler, first calls
    # and later ones alike, must stay within its bound: max_wait, or a share of its
    # program's run so far where that is longer (tr.call_bound).
    sched = harness.scheduler
    waits: dict[tuple[str, int], float] = {}
    bounds: dict[tuple[str, int], float] = {}

    async def program(n: int) -> None:
        name = f"p{n}"
        for step in range(6):
            arrived = trio.current_time()
            lease = await begin(sched, name, arrived_at=arrived, context_chars=4_000 * 4)
            waits[(name, step)] = lease.sent_at - arrived
            created = sched.registry.get(name).created_at
            bounds[(name, step)] = call_bound("batch", created, arrived, CFG)
            await trio.sleep(3 + (n * 7 + step * 3) % 9)
            end(sched, lease, 200, StepUsage(3_900, 100, 0))
            await trio.sleep((n + step) % 7)
        sched.release(name)

    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_resume_monitor, sched, interval=1.0))
        async with trio.open_nursery() as agents:
            for n in range(8):
                agents.start_soon(program, n)
        nursery.cancel_scope.cancel()
    assert len(waits) == 48
    assert all(waits[call] <= bounds[call] for call in waits)
    assert max(waits.values()) >= CFG.max_wait_s / 2  # the contention was real


async def test_a_cancelled_wait_leaves_the_queue_and_is_never_sent(
    harness: Harness, autojump_clock: trio.testing.MockClock
) -> None:
    sched = harness.scheduler
    await harness.step("hog", 9_900)
    with trio.move_on_after(3):
        await harness.step("gone", 5_000)
    program = sched.registry.get("gone")
    assert program.waiting_since is None
    assert ("cancel", "gone", "client_disconnected") in harness.decisions()
    sched.release("hog")
    # Resumed into free room, but no call goes out on its behalf: it never started a step.
    assert program.step_count == 0


async def test_releasing_a_paused_program_does_not_let_its_request_through(
    harness: Harness, autojump_clock: trio.testing.MockClock
) -> None:
    # Defect 8: release must not bypass the capacity check for the blocked request.
    sched = harness.scheduler
    await harness.step("hog", 9_900)
    results: list[Any] = []

    async def blocked() -> None:
        try:
            await harness.step("victim", 5_000)
            results.append("sent")
        except ProgramReleased as exc:
            results.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(blocked)
        await trio.sleep(1)
        sched.release("victim")
    assert len(results) == 1
    assert isinstance(results[0], ProgramReleased)
    assert "victim" not in sched.registry


async def test_a_marked_program_is_paused_when_its_call_ends(harness: Harness) -> None:
    sched = harness.scheduler
    first = await begin(sched, "old", arrived_at=0.0, context_chars=6_000 * 4)
    second = await begin(sched, "young", arrived_at=0.0, context_chars=3_000 * 4)
    harness.pool.get(B0).snapshot = snapshot(8_000)  # type: ignore[union-attr]
    sched.rebalance(1.0)
    assert sched.registry.get("young").marked_for_pause
    assert not sched.registry.get("old").marked_for_pause
    end(sched, second, 200, StepUsage(3_000, 10, 0))
    assert sched.registry.get("young").status is ProgramStatus.PAUSED
    end(sched, first, 200, StepUsage(6_000, 10, 0))


async def test_capacity_is_rediscovered_and_kept_when_a_poll_loses_it(harness: Harness) -> None:
    # Defect 5: a backend with no capacity yet is not a stall; one seen later is scheduled.
    sched = harness.scheduler
    backend = harness.pool.get(B0)
    assert backend is not None
    backend.snapshot = None
    await harness.step("a", 50_000)
    await harness.step("b", 50_000)  # admitted although far beyond any real capacity
    assert ("admit", "b", "capacity_unknown") in harness.decisions()
    backend.snapshot = snapshot(10_000)
    sched.rebalance(2.0)
    assert sched.registry.get("a").status is ProgramStatus.PAUSED
    backend.snapshot = replace(snapshot(10_000), capacity_tokens=None)
    assert sched.source.backend_views()[0].capacity_tokens == 10_000


async def test_preemptions_shrink_capacity_and_recovery_restores_it(harness: Harness) -> None:
    sched = harness.scheduler
    backend = harness.pool.get(B0)
    assert backend is not None
    backend.snapshot = snapshot(10_000, preemptions=0)
    sched.tick()
    backend.snapshot = snapshot(10_000, preemptions=5)
    sched.tick()
    assert sched.schedule_of(B0).capacity.factor == pytest.approx(0.9)
    for _ in range(10):
        sched.tick()
    assert sched.schedule_of(B0).capacity.factor == 1.0


async def test_first_step_cached_tokens_teach_the_shared_prefix(harness: Harness) -> None:
    # Defect 6: the common system prompt is learned from what the backend reports.
    sched = harness.scheduler
    for i, cached in enumerate([1_024, 1_024, 992]):
        lease = await begin(sched, f"p{i}", arrived_at=0.0, context_chars=8_000)
        end(sched, lease, 200, StepUsage(2_000, 10, cached))
    assert sched.schedule_of(B0).shared_prefix.tokens == 1_024


async def test_programs_of_a_dead_backend_move_to_a_live_one(harness: Harness) -> None:
    # Defect 7: a dead backend's programs are re-placed, paused ones migrate on resume.
    sched = harness.scheduler
    b1 = harness.pool.add(B1)
    b1.snapshot = snapshot(10_000)
    await harness.step("acting", 1_000)
    b0 = harness.pool.get(B0)
    assert b0 is not None
    b0.health.down("test: killed")
    await harness.step("acting", 1_000)
    assert sched.registry.get("acting").backend == B1
    assert ("migrate", "acting", "backend_unhealthy") in harness.decisions()


async def test_idle_programs_are_retired_by_the_monitor(
    harness: Harness, autojump_clock: trio.testing.MockClock
) -> None:
    sched = harness.scheduler
    await harness.step("forgotten", 1_000)
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_resume_monitor, sched, interval=1.0))
        await trio.sleep(CFG.idle_lease_s + 2)
        nursery.cancel_scope.cancel()
    assert "forgotten" not in sched.registry
    transitions = [r.transition for r in harness.records() if isinstance(r, TransitionRecord)]
    assert transitions[-1].reason == "retired: idle lease expired"


async def test_a_resumed_program_is_not_paused_again_before_its_call_goes_out(
    harness: Harness, autojump_clock: trio.testing.MockClock
) -> None:
    sched = harness.scheduler
    await harness.step("hog", 9_000)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(harness.step, "w", 5_000))
        await trio.sleep(1)
        waiting = sched.registry.get("w")
        assert waiting.status is ProgramStatus.PAUSED
        sched.release("hog")  # w is resumed; its request has not gone out yet
        assert waiting.status is ProgramStatus.ACTING
        # Before the woken request runs, capacity shrinks and another rebalance comes by:
        # the idle-looking w must not be its victim, its call is about to go out.
        harness.pool.get(B0).snapshot = snapshot(3_000)  # type: ignore[union-attr]
        sched.rebalance(trio.current_time())
        assert waiting.status is ProgramStatus.ACTING
    assert waiting.step_count == 1


@pytest.mark.parametrize(("claims", "goes_out"), [("break_even", True), ("decay", False)])
async def test_break_even_claims_let_an_idle_cache_go_once_the_engine_would_refill_it_sooner(
    autojump_clock: trio.testing.MockClock, claims: str, goes_out: bool
) -> None:
    # The ledger learns the engine's prefill rate from a call (6,000 uncached tokens, first
    # token 0.12 s after it was sent: 20 µs a token), so a 10,000-token cache refills in 0.2 s.
    # A program idle for a second is then expected to stay away longer than that: under
    # break-even claims it no longer holds its 6,000 tokens, and a returning call of 5,000 goes
    # out; with claims that never decay (half-life 0) the same call waits, and the idle program is
    # paused for it.
    async with open_harness(replace(CFG, idle_claims=claims)) as harness:
        sched = harness.scheduler
        await harness.step("b", 1_000)
        idle = await begin(sched, "idle", arrived_at=trio.current_time(), context_chars=24_000)
        await trio.sleep(0.5)
        sched.close(
            idle,
            StepUsage(6_000, 10, 0),
            reason="response complete",
            first_token_at=idle.sent_at + 0.12,
        )
        assert sched.schedule_of(B0).hold.prefill_s_per_token == pytest.approx(20e-6)
        await trio.sleep(1.0)
        harness.records()
        with trio.move_on_after(1.0):
            lease = await begin(sched, "b", arrived_at=trio.current_time(), context_chars=20_000)
            end(sched, lease, 200, StepUsage(4_900, 100, 0))
        pauses = [d for d in harness.decisions() if d[0] == "pause"]
        assert sched.registry.get("b").step_count == 2
        if goes_out:
            assert pauses == []
        else:
            # It was paused on return, resumed at once at its last call's size (1,000 tokens),
            # and the idle program was paused for the overflow its real size made.
            assert pauses == [
                ("pause", "b", "no_room_on_return"),
                ("pause", "idle", "over_capacity"),
            ]


async def test_a_call_past_half_its_bound_takes_freed_room_without_waiting_for_the_cooldown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Resume rounds are 5 s apart here and one has just run when the hog's program ends; the
    # newcomer queued behind it has waited 12 s of its 20 s bound: it goes out at once, not at
    # the next round (no resume monitor runs: it would otherwise wait for its bound).
    async with open_harness(replace(CFG, resume_cooldown_s=5.0)) as harness:
        sched = harness.scheduler
        hog = await begin(sched, "hog", arrived_at=trio.current_time(), context_chars=32_000)
        waited: list[float] = []

        async def late_call() -> None:
            arrived = trio.current_time()
            lease = await begin(sched, "late", arrived_at=arrived, context_chars=20_000)
            waited.append(lease.sent_at - arrived)
            end(sched, lease, 200, StepUsage(4_900, 100, 0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(late_call)
            await trio.sleep(12)
            end(sched, hog, 200, StepUsage(7_000, 10, 0))  # idle now, its claim still whole
            assert not waited
            sched.schedule_of(B0).last_resume_at = trio.current_time()
            sched.release("hog")
        decisions = harness.decisions()
        assert waited == [12.0]
        assert ("queue", "late", "capacity_full") in decisions
        assert ("resume", "late", "capacity_free") in decisions
        assert not [d for d in decisions if d[0] == "force_resume"]


async def test_the_backends_call_time_is_learned_from_its_calls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # What spaces resume rounds where calls are short (tr.resume_cooldown): the calls'
    # own time on the backend, sent to last byte, not their wait in the proxy.
    async with open_harness(CFG) as harness:
        sched = harness.scheduler
        assert sched.views().backend(B0).call_s is None
        for seconds in (2.0, 2.0):
            lease = await begin(sched, "p", arrived_at=trio.current_time(), context_chars=400)
            await trio.sleep(seconds)
            end(sched, lease, 200, StepUsage(90, 10, 0))
        assert sched.views().backend(B0).call_s == 2.0


async def test_a_held_call_gives_the_room_its_programs_ended_call_kept_to_a_waiting_program(
    harness: Harness, mock_clock: trio.testing.MockClock
) -> None:
    # Three calls of one program in flight, a newcomer waiting for room. One call ends, and
    # the room its context left is kept for the program's next call. That call comes and is
    # held (it does not pass the program waiting): the kept room is the held call's claim
    # now, no longer counted beside it, and the waiting program fits. Counted twice, it did
    # not, nor did the held call: twelve threads under one id made 27 calls in 40 s.
    sched = harness.scheduler
    leases = [await begin(sched, "many", arrived_at=0.0, context_chars=2_500 * 4) for _ in range(3)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(harness.step, "newcomer", 3_000))
        await trio.testing.wait_all_tasks_blocked()
        assert sched.registry.get("newcomer").status is ProgramStatus.PAUSED
        end(sched, leases[0], 200, StepUsage(2_400, 100, 0))
        nursery.start_soon(partial(begin, sched, "many", arrived_at=0.0, context_chars=10_000))
        await trio.testing.wait_all_tasks_blocked()
        assert sched.registry.get("many").held_calls == 1
        sched.rebalance(0.0)
        await trio.testing.wait_all_tasks_blocked()
        # 5,000 in flight: the newcomer's 3,000 fit 10,000, the held call's 2,500 after it not.
        assert sched.registry.get("newcomer").step_count == 1
        assert sched.registry.get("many").held_calls == 1
        nursery.cancel_scope.cancel()
