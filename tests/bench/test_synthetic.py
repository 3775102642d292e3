"""The made-up workloads: councils and one-shot calls, seeded and shaped as documented."""

from __future__ import annotations

from collections import defaultdict

from thunderproxy.bench.workloads import synthetic
from thunderproxy.bench.workloads.traces import load_workload


def test_a_council_is_members_answering_then_reviewing_then_a_chairman() -> None:
    workload = load_workload("council", seed=3)
    assert workload.natural_arrivals == "trace"
    councils: dict[str, list] = defaultdict(list)
    for program in workload.programs:
        councils[program.program_id.split(":")[1]].append(program)
    assert len(councils) == synthetic.COUNCILS
    for programs in councils.values():
        members = [p for p in programs if "member" in p.program_id]
        (chairman,) = [p for p in programs if p.program_id.endswith("chairman")]
        assert len(members) in (3, 4)
        assert len({p.arrival_s for p in members}) == 1  # asked together
        answers = sum(p.steps[0].output_tokens for p in members)
        for member in members:
            first, review = member.steps
            # The review extends the member's own prompt and answer with the others' answers.
            others = answers - first.output_tokens
            grown = first.prompt_tokens + first.output_tokens + others
            assert review.prompt_tokens == grown + synthetic.REVIEW_TOKENS
            assert review.at_s is not None
            assert review.at_s > 0
        assert len(chairman.steps) == 1
        assert chairman.arrival_s > members[0].arrival_s
        assert chairman.steps[0].prompt_tokens > max(m.steps[1].prompt_tokens for m in members)


def test_one_shot_calls_are_programs_of_one_call_that_name_no_program() -> None:
    workload = load_workload("oneshot", seed=0)
    ids = [p.program_id for p in workload.programs]
    assert len(ids) == synthetic.ONESHOT_CALLS == len(set(ids))
    assert all(i.startswith("auto-") for i in ids)
    assert all(len(p.steps) == 1 for p in workload.programs)
    arrivals = [p.arrival_s for p in workload.programs]
    assert arrivals == sorted(arrivals)
    # Poisson at 1 a second: 400 calls in about 400 s.
    assert 300 < arrivals[-1] < 500


def test_the_same_seed_makes_the_same_workload_and_another_seed_another() -> None:
    assert load_workload("council", seed=1) == load_workload("council", seed=1)
    assert load_workload("council", seed=1) != load_workload("council", seed=2)
    assert load_workload("oneshot", seed=1) != load_workload("oneshot", seed=2)
