"""Workload building, pure: how each trace becomes programs, steps and gaps."""

from __future__ import annotations

import pytest

from tests.bench.synthetic import mooncake_rows, thunderagent_rows
from thunderproxy.bench.workloads import workload
from thunderproxy.bench.workloads.workload import SCHEMA_TOKENS, TEMPLATE_TOKENS, StepSpec


def test_thunderagent_prompts_decode_lengths_and_gaps_follow_the_trace() -> None:
    rows = thunderagent_rows(programs=2, steps=3)
    w = workload.thunderagent(rows, seed=0, shuffle=False)
    assert [p.program_id for p in w.programs] == ["bs4/task-0", "bs4/task-1"]
    first = w.programs[0]
    recorded = [r for r in rows if r["program_id"] == "bs4/task-0"]
    assert [s.prompt_tokens for s in first.steps] == [
        r["input_tokens"] + SCHEMA_TOKENS for r in recorded
    ]
    # task-0 has measured tool-call arguments (10 tokens): decode = text + arguments.
    assert [s.output_tokens for s in first.steps] == [r["output_tokens"] + 10 for r in recorded]
    # The gap before step k+1 is step k's gap_after_s; the first step has none.
    assert [s.gap_before_s for s in first.steps] == [0.0, 0.5, 0.5]
    assert w.system_tokens == SCHEMA_TOKENS + TEMPLATE_TOKENS
    assert w.natural_arrivals == "closed"


def test_missing_tool_arguments_are_drawn_from_the_measured_ones_reproducibly() -> None:
    rows = thunderagent_rows(programs=2, steps=3)
    a = workload.thunderagent(rows, seed=1, shuffle=False)
    b = workload.thunderagent(rows, seed=1, shuffle=False)
    assert a == b
    imputed = a.programs[1]  # task-1 has no estimates: each is one of the measured (10)
    recorded = [r for r in rows if r["program_id"] == "bs4/task-1"]
    assert [s.output_tokens for s in imputed.steps] == [r["output_tokens"] + 10 for r in recorded]
    assert any("3 of 6 calls had no estimate" in note for note in a.notes)


def test_program_order_is_a_seeded_shuffle() -> None:
    rows = thunderagent_rows(programs=12, steps=1)
    ids = [p.program_id for p in workload.thunderagent(rows, seed=0).programs]
    assert ids == [p.program_id for p in workload.thunderagent(rows, seed=0).programs]
    assert ids != sorted(ids, key=lambda i: int(i.split("-")[1]))
    assert ids != [p.program_id for p in workload.thunderagent(rows, seed=1).programs]


def test_mooncake_sessions_become_programs_with_block_prompts_and_recorded_times() -> None:
    requests, sessions = mooncake_rows()
    w = workload.mooncake(requests, sessions, name="mc")
    assert [p.program_id for p in w.programs] == ["mc/0", "mc/1"]
    session = w.programs[0]
    assert [s.blocks for s in session.steps] == [(0, 1, 2), (0, 1, 2, 3)]
    assert [s.at_s for s in session.steps] == [0.0, 4.0]
    assert [p.arrival_s for p in w.programs] == [0.0, 1.0]
    assert w.natural_arrivals == "trace"
    # No eviction ever: every distinct block (0, 1, 2, 3, 7) plus every answer.
    assert w.no_eviction_tokens() == 5 * 512 + 20 + 10 + 30


def test_audit_steps_replay_successful_calls_with_their_tool_time() -> None:
    rows = [
        {"program_id": "a", "step": 1, "status": 200, "prompt_tokens": 900,
         "completion_tokens": 50, "cached_tokens": 300, "tool_s": None, "arrived_at": 100.0},
        {"program_id": "a", "step": 2, "status": 200, "prompt_tokens": 1300,
         "completion_tokens": 70, "cached_tokens": 900, "tool_s": 2.5, "arrived_at": 105.0},
        {"program_id": "a", "step": 3, "status": 500, "prompt_tokens": None,
         "completion_tokens": None, "cached_tokens": None, "tool_s": 1.0, "arrived_at": 110.0},
        {"program_id": "b", "step": 1, "status": 200, "prompt_tokens": 800,
         "completion_tokens": 40, "cached_tokens": 310, "tool_s": None, "arrived_at": 103.0},
    ]  # fmt: skip
    w = workload.from_audit_steps(rows)
    a, b = w.programs
    assert [(s.prompt_tokens, s.output_tokens, s.gap_before_s) for s in a.steps] == [
        (900, 50, 0.0),
        (1300, 70, 2.5),
    ]
    assert (a.arrival_s, b.arrival_s) == (0.0, 3.0)
    assert w.system_tokens == 305  # median of the first calls' cached tokens


def test_subset_cuts_programs_and_steps() -> None:
    w = workload.thunderagent(thunderagent_rows(programs=5, steps=6), shuffle=False)
    small = w.subset(2, 3)
    assert len(small.programs) == 2
    assert all(len(p.steps) == 3 for p in small.programs)
    assert small.steps == 6
    assert small.notes[-1] == "subset: 2 programs, at most 3 steps each"
    assert w.subset(4).notes[-1] == "subset: 4 programs"


def test_context_sizes() -> None:
    steps = (StepSpec(1000, 100), StepSpec(1500, 300))
    program = workload.ProgramSpec("p", steps)
    assert program.context_tokens == 1800
    w = workload.Workload("w", (program,), system_tokens=50)
    assert w.no_eviction_tokens() == 1800  # the shared prefix is part of the program's context
    assert w.mean_context_tokens() == 1450
    # Two programs hold the shared prefix once; an answer not carried whole is KV never reused.
    other = workload.ProgramSpec("q", (StepSpec(1000, 100, carried_tokens=30), StepSpec(1430, 9)))
    both = workload.Workload("w", (program, other), system_tokens=50)
    assert both.no_eviction_tokens() == 50 + 1750 + (1439 - 50) + 100


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate() -> None:
    times = workload.poisson_arrivals(4000, 2.0, seed=3)
    assert times == workload.poisson_arrivals(4000, 2.0, seed=3)
    assert times[0] == 0.0
    assert times[-1] / len(times) == pytest.approx(0.5, rel=0.05)
    with pytest.raises(ValueError, match="rate"):
        workload.poisson_arrivals(3, 0.0, seed=0)


def test_sampling_keeps_a_seeded_fraction_in_order() -> None:
    w = workload.thunderagent(thunderagent_rows(programs=200, steps=1), shuffle=False)
    half = w.sample(0.5, seed=4)
    assert half == w.sample(0.5, seed=4)
    assert 70 < len(half.programs) < 130
    order = [p.program_id for p in w.programs]
    kept = [p.program_id for p in half.programs]
    assert kept == [i for i in order if i in set(kept)]
    assert w.sample(1.0) is w
    with pytest.raises(ValueError, match="fraction"):
        w.sample(0.0)


def test_reshaping_moves_the_shared_prefix_and_drops_uncarried_answers_from_later_prompts() -> None:
    rows = thunderagent_rows(programs=2, steps=3)
    w = workload.thunderagent(rows, shuffle=False)
    shaped = w.reshape(shared_prefix_tokens=13_000, carry_answer=0.3)
    assert shaped.system_tokens == 13_000
    grow = 13_000 - (SCHEMA_TOKENS + TEMPLATE_TOKENS)
    for before, after in zip(w.programs, shaped.programs, strict=True):
        dropped = 0
        for old, new in zip(before.steps, after.steps, strict=True):
            # What the program adds of its own (observations) is unchanged; the prompt holds
            # the bigger shared prefix and only 30% of each answer before it.
            assert new.prompt_tokens == old.prompt_tokens + grow - dropped
            assert new.carried_tokens == round(0.3 * old.output_tokens)
            assert (new.output_tokens, new.gap_before_s) == (old.output_tokens, old.gap_before_s)
            dropped += old.output_tokens - new.carried
    assert shaped.notes[-2].startswith("shared prefix: 13000 tokens instead of 1800")
    assert w.reshape() is w
    # Carrying everything again is the recorded workload's prompts.
    assert [s.prompt_tokens for p in shaped.reshape(carry_answer=1).programs for s in p.steps] == [
        s.prompt_tokens + grow for p in w.programs for s in p.steps
    ]


def test_reshaping_refuses_block_prompts_and_bad_values() -> None:
    requests, sessions = mooncake_rows()
    with pytest.raises(ValueError, match="block prompts"):
        workload.mooncake(requests, sessions).reshape(carry_answer=0.5)
    w = workload.thunderagent(thunderagent_rows(programs=1, steps=2))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        w.reshape(carry_answer=1.5)
    with pytest.raises(ValueError, match=">= 0"):
        w.reshape(shared_prefix_tokens=-1)


def test_a_calls_file_may_say_its_shared_prefix_and_what_answers_carry() -> None:
    rows = thunderagent_rows(programs=2, steps=3)
    for row in rows:
        row["shared_prefix_tokens"] = 350
    rows[0]["carry_answer"] = False
    rows[1]["carry_answer"] = 0.5
    w = workload.thunderagent(rows, shuffle=False)
    # input_tokens is then the whole prompt: no tool-schema block is imputed around it.
    assert w.system_tokens == 350
    first = w.programs[0].steps
    assert [s.prompt_tokens for s in first] == [r["input_tokens"] for r in rows[:3]]
    assert [s.carried_tokens for s in first] == [0, round(0.5 * first[1].output_tokens), None]
    assert any("carry_answer says on 2 of 6 calls" in note for note in w.notes)
    # A recorded carry is the baseline a reshape starts from: only the difference moves prompts.
    again = w.reshape(carry_answer=0.5).programs[0].steps
    assert again[1].prompt_tokens == first[1].prompt_tokens + round(0.5 * first[0].output_tokens)
    rows[4]["shared_prefix_tokens"] = 351
    with pytest.raises(ValueError, match="one value on every call"):
        workload.thunderagent(rows)
    rows[4]["shared_prefix_tokens"] = 350
    rows[2]["carry_answer"] = 2
    with pytest.raises(ValueError, match="carry_answer"):
        workload.thunderagent(rows)
