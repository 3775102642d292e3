"""Figures from what the agents recorded and what the simulator says, pure."""

from __future__ import annotations

import pytest

from thunderproxy.bench.agents.agent import ProgramLog, RunLog, StepLog
from thunderproxy.bench.agents.transport import program_classes
from thunderproxy.bench.report import figures
from thunderproxy.bench.runs.harness import SUMMARY_KEYS


def step(program: str, n: int, sent: float, first: float, done: float, **kw: object) -> StepLog:
    values: dict[str, object] = {
        "program_id": program, "step": n, "attempt": 1, "sent_at": sent,
        "finished_at": done, "first_token_at": first, "prompt_tokens": 1000,
        "output_tokens": 10, "reusable_tokens": 0, "status": 200,
        "completion_tokens": 10, "cached_tokens": None,
    }  # fmt: skip
    values.update(kw)
    return StepLog(**values)  # type: ignore[arg-type]


def test_percentile_interpolates_like_numpy() -> None:
    assert figures.percentile([], 50) is None
    assert figures.percentile([3.0], 99) == 3.0
    assert figures.percentile([1, 2, 3, 4], 50) == 2.5
    assert figures.percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_figures_are_in_simulated_seconds_and_count_only_successes() -> None:
    # Recorded at time scale 0.5: every trio second is two simulated seconds.
    log = RunLog(time_scale=0.5, started_at=0.0, finished_at=30.0, exhausted_at=20.0)
    log.programs = [
        ProgramLog("a", arrived_at=0.0, started_at=0.0, finished_at=20.0, completed=True),
        ProgramLog("b", arrived_at=0.0, started_at=0.0, finished_at=30.0, completed=False),
    ]
    log.steps = [
        step("a", 1, 0.0, 1.0, 10.0),
        step("a", 2, 12.0, 12.5, 20.0, reusable_tokens=2000, cached_tokens=1000),
        step("b", 1, 0.0, 2.0, 30.0),
        step("b", 2, 30.0, None, 30.0, status=500, error="boom"),
    ]
    truth = {"prefix_queries": 4000, "prefix_hits": 1000, "preemptions": 3}
    f = figures.compute(log, truth, pause_time_s=5.0)
    assert f["duration_s"] == 60.0
    assert f["steps_per_min"] == pytest.approx(3.0)  # 3 successes in 60 simulated s
    assert f["steps_per_min_busy"] == pytest.approx(2 / (40 / 60))
    assert f["programs_completed"] == 1
    assert f["errors"] == 1
    assert f["prefix_hit_rate"] == 0.25
    assert f["prefill_tokens"] == 3000
    assert f["preemptions"] == 3
    assert f["evicted_prefix_tokens"] == 2000 - 1000 - 32
    assert f["program_time_p50_s"] == 40.0
    assert f["program_time_mean_s"] == 40.0  # only the completed program counts
    assert f["pause_time_total_s"] == 10.0
    assert f["ttft_p50_s"] == 2.0  # 1, 1 and 4 simulated seconds
    assert f["output_tokens_per_s"] == pytest.approx(30 / 60)


def test_lost_history_is_not_counted_where_no_call_had_history_to_reuse() -> None:
    # Block prompts (Mooncake) say themselves what they share: nothing is "own history".
    log = RunLog(time_scale=1.0, started_at=0.0, finished_at=2.0, exhausted_at=2.0)
    log.programs = [
        ProgramLog("a", arrived_at=0.0, started_at=0.0, finished_at=2.0, completed=True)
    ]
    log.steps = [step("a", 1, 0.0, 0.5, 1.0, cached_tokens=0), step("a", 2, 1.0, 1.5, 2.0)]
    assert figures.compute(log, {}, pause_time_s=None)["evicted_prefix_tokens"] is None
    log.steps.append(step("a", 3, 2.0, 2.1, 2.2, reusable_tokens=1000, cached_tokens=1000))
    assert figures.compute(log, {}, pause_time_s=None)["evicted_prefix_tokens"] == 0


def test_truth_adds_up_backends_and_keeps_the_worst_lag() -> None:
    states = [
        {"counters": {"prefix_queries": 10, "preemptions": 1}, "clock": {"max_lag_seconds": 0.2}},
        {"counters": {"prefix_queries": 5, "evictions": 4}, "clock": {"max_lag_seconds": 0.1}},
    ]
    totals = figures.sum_truth(states)
    assert (totals["prefix_queries"], totals["preemptions"], totals["evictions"]) == (15, 1, 4)
    assert totals["max_lag_s"] == 0.2


def test_tables_show_every_result_side_by_side() -> None:
    results = [{"target": "tr", "steps_per_min": 12.34, "errors": 0}, {"target": "default"}]
    text = figures.table(results, keys=["steps_per_min", "errors"])
    assert text.splitlines()[0].split() == ["figure", "tr", "default"]
    assert "12.3" in text
    assert "-" in text
    md = figures.markdown(results, ["steps_per_min"])
    assert md.splitlines()[2] == "| `steps_per_min` | 12.3 | - |"


def test_mean_program_time_is_reported_beside_the_median() -> None:
    # Three programs of 10, 20 and 60 simulated seconds: the mean (30) is not the median (20).
    log = RunLog(time_scale=1.0, started_at=0.0, finished_at=60.0)
    log.programs = [
        ProgramLog(name, arrived_at=0.0, started_at=0.0, finished_at=end, completed=True)
        for name, end in (("a", 10.0), ("b", 20.0), ("c", 60.0))
    ]
    log.steps = [
        step(name, 1, 0.0, 1.0, end) for name, end in (("a", 10.0), ("b", 20.0), ("c", 60.0))
    ]
    f = figures.compute(log, {}, pause_time_s=None)
    assert f["program_time_mean_s"] == pytest.approx(30.0)
    assert f["program_time_p50_s"] == 20.0
    assert "program_time_mean_s" in SUMMARY_KEYS


def test_later_calls_ttft_and_waits_are_split_by_class_where_there_are_two() -> None:
    classes = program_classes(["a", "b", "c", "d"], 1)
    assert classes == {"a": "interactive", "b": "batch", "c": "batch", "d": "batch"}

    def step(program: str, n: int, ttft: float) -> StepLog:
        return StepLog(program, n, 1, 0.0, ttft + 1, ttft, 100, 10, 0, 200)

    log = RunLog(time_scale=1.0, started_at=0.0)
    log.steps = [step("a", 1, 50.0), step("a", 2, 2.0), step("b", 2, 40.0), step("c", 3, 30.0)]
    out = figures.compute(
        log,
        {},
        pause_time_s=0.0,
        classes=classes,
        class_waits={"interactive": [1.0, 3.0], "batch": [100.0]},
    )
    assert out["interactive_ttft_later_p99_s"] == 2.0  # its first call is not a later one
    assert out["batch_ttft_later_p99_s"] == pytest.approx(39.9)
    assert (out["interactive_wait_max_s"], out["batch_wait_max_s"]) == (3.0, 100.0)
    # All of one class: the whole run's figures say it.
    alone = figures.compute(log, {}, pause_time_s=0.0, classes=program_classes(["a", "b"], 0))
    assert alone["interactive_ttft_later_p99_s"] is None
    assert alone["batch_wait_max_s"] is None
