"""tr's tail: priorities with aging, room made for a call before its bound, victims chosen by
their tools, and the measured choice not to hold programs back where it does not pay."""

from __future__ import annotations

from dataclasses import replace

from thunderproxy.scheduling import tr
from thunderproxy.scheduling.classes import INTERACTIVE
from thunderproxy.scheduling.tr import Action, BackendView

from . import test_tr
from .test_tr import A, B, P, R, backend, prog

# The views and the policy config of the policy's own tests, with a head start for programs
# under way.
CFG = replace(test_tr.CFG, mid_program_head_start_s=30)


def test_programs_under_way_go_before_newcomers_until_a_newcomer_has_aged() -> None:
    running = prog("running", R, 5_000)
    newcomer = prog("new", P, 4_000, waiting_since=0.0, paused_since=0.0, steps=0)
    midway = prog("midway", P, 4_000, waiting_since=10.0, paused_since=9.0, steps=7)
    # Room for one: the newcomer waited longer, but the program under way goes first.
    decisions = tr.resume([backend()], [running, newcomer, midway], CFG, now=20.0)
    assert [(d.action, d.program_id) for d in decisions] == [(Action.RESUME, "midway")]
    # Aging: a newcomer that has waited the head start longer than the midway one goes first.
    late = replace(midway, waiting_since=35.0)
    decisions = tr.resume([backend()], [running, newcomer, late], CFG, now=40.0)
    assert [(d.action, d.program_id) for d in decisions] == [(Action.RESUME, "new")]
    assert tr.priority(newcomer, CFG, 40.0) == 40.0
    assert tr.priority(late, CFG, 40.0) == 5.0 + 30.0


def test_room_is_made_at_half_the_bound_pausing_the_longest_tool_first() -> None:
    head = prog("head", P, 3_000, waiting_since=0.0, paused_since=0.0, steps=3)
    quick = prog("quick", A, 4_000, acting_since=40.0, tool_s=1.0)
    slow = prog("slow", A, 4_000, acting_since=45.0, tool_s=120.0)
    busy = prog("busy", R, 2_000)
    programs = [head, quick, slow, busy]
    # Before half the bound the backend is within capacity: nothing moves.
    assert tr.enforce(backend(), programs, CFG, now=49.0) == []
    decisions = tr.enforce(backend(), programs, CFG, now=50.0)
    # "quick" has been idle longer, but "slow" is expected to stay away much longer.
    assert [(d.action, d.program_id, d.rule) for d in decisions] == [
        (Action.PAUSE, "slow", "make_room")
    ]
    assert decisions[0].detail == {"for": "head", "waited_s": 50.0}
    assert decisions[0].capacity_tokens == 10_000 - 3_000


def test_room_for_a_batch_call_is_made_only_from_programs_that_waited_less() -> None:
    # "slow" has the longest tool, but its calls waited 40 s in all: more than the head's
    # (10 s before, and half of its 50 s now). Pausing it would move the wait to a program
    # that has already waited more, and such programs made the tail; "quick" goes instead.
    head = prog("head", P, 3_000, waiting_since=0.0, paused_since=0.0, steps=3, waited_total_s=10)
    quick = prog("quick", A, 4_000, acting_since=40.0, tool_s=1.0, waited_total_s=30)
    slow = prog("slow", A, 4_000, acting_since=45.0, tool_s=120.0, waited_total_s=40)
    busy = prog("busy", R, 2_000)
    decisions = tr.enforce(backend(), [head, quick, slow, busy], CFG, now=50.0)
    assert [(d.action, d.program_id, d.rule) for d in decisions] == [
        (Action.PAUSE, "quick", "make_room")
    ]
    # Where every idle program has waited more, nobody is paused: the head waits for room
    # that frees itself, or for its bound.
    waited = replace(quick, waited_total_s=36)
    assert tr.enforce(backend(), [head, waited, slow, busy], CFG, now=50.0) == []
    # From 0.9 of its bound (100 s here) the call takes room from anyone, the longest tool
    # first: at the bound it would go out into a full cache all the same. (Both have waited
    # more than the head's 10 s and half its 89 or 90 s.)
    late = [head, replace(quick, waited_total_s=60), replace(slow, waited_total_s=60), busy]
    assert tr.enforce(backend(), late, CFG, now=89.0) == []
    decisions = tr.enforce(backend(), late, CFG, now=90.0)
    assert [(d.action, d.program_id) for d in decisions] == [(Action.PAUSE, "slow")]
    # A person's call takes room from any batch program, however long it has waited.
    person = replace(head, program_class=INTERACTIVE, waiting_since=49.0)
    decisions = tr.enforce(backend(), [person, waited, slow, busy], CFG, now=50.0)
    assert [(d.action, d.program_id) for d in decisions] == [(Action.PAUSE, "slow")]


def test_running_calls_are_not_cut_short_to_make_room() -> None:
    # Marking running calls for a waiting one (a time slice) evicted a running program's cache
    # at every turn (SWE-agent, 32 programs: 28.1 steps/min with it, 33.2 without). Room is
    # made from idle programs only; calls in flight are marked only when they alone overflow.
    head = prog("head", P, 5_000, waiting_since=0.0, paused_since=0.0, steps=3)
    old = prog("old", R, 5_000, created_at=0.0)
    young = prog("young", R, 4_000, created_at=5.0)
    assert tr.enforce(backend(), [head, old, young], CFG, now=50.0) == []
    assert tr.resume([backend()], [head, old, young], CFG, now=50.0) == []
    crowded = [head, old, replace(young, tokens=6_000)]
    decisions = tr.enforce(backend(), crowded, CFG, now=50.0)
    assert [(d.action, d.program_id, d.rule) for d in decisions] == [
        (Action.MARK, "young", "calls_exceed_capacity")
    ]


def test_force_resume_at_the_bound_goes_to_its_own_backend_or_a_healthy_one() -> None:
    p = prog("p", P, 9_000, waiting_since=0.0, paused_since=0.0)
    other = backend(url="http://b1")
    decision = tr.force_resume(p, [backend(), other], [p], CFG, now=100.0)
    assert decision is not None
    assert (decision.action, decision.rule, decision.target_backend) == (
        Action.FORCE_RESUME,
        "max_wait",
        B,
    )
    assert decision.waited_s == 100.0
    dead = BackendView(url=B, healthy=False, capacity_tokens=10_000)
    moved = tr.force_resume(p, [dead, other], [p], CFG, now=100.0)
    assert moved is not None
    assert moved.target_backend == "http://b1"
    assert tr.force_resume(p, [dead], [p], CFG, now=100.0) is None


def test_where_holding_does_not_pay_tr_proxies_like_default() -> None:
    inputs = {"recompute_s": 1.0, "wait_s": 30.0}
    off = backend(hold=False, hold_inputs=inputs)
    running = prog("running", R, 9_000)
    waiting = prog("w", P, 4_000, waiting_since=0.0, paused_since=0.0, steps=2)
    idle = prog("idle", A, 5_000, acting_since=0.0)
    new = prog("new", R, 4_000)
    decision = tr.admit(new, off, [running, waiting], CFG, now=1.0)
    assert (decision.action, decision.rule, decision.detail) == (
        Action.ADMIT,
        "hold_does_not_pay",
        inputs,
    )
    back = prog("back", A, 4_000, acting_since=0.0)
    assert tr.on_return(back, off, [running, back], CFG, now=1.0).rule == "hold_does_not_pay"
    assert tr.enforce(off, [running, idle], CFG, now=60.0) == []
    resumed = tr.resume([off], [running, waiting], CFG, now=1.0)
    assert [(d.action, d.program_id, d.rule) for d in resumed] == [
        (Action.RESUME, "w", "hold_does_not_pay")
    ]
    # The same programs on a backend where holding pays: queued, gated, paused.
    on = backend()
    assert tr.admit(new, on, [running, waiting], CFG, now=1.0).action is Action.QUEUE
    assert tr.on_return(back, on, [running, back], CFG, now=1.0).action is Action.PAUSE
    assert [d.program_id for d in tr.enforce(on, [running, idle], CFG, now=60.0)] == ["idle"]
    assert tr.resume([on], [running, waiting], CFG, now=1.0) == []


def test_a_queued_newcomer_fits_only_where_programs_under_way_keep_room_for_their_next_call() -> (
    None
):
    cfg = replace(CFG, acting_half_life_s=5.0, admission_half_life_s=60.0)
    idle = prog("idle", A, 6_000, acting_since=0.0)  # its tool ended 20 s ago, likely back soon
    newcomer = prog("new", P, 5_500, waiting_since=15.0, paused_since=15.0, steps=0)
    midway = prog("midway", P, 5_500, waiting_since=15.0, paused_since=10.0, steps=4)
    # To a program under way, the idle claim has decayed (6,000 · 2^-4 = 375): it goes back.
    decisions = tr.resume([backend()], [idle, midway], cfg, now=20.0)
    assert [(d.action, d.program_id) for d in decisions] == [(Action.RESUME, "midway")]
    # A first call sees 6,000 · 2^(-20/60) = 4,762 still claimed: it waits at its boundary.
    assert tr.resume([backend()], [idle, newcomer], cfg, now=20.0) == []
    assert tr.admission_used(backend(), [idle], cfg, now=20.0) == 4_762


def test_a_call_past_half_its_bound_takes_its_room_through_the_resume_cooldown() -> None:
    # Resume rounds are spaced by --resume-cooldown, but a call past half its bound would
    # otherwise wait for the next round with its room free, and often reach its bound (where
    # it goes out over capacity): it takes the room whenever a call ends.
    cfg = replace(CFG, pause_cooldown_s=5.0, resume_cooldown_s=5.0)
    head = prog("head", P, 3_000, waiting_since=0.0, paused_since=0.0, steps=3)
    busy = prog("busy", R, 5_000)
    cooling = backend(last_pause_at=48.0, last_resume_at=48.0)
    resumed = tr.resume([cooling], [head, busy], cfg, now=50.0)
    assert [(d.action, d.program_id) for d in resumed] == [(Action.RESUME, "head")]
    # A call that has not waited that long still waits out the cooldown.
    early = replace(head, waiting_since=20.0)
    assert tr.resume([cooling], [early, busy], cfg, now=50.0) == []
    assert tr.resume([backend(last_resume_at=44.0)], [early, busy], cfg, now=50.0)


def test_resume_rounds_are_a_call_apart_where_calls_are_shorter_than_the_cooldown() -> None:
    # Councils' calls last about a second: with rounds 5 s apart, their returning members
    # waited seconds beside a nearly empty cache. Where calls are that short, a round comes a
    # call after the last; where they are longer (SWE-agent calls: 18 s), the cooldown stays.
    cfg = replace(CFG, resume_cooldown_s=5.0)
    waiting = prog("member", P, 1_000, waiting_since=49.0, paused_since=49.0, steps=1)
    busy = prog("busy", R, 2_000)
    unknown = backend(last_resume_at=48.5)
    assert tr.resume_cooldown(unknown, cfg) == 5.0  # no call has ended yet
    assert tr.resume([unknown], [waiting, busy], cfg, now=50.0) == []
    slow = backend(last_resume_at=48.5, call_s=18.0)
    assert tr.resume_cooldown(slow, cfg) == 5.0
    assert tr.resume([slow], [waiting, busy], cfg, now=50.0) == []
    quick = backend(last_resume_at=48.5, call_s=1.0)
    assert tr.resume_cooldown(quick, cfg) == 1.0
    resumed = tr.resume([quick], [waiting, busy], cfg, now=50.0)
    assert [(d.action, d.program_id, d.rule) for d in resumed] == [
        (Action.RESUME, "member", "capacity_free")
    ]
    # Within a call of the last round it still waits.
    assert tr.resume([quick], [waiting, busy], cfg, now=49.0) == []


def test_make_room_at_once_pauses_for_a_call_past_half_its_bound_through_the_cooldown() -> None:
    cfg = replace(CFG, pause_cooldown_s=5.0)
    head = prog("head", P, 3_000, waiting_since=0.0, paused_since=0.0, steps=3)
    idle = prog("idle", A, 4_000, acting_since=49.0, tool_s=10.0)
    busy = prog("busy", R, 5_000)
    cooling = backend(last_pause_at=48.0)
    # By default, room is made in pause rounds: the cooldown holds it back.
    assert tr.enforce(cooling, [head, idle, busy], cfg, now=50.0) == []
    at_once = replace(cfg, make_room_at_once=True)
    # Before half the bound the cooldown holds, as for any round.
    assert tr.enforce(cooling, [head, idle, busy], at_once, now=49.0) == []
    decisions = tr.enforce(cooling, [head, idle, busy], at_once, now=50.0)
    assert [(d.action, d.program_id, d.rule) for d in decisions] == [
        (Action.PAUSE, "idle", "make_room")
    ]
    # An overflow with nobody due keeps to the pause cooldown.
    crowded = [replace(idle, tokens=6_000), busy]
    assert tr.enforce(cooling, crowded, at_once, now=50.0) == []
    assert tr.enforce(backend(last_pause_at=40.0), crowded, at_once, now=50.0)
