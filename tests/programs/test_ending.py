"""Programs nobody released: presumed ended for capacity once their silence outlasts what their
tool gaps explain, and back as they were when a call of theirs comes."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import trio

from tests.scheduling.test_scheduler import B0, B1, CFG, begin, end, snapshot
from thunderproxy.audit import AuditLog
from thunderproxy.audit.records import AuditRecord
from thunderproxy.backends import open_backend_pool
from thunderproxy.config import Settings
from thunderproxy.core import build_core
from thunderproxy.programs import ProgramRegistry, ProgramStatus, StepUsage
from thunderproxy.programs.ending import (
    ENDED_FLOOR_S,
    ENDED_GAP_FACTOR,
    ended_after,
    presumed_ended,
)
from thunderproxy.scheduling.scheduler import serve_resume_monitor


def test_the_silence_that_ends_a_program_is_its_longest_gap_times_a_factor_or_the_floor() -> None:
    assert ended_after(0.0) == ENDED_FLOOR_S
    assert ended_after(1.0) == ENDED_FLOOR_S
    assert ended_after(100.0) == 100.0 * ENDED_GAP_FACTOR
    kw = {"longest_tool_s": 30.0, "in_flight": 0, "waiting": False}
    assert not presumed_ended(acting_since=0.0, now=119.0, **kw)  # type: ignore[arg-type]
    assert presumed_ended(acting_since=0.0, now=120.0, **kw)  # type: ignore[arg-type]
    # A call in flight, a request waiting or a program that never acted has not ended.
    for busy in ({"in_flight": 1}, {"waiting": True}):
        assert not presumed_ended(acting_since=0.0, now=1e6, **{**kw, **busy})  # type: ignore[arg-type]
    assert not presumed_ended(acting_since=None, now=1e6, **kw)  # type: ignore[arg-type]


def run_step(registry: ProgramRegistry, program_id: str, start: float, end_at: float) -> None:
    program, _ = registry.get_or_create(program_id, start)
    registry.assign(program, B0)
    registry.begin_step(program, start, context_chars=4_000)
    registry.end_step(program, end_at, StepUsage(900, 100, 0), reason="response complete")


def test_a_silent_program_leaves_the_backend_load_and_comes_back_with_its_next_call() -> None:
    registry = ProgramRegistry()
    # Tool gaps of 5 s and 20 s: silence past max(60, 4 x 20) = 80 s means it ended.
    run_step(registry, "p", 0.0, 10.0)
    run_step(registry, "p", 15.0, 20.0)
    run_step(registry, "p", 40.0, 50.0)
    program = registry.get("p")
    assert program.longest_tool_s == 20.0
    assert registry.presume_ended(50.0 + 79.0) == []
    assert registry.load_by_backend()[B0].acting_tokens == 1_000
    assert registry.presume_ended(50.0 + 80.0) == [program]
    load = registry.load_by_backend()[B0]
    assert (load.acting, load.acting_tokens, load.total, load.presumed_ended) == (0, 0, 0, 1)
    assert program.status is ProgramStatus.ACTING  # still tracked, on its backend
    assert registry.relevant(lambda p: True) == []  # and no claim on capacity
    # Its next call: back as it was, counted again, and presumed ended again once silent.
    run_step(registry, "p", 200.0, 210.0)
    assert not program.presumed_ended
    assert program.longest_tool_s == 150.0
    load = registry.load_by_backend()[B0]
    assert (load.acting, load.acting_tokens, load.presumed_ended) == (1, 1_000, 0)
    assert registry.presume_ended(210.0 + 599.0) == []
    assert registry.presume_ended(210.0 + 600.0) == [program]


def test_pausing_does_not_revive_a_silent_program_and_a_waiting_request_does() -> None:
    registry = ProgramRegistry()
    run_step(registry, "p", 0.0, 1.0)
    program = registry.get("p")
    assert registry.presume_ended(1.0 + ENDED_FLOOR_S) == [program]
    registry.pause(program, 70.0, reason="paused: over_capacity")
    registry.resume(program, 80.0, backend=B0, reason="resumed: capacity_free")
    assert registry.load_by_backend()[B0].presumed_ended == 1
    assert registry.load_by_backend()[B0].acting == 0
    registry.set_waiting(program, 90.0)
    assert not program.presumed_ended
    assert registry.load_by_backend()[B0].acting == 1
    registry.set_waiting(program, None)
    # Still silent afterwards: it is presumed ended again.
    assert registry.presume_ended(100.0) == [program]


async def test_a_finished_program_never_released_stops_holding_capacity_and_placement(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Acting claims never decay here and forced resumes wait longer than the test: only the
    # presumption can let the newcomer in before the idle lease.
    config = replace(CFG, max_wait_s=3_600, idle_lease_s=3_600)
    send, _receive = trio.open_memory_channel[AuditRecord](100_000)
    async with open_backend_pool([B0, B1]) as pool:
        for url in (B0, B1):
            pool.get(url).snapshot = snapshot(10_000)  # type: ignore[union-attr]
        settings = Settings(router="tr", policy=config)
        audit = AuditLog(send, run_id=1)
        sched = build_core(settings, pool, audit, registry=ProgramRegistry()).scheduler

        async def step(program_id: str, tokens: int) -> None:
            lease = await begin(sched, program_id, arrived_at=trio.current_time(),
                                context_chars=tokens * 4)  # fmt: skip
            end(sched, lease, 200, StepUsage(tokens - 100, 100, 0))

        await step("done", 9_000)  # placed on b0; its agent never releases it
        await step("alive", 3_000)  # b1, the less loaded
        assert sched.registry.get("alive").backend == B1
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(serve_resume_monitor, sched, interval=1.0))
            # While "done" may still come back, b0 looks the fuller: a newcomer goes to b1.
            await trio.sleep(ENDED_FLOOR_S - 5)
            assert sched.predict("new", "m") == B1
            await trio.sleep(10)
            # Silent past what its tool gaps explain: b0 is free for placement and capacity.
            assert sched.registry.get("done").presumed_ended
            assert sched.predict("new", "m") == B0
            start = trio.current_time()
            await step("big", 8_000)
            assert sched.registry.get("big").backend == B0
            assert trio.current_time() == pytest.approx(start)  # admitted at once
            nursery.cancel_scope.cancel()
