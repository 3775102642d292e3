"""Each call in flight is a context of its own, and clients sharing a backend give way in the
order of the KV they hold: the tr rules as pure functions (tr.py)."""

from __future__ import annotations

from tests.scheduling.test_tr import CFG, A, B, P, R
from thunderproxy.programs import ProgramStatus
from thunderproxy.scheduling import tr
from thunderproxy.scheduling.tr import Action, BackendView, PolicyConfig, ProgramView


def backend(capacity: int = 10_000) -> BackendView:
    return BackendView(url=B, healthy=True, capacity_tokens=capacity)


def prog(name: str, status: ProgramStatus, tokens: int, **kw: object) -> ProgramView:
    kw.setdefault("backend", B)
    kw.setdefault("created_at", 0.0)
    return ProgramView(program_id=name, status=status, tokens=tokens, **kw)  # type: ignore[arg-type]


def test_a_program_weighs_each_call_it_has_in_flight() -> None:
    # Twelve calls under one id hold twelve prompts in the engine, not one.
    many = prog("many", R, 1_000, in_flight=4)
    assert tr.weight(many, CFG, 0.0) == 4_000
    assert tr.used_tokens(backend(), [many, prog("one", R, 1_000)], CFG, 0.0) == 5_000


def test_another_call_goes_out_only_where_one_more_context_fits() -> None:
    b = backend(10_000)
    running = prog("many", R, 2_000, in_flight=3)
    others = [prog("other", R, 3_000)]
    assert tr.on_call(running, b, [running, *others], CFG, 1.0).action is Action.QUEUE
    fewer = prog("many", R, 2_000, in_flight=2)
    decision = tr.on_call(fewer, b, [fewer, *others], CFG, 1.0)
    assert (decision.action, decision.rule) == (Action.ADMIT, "fits")


def test_another_call_does_not_pass_a_paused_program_waiting_for_room() -> None:
    b = backend(10_000)
    running = prog("many", R, 1_000, in_flight=1)
    waiting = prog("paused", P, 1_000, waiting_since=0.5)
    decision = tr.on_call(running, b, [running, waiting], CFG, 1.0)
    assert (decision.action, decision.rule) == (Action.QUEUE, "no_room_for_call")


def test_a_marked_programs_new_calls_wait_for_its_resume() -> None:
    marked = prog("many", R, 1_000, in_flight=2, marked=True)
    decision = tr.on_call(marked, backend(), [marked], CFG, 1.0)
    assert (decision.action, decision.rule) == (Action.QUEUE, "marked")


def test_held_calls_go_out_as_room_frees_without_passing_waiting_programs() -> None:
    b = backend(10_000)
    held = prog("many", R, 2_000, in_flight=2, held=3, waiting_since=0.0)
    decisions = tr.resume([b], [held, prog("other", R, 2_000)], CFG, 1.0)
    # 6,000 used: room for two more contexts of 2,000.
    assert [(d.action, d.rule) for d in decisions] == [(Action.ADMIT, "room_for_call")] * 2
    waiting = prog("paused", P, 9_000, waiting_since=0.0)
    assert tr.resume([b], [held, prog("other", R, 2_000), waiting], CFG, 1.0) == []


def test_the_context_a_call_left_is_kept_for_the_programs_next_call() -> None:
    cfg = PolicyConfig(**{**CFG.__dict__, "acting_half_life_s": 5.0})
    b = backend(10_000)
    # Two calls in flight, one just ended: its 2,000 tokens are still cached and counted.
    p = prog("many", R, 2_000, in_flight=2, ended=(9.9,))
    assert tr.weight(p, cfg, 10.0) > 5_900
    others = [prog("other", R, 3_900)]
    # Another program's held call does not take that room; the program's own next call does.
    assert tr.on_call(p, b, [p, *others], cfg, 10.0).action is Action.ADMIT
    assert tr.resume([b], [p.__class__(**{**p.__dict__, "held": 1}), *others], cfg, 10.0) == []


def test_the_client_holding_the_most_kv_is_paused_first() -> None:
    programs = [
        prog("alice-1", A, 3_000, acting_since=50.0, client="alice"),
        prog("bob-1", A, 2_000, acting_since=90.0, client="bob"),
        prog("bob-2", R, 4_000, client="bob"),
        prog("bob-3", R, 2_000, client="bob"),
    ]
    decisions = tr.enforce(backend(10_000), programs, CFG, 100.0)
    # Longest idle first would have paused alice's; bob holds 8,000 of the 11,000.
    assert [(d.action, d.program_id) for d in decisions] == [(Action.PAUSE, "bob-1")]
    # Without clients, the longest idle goes first, as before.
    plain = [ProgramView(**{**p.__dict__, "client": None}) for p in programs]
    decisions = tr.enforce(backend(10_000), plain, CFG, 100.0)
    assert [(d.action, d.program_id) for d in decisions] == [(Action.PAUSE, "alice-1")]


def test_a_client_within_its_share_is_not_held_for_anothers_overflow() -> None:
    b = backend(10_000)
    mine = prog("alice-1", A, 2_000, acting_since=9.0, client="alice")
    theirs = [prog(f"bob-{i}", R, 2_500, client="bob") for i in range(4)]
    decision = tr.on_return(mine, b, [mine, *theirs], CFG, 10.0)
    assert (decision.action, decision.rule) == (Action.ADMIT, "fair_share")
    # One client alone (or none configured): the overflow holds the call, as before.
    alone = [ProgramView(**{**p.__dict__, "client": "alice"}) for p in theirs]
    decision = tr.on_return(mine, b, [mine, *alone], CFG, 10.0)
    assert decision.action is Action.PAUSE


def test_paused_programs_of_the_client_holding_the_least_resume_first() -> None:
    b = backend(10_000)
    programs = [
        prog("bob-1", R, 4_000, client="bob"),
        prog("bob-2", P, 3_000, waiting_since=1.0, steps=3, client="bob"),
        prog("alice-1", P, 3_000, waiting_since=5.0, steps=0, client="alice"),
    ]
    decisions = tr.resume([b], programs, CFG, 6.0)
    assert [d.program_id for d in decisions][:1] == ["alice-1"]


def test_a_client_within_its_share_is_not_moved_for_anothers_overflow() -> None:
    # Bob's one program has its calls held (nothing of it to pause or mark) and the contexts
    # its ended calls left fill the cache; alice's one idle program is within an equal share.
    # Ordered by use alone, alice's was the only program to pause, and was paused.
    bob = prog("bob-1", A, 2_000, held=5, waiting_since=9.0, ended=(9.5,) * 4, client="bob")
    alice = prog("alice-1", A, 2_000, acting_since=9.9, client="alice")
    assert tr.used_tokens(backend(10_000), [bob, alice], CFG, 10.0) > 10_000
    assert tr.enforce(backend(10_000), [bob, alice], CFG, 10.0) == []
    # Without clients (or with one) it is paused as before.
    plain = [ProgramView(**{**p.__dict__, "client": None}) for p in (bob, alice)]
    decisions = tr.enforce(backend(10_000), plain, CFG, 10.0)
    assert [(d.action, d.program_id) for d in decisions] == [(Action.PAUSE, "alice-1")]
