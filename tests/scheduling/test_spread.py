"""tr never worse than default: waits spread over the programs rather than piled on the same
ones."""

from __future__ import annotations

from dataclasses import replace

import trio

from thunderproxy.programs import ProgramStatus
from thunderproxy.scheduling import tr
from thunderproxy.scheduling.tr import Action

from .test_scheduler import CFG as SCHEDULER_CFG
from .test_scheduler import Harness, begin, end, open_harness
from .test_tail import CFG
from .test_tr import A, P, R, backend, prog


def test_a_program_that_waited_before_goes_first_among_equal_waits() -> None:
    running = prog("running", R, 5_000)
    fresh = prog("fresh", P, 4_000, waiting_since=10.0, paused_since=10.0, steps=5)
    stretched = replace(fresh, program_id="stretched", waiting_since=12.0, waited_total_s=30.0)
    # Room for one. "fresh" has waited 2 s longer for this call; "stretched" waited 30 s
    # for its earlier ones: its run is the longer, it goes first.
    decisions = tr.resume([backend()], [running, fresh, stretched], CFG, now=20.0)
    assert [(d.action, d.program_id) for d in decisions] == [(Action.RESUME, "stretched")]
    assert tr.priority(stretched, CFG, 20.0) == 8.0 + 30.0 + 30.0
    assert tr.priority(fresh, CFG, 20.0) == 10.0 + 30.0
    # Without earlier waits the order is the current wait's, as before.
    plain = replace(stretched, waited_total_s=0.0)
    decisions = tr.resume([backend()], [running, fresh, plain], CFG, now=20.0)
    assert [(d.action, d.program_id) for d in decisions] == [(Action.RESUME, "fresh")]


def test_earlier_waits_count_up_to_half_the_bound() -> None:
    # CFG's bound is 100 s: a long program's thousands of seconds of earlier waits count 50 s,
    # so a call near its bound is not passed by it.
    long_run = prog("long", P, 4_000, waiting_since=50.0, paused_since=50.0, waited_total_s=3e3)
    near = prog("near", P, 4_000, waiting_since=0.0, paused_since=0.0)
    assert tr.credit(long_run, CFG) == 50.0
    assert tr.priority(long_run, CFG, 90.0) == 40.0 + 50.0
    decisions = tr.resume([backend()], [prog("r", R, 5_000), long_run, near], CFG, now=90.0)
    assert [(d.action, d.program_id) for d in decisions] == [(Action.RESUME, "near")]


def test_room_is_made_first_for_the_program_that_waited_most_in_all() -> None:
    head = prog("head", P, 3_000, waiting_since=0.0, paused_since=0.0, steps=3)
    stretched = replace(head, program_id="stretched", waiting_since=5.0, waited_total_s=60.0)
    idle = prog("idle", A, 6_000, acting_since=40.0, tool_s=1.0)
    busy = prog("busy", R, 2_000)
    decisions = tr.enforce(backend(), [head, stretched, idle, busy], CFG, now=60.0)
    assert [(d.action, d.program_id, d.rule) for d in decisions] == [
        (Action.PAUSE, "idle", "make_room")
    ]
    assert decisions[0].detail == {"for": "stretched", "waited_s": 55.0}
    # The bound is still each call's own: at max_wait the head goes back, whatever the others.
    late = tr.resume([backend()], [head, stretched, busy, idle], CFG, now=100.0)
    assert (Action.FORCE_RESUME, "head") in [(d.action, d.program_id) for d in late]


async def test_the_scheduler_counts_what_a_programs_calls_waited(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = replace(SCHEDULER_CFG, max_wait_s=1_000)
    async with open_harness(cfg) as h:
        await _waits(h)


async def _waits(h: Harness) -> None:
    sched = h.scheduler
    hog = await begin(sched, "hog", arrived_at=trio.current_time(), context_chars=36_000)
    view = sched.source.program_view
    waited: list[float] = []

    async def second() -> None:
        lease = await begin(sched, "p", arrived_at=trio.current_time(), context_chars=8_000)
        waited.append(trio.current_time() - lease.arrived_at)
        end(sched, lease, 200)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.sleep(7.0)
        end(sched, hog, 200)
        sched.release("hog")  # room: "p" goes out after 7 s
    program = sched.registry.find("p")
    assert program is not None
    assert waited == [7.0]
    assert view(program).waited_total_s == 7.0
    assert program.status is ProgramStatus.ACTING
