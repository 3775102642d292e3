"""The tr policy as pure functions: snapshots and ``now`` in, decisions out."""

from __future__ import annotations

from dataclasses import replace

import pytest

from thunderproxy.programs import ProgramStatus
from thunderproxy.scheduling import tr
from thunderproxy.scheduling.tr import Action, BackendView, PolicyConfig, ProgramView

B = "http://b0"
R, A, P = ProgramStatus.REASONING, ProgramStatus.ACTING, ProgramStatus.PAUSED
CFG = PolicyConfig(
    decode_buffer=0,
    pause_cooldown_s=0,
    resume_cooldown_s=0,
    acting_half_life_s=0,
    target_fill=1.0,
    max_wait_s=100,
    resume_protection_s=30,
    idle_lease_s=600,
)


def backend(capacity: int | None = 10_000, **kw: object) -> BackendView:
    return BackendView(url=kw.pop("url", B), healthy=True, capacity_tokens=capacity, **kw)  # type: ignore[arg-type]


def prog(name: str, status: ProgramStatus, tokens: int, **kw: object) -> ProgramView:
    kw.setdefault("backend", B)
    kw.setdefault("created_at", 0.0)
    return ProgramView(program_id=name, status=status, tokens=tokens, **kw)  # type: ignore[arg-type]


def test_marked_programs_are_credited_so_a_small_overflow_marks_one_program() -> None:
    # Defect 2: without the credit, every reasoning program gets marked on a 1% overflow.
    programs = [prog(f"r{i}", R, 1_010, created_at=float(i)) for i in range(10)]
    decisions = tr.enforce(backend(10_000), programs, CFG, now=50.0)
    assert [(d.action, d.program_id) for d in decisions] == [(Action.MARK, "r9")]
    assert decisions[0].used_tokens == 10_100
    assert decisions[0].capacity_tokens == 10_000
    # The next rounds see r9 marked and credited: nothing more is marked, round after round.
    marked = [replace(p, marked=p.program_id == "r9") for p in programs]
    for now in (51.0, 52.0, 53.0):
        assert tr.enforce(backend(10_000), marked, CFG, now=now) == []


def test_idle_programs_are_paused_longest_idle_first_not_by_size() -> None:
    # Defect 4: victims by idle time. The small long-idle program goes first.
    programs = [
        prog("busy", R, 6_000),
        prog("big-recent", A, 4_000, acting_since=99.0),
        prog("small-old", A, 1_000, acting_since=10.0),
    ]
    decisions = tr.enforce(backend(10_000), programs, CFG, now=100.0)
    assert [(d.action, d.program_id) for d in decisions] == [(Action.PAUSE, "small-old")]
    assert decisions[0].idle_s == 90.0


def test_acting_tokens_decay_with_the_configured_half_life() -> None:
    cfg = PolicyConfig(decode_buffer=0, acting_half_life_s=10.0)
    acting = prog("a", A, 8_000, acting_since=0.0)
    assert tr.weight(acting, cfg, now=0.0) == 8_000
    assert tr.weight(acting, cfg, now=10.0) == 4_000
    assert tr.weight(acting, cfg, now=30.0) == 1_000
    no_decay = PolicyConfig(decode_buffer=0, acting_half_life_s=0)
    assert tr.weight(acting, no_decay, now=1e6) == 8_000


def test_decay_frees_room_for_admission() -> None:
    cfg = PolicyConfig(
        decode_buffer=0, acting_half_life_s=5.0, admission_half_life_s=20.0, target_fill=1.0
    )
    programs = [prog("a", A, 9_000, acting_since=0.0)]
    newcomer = prog("new", R, 4_000)
    assert tr.admit(newcomer, backend(10_000), programs, cfg, now=1.0).action is Action.QUEUE
    # Newcomers see idle claims decay with the longer admission half-life: at 10 s "a" still
    # claims 6,364 tokens for them (its next call is likely), though only 2,250 for others.
    assert tr.admit(newcomer, backend(10_000), programs, cfg, now=10.0).action is Action.QUEUE
    assert tr.admit(newcomer, backend(10_000), programs, cfg, now=30.0).action is Action.ADMIT
    a_returning = prog("a", A, 9_000, acting_since=0.0)
    assert tr.weight(a_returning, cfg, now=10.0) == 2_250
    assert tr.admission_used(backend(10_000), programs, cfg, now=10.0) == 6_363


def test_pause_cooldown_limits_pause_rounds() -> None:
    cfg = PolicyConfig(decode_buffer=0, pause_cooldown_s=5.0, acting_half_life_s=0)
    programs = [prog("r", R, 9_000), prog("a", A, 5_000, acting_since=0.0)]
    assert tr.enforce(backend(10_000, last_pause_at=98.0), programs, cfg, now=100.0) == []
    assert tr.enforce(backend(10_000, last_pause_at=94.0), programs, cfg, now=100.0)


def test_shared_prefix_is_credited_once_per_extra_program() -> None:
    programs = [prog(f"a{i}", A, 3_000, acting_since=0.0) for i in range(4)]
    assert tr.used_tokens(backend(), programs, CFG, now=0.0) == 12_000
    shared = backend(shared_prefix_tokens=1_000)
    assert tr.used_tokens(shared, programs, CFG, now=0.0) == 9_000
    assert tr.enforce(backend(10_000, shared_prefix_tokens=1_000), programs, CFG, 0.0) == []


def test_preemption_backoff_shrinks_the_usable_capacity() -> None:
    assert tr.limit(backend(10_000, capacity_factor=0.8), CFG) == 8_000


def test_unknown_capacity_never_stalls() -> None:
    # Defect 5: a backend whose capacity metric is missing admits instead of queuing forever.
    programs = [prog("a", R, 50_000)]
    decision = tr.admit(prog("new", R, 50_000), backend(None), programs, CFG, now=0.0)
    assert decision.action is Action.ADMIT
    assert decision.rule == "capacity_unknown"
    assert tr.enforce(backend(None), programs, CFG, now=0.0) == []


def test_newcomers_queue_behind_waiting_programs() -> None:
    programs = [prog("w", P, 100, waiting_since=5.0, paused_since=1.0)]
    decision = tr.admit(prog("new", R, 10), backend(), programs, CFG, now=6.0)
    assert (decision.action, decision.rule, decision.queue_position) == (
        Action.QUEUE,
        "programs_waiting",
        1,
    )


def test_resume_serves_the_longest_wait_first_not_the_smallest() -> None:
    # Defect 3: smallest-first starves big programs; here the older big one goes first.
    programs = [
        prog("big", P, 6_000, waiting_since=1.0, paused_since=0.0),
        prog("small", P, 1_000, waiting_since=2.0, paused_since=0.0),
        prog("running", R, 3_000),
    ]
    decisions = tr.resume([backend(9_500)], programs, CFG, now=3.0)
    # Smallest-first would resume "small" and leave no room for "big".
    assert [(d.action, d.program_id) for d in decisions] == [(Action.RESUME, "big")]


def test_aging_head_reserves_capacity_and_max_wait_forces_resume() -> None:
    programs = [
        prog("head", P, 9_000, waiting_since=0.0, paused_since=0.0),
        prog("small", P, 500, waiting_since=1.0, paused_since=0.0),
        prog("running", R, 5_000),
    ]
    # Early on, the small one may pass the head that does not fit.
    early = tr.resume([backend(10_000)], programs, CFG, now=10.0)
    assert [(d.action, d.program_id) for d in early] == [(Action.RESUME, "small")]
    # Past half of max_wait the head reserves the next free capacity: nobody passes.
    assert tr.resume([backend(10_000)], programs, CFG, now=60.0) == []
    # At max_wait it goes back regardless of capacity.
    late = tr.resume([backend(10_000)], programs, CFG, now=100.0)
    assert [(d.action, d.program_id, d.rule) for d in late] == [
        (Action.FORCE_RESUME, "head", "max_wait")
    ]
    assert late[0].waited_s == 100.0


def test_a_long_running_programs_call_waits_a_share_of_its_run_up_to_five_bounds() -> None:
    # 800 s into its run, a batch call may wait a quarter of that, 200 s, not max_wait's 100.
    old = prog("old", P, 9_000, created_at=0.0, waiting_since=800.0, paused_since=800.0)
    running = prog("running", R, 5_000)
    assert tr.bound(old, CFG) == 200.0
    assert tr.resume([backend(10_000)], [old, running], CFG, now=900.0) == []
    late = tr.resume([backend(10_000)], [old, running], CFG, now=1_000.0)
    assert [(d.action, d.rule) for d in late] == [(Action.FORCE_RESUME, "max_wait")]
    # Room is made for it at half of its own bound, not at half of max_wait.
    assert not tr.urgent(old, CFG, now=899.0)
    assert tr.urgent(old, CFG, now=900.0)
    # Never past five times max_wait; young programs, interactive ones and a share of 0 keep
    # their class's bound.
    assert tr.call_bound("batch", 0.0, 10_000.0, CFG) == 500.0
    assert tr.call_bound("batch", 0.0, 300.0, CFG) == 100.0
    assert tr.call_bound("interactive", 0.0, 10_000.0, CFG) == CFG.interactive_max_wait_s
    assert tr.call_bound("batch", 0.0, 800.0, replace(CFG, max_wait_share=0.0)) == 100.0


def test_a_protected_program_is_not_paused_again() -> None:
    programs = [
        prog("forced", A, 9_000, acting_since=0.0, protected_until=130.0),
        prog("other", A, 5_000, acting_since=50.0),
    ]
    decisions = tr.enforce(backend(10_000), programs, CFG, now=100.0)
    assert [d.program_id for d in decisions] == ["other"]


def test_resume_migrates_when_the_own_backend_is_full_or_dead() -> None:
    full = backend(10_000, url="http://full")
    free = backend(10_000, url="http://free")
    programs = [
        prog("hog", R, 9_500, backend="http://full"),
        prog("p", P, 2_000, backend="http://full", waiting_since=1.0, paused_since=0.0),
    ]
    decisions = tr.resume([full, free], programs, CFG, now=2.0)
    assert [(d.action, d.rule, d.target_backend) for d in decisions] == [
        (Action.MIGRATE, "own_backend_full", "http://free")
    ]
    dead = BackendView(url="http://full", healthy=False, capacity_tokens=10_000)
    decisions = tr.resume([dead, free], programs[1:], CFG, now=2.0)
    assert [(d.action, d.rule) for d in decisions] == [(Action.MIGRATE, "backend_unhealthy")]


def test_idle_lease_retires_programs_never_released() -> None:
    # Defect 9: a client that never releases stops counting after the lease.
    programs = [
        prog("stale", A, 100, last_activity=0.0),
        prog("fresh", A, 100, last_activity=500.0),
        prog("waiting", P, 100, last_activity=0.0, waiting_since=0.0),
    ]
    decisions = tr.retire(programs, CFG, now=700.0)
    assert [(d.action, d.program_id) for d in decisions] == [(Action.RETIRE, "stale")]
    off = PolicyConfig(idle_lease_s=0)
    assert tr.retire(programs, off, now=1e9) == []


@pytest.mark.parametrize("fill", [0.5, 0.9, 1.0])
def test_target_fill_scales_the_limit(fill: float) -> None:
    cfg = PolicyConfig(target_fill=fill)
    assert tr.limit(backend(10_000), cfg) == int(10_000 * fill)


def test_a_returning_program_that_would_overflow_waits() -> None:
    others = [prog("r", R, 6_000)]
    back = prog("back", A, 3_000, acting_since=0.0)
    fits = tr.on_return(back, backend(10_000), [*others, back], CFG, now=5.0)
    assert (fits.action, fits.rule) == (Action.ADMIT, "fits")
    big = replace(back, tokens=5_000)
    waits = tr.on_return(big, backend(10_000), [*others, big], CFG, now=5.0)
    assert (waits.action, waits.rule) == (Action.PAUSE, "no_room_on_return")
    assert waits.used_tokens == 6_000  # its own acting weight is not counted twice
    protected = replace(big, protected_until=10.0)
    assert tr.on_return(protected, backend(10_000), [*others], CFG, now=5.0).action is (
        Action.ADMIT
    )


def test_reasoning_programs_are_marked_only_when_calls_alone_overflow() -> None:
    # The overflow comes from an idle program that cannot be paused (protected): marking a
    # busy program would cost it a long wait and save no cache.
    programs = [
        prog("busy", R, 6_000),
        prog("forced", A, 5_000, acting_since=0.0, protected_until=1e9),
    ]
    assert tr.enforce(backend(10_000), programs, CFG, now=1.0) == []
    # Calls in flight alone exceed the cache: the youngest is marked.
    crowded = [prog("old", R, 6_000, created_at=0.0), prog("young", R, 5_000, created_at=1.0)]
    decisions = tr.enforce(backend(10_000), crowded, CFG, now=1.0)
    assert [(d.action, d.program_id, d.rule) for d in decisions] == [
        (Action.MARK, "young", "calls_exceed_capacity")
    ]
