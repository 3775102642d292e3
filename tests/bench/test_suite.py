"""``thunderproxy bench --suite``: the cells, the verdict rule, the table, and the ``ci`` suite
end to end (virtual time: its figures are deterministic, but only its shape is checked here)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from thunderproxy.bench.config import BenchConfig, DemoConfig
from thunderproxy.bench.runs import suite
from thunderproxy.bench.runs.demo import demo_bench_config
from thunderproxy.bench.runs.harness import workload_for
from thunderproxy.cli import cli
from thunderproxy.errors import ConfigError


def figures(spm: float, p99: float, **more: float) -> dict[str, float]:
    return {"steps_per_min": spm, "program_time_p99_s": p99, "errors": 0, **more}


CELL = suite.Cell(
    "c", "a cell", BenchConfig(virtual=True), suite._arms(bound=True, baselines=("default", "x"))
)


def test_the_verdict_is_against_the_baseline_with_the_most_steps_per_min() -> None:
    results = {
        "default": figures(50.0, 300.0),
        "x": figures(40.0, 100.0),  # a shorter tail, but fewer steps/min: not the best
        "tr": figures(49.0, 306.0),
        "bound": figures(70.0, 200.0),
    }
    judged = suite.verdict(CELL, results)
    assert judged.baseline == "default"
    assert judged.steps_ratio == pytest.approx(0.98)
    assert judged.p99_ratio == pytest.approx(1.02)
    assert judged.passed  # both limits are inclusive
    assert judged.bound_ratio == pytest.approx(0.7)
    assert "PASS" in judged.line()
    assert "0.70x the free-reload bound" in judged.line()


@pytest.mark.parametrize(
    ("tr", "passed"),
    [
        (figures(48.9, 250.0), False),  # 0.978x the steps/min
        (figures(60.0, 306.5), False),  # p99 program time 1.022x
        (figures(60.0, 250.0), True),
        (figures(60.0, 250.0, errors=1), False),  # a failed call is never a pass
    ],
)
def test_the_verdict_needs_both_steps_per_min_and_the_tail(
    tr: dict[str, float], passed: bool
) -> None:
    results = {"default": figures(50.0, 300.0), "x": figures(1.0, 1.0), "tr": tr}
    results["bound"] = figures(70.0, 200.0)
    assert suite.verdict(CELL, results).passed is passed


def test_the_full_suite_has_every_cell_the_scheduling_work_is_judged_by() -> None:
    cells = {cell.name: cell for cell in suite.full_cells()}
    for agents in (8, 16, 32, 64):
        assert cells[f"swe-{agents}"].config.concurrency == agents
        assert cells[f"swe-{agents}"].config.kv_tokens == 432_000
    assert {c.config.seed for n, c in cells.items() if n.startswith("short-")} == {0, 1, 2}
    assert cells["council"].config.trace == "council"
    assert cells["oneshot"].config.trace == "oneshot"
    assert not cells["oneshot"].config.release
    assert {cells[n].config.kv_tokens for n in ("mooncake-216k", "mooncake-432k")} == {
        216_000,
        432_000,
    }
    prefix = cells["prefix13k"].config
    assert (prefix.shared_prefix_tokens, prefix.carry_answer, prefix.release) == (
        13_000,
        0.3,
        False,
    )
    for agents in (32, 64):
        for ratio in (1, 4):
            cell = cells[f"cpu{ratio}x-{agents}"]
            assert cell.config.offload_tokens == ratio * 432_000
            roles = {a.label: a.role for a in cell.arms}
            assert roles == {"offload": suite.BASELINE, "tr+offload": suite.CANDIDATE}
    assert {cells[n].load for n in ("poisson-1.5x", "poisson-2x")} == {1.5, 2.0}
    # The bound where pausing has headroom, and the demo's own workload.
    assert any(a.role == suite.BOUND for a in cells["swe-32"].arms)
    demo = demo_bench_config(DemoConfig())
    assert cells["demo"].config.kv_tokens == demo.kv_tokens
    assert cells["demo"].config.programs == demo.programs


def test_each_arm_prints_the_bench_command_that_measures_it_alone() -> None:
    cell = next(c for c in suite.full_cells() if c.name == "swe-32")
    bound = next(a for a in cell.arms if a.role == suite.BOUND)
    command = cell.command(bound)
    assert command.startswith("thunderproxy bench --virtual --target offload ")
    parts = (
        "--concurrency 32",
        "--kv-tokens 432000",
        "--offload-tokens 50000000",
        "--sim kv_offload_bandwidth_gbps=1000000",
        "--sim kv_offload_latency_us=0",
    )
    for part in parts:
        assert part in command


def test_open_loop_arrivals_scale_with_the_load_asked_for() -> None:
    config = BenchConfig(virtual=True, programs=8, kv_tokens=100_000)
    workload = workload_for(config)
    once = suite.poisson_rate(workload, config, 1.0)
    assert suite.poisson_rate(workload, config, 2.0) == pytest.approx(2 * once, rel=1e-3)
    # Twice the cache holds twice the programs: twice the arrivals for the same load.
    bigger = dataclasses.replace(config, kv_tokens=200_000)
    assert suite.poisson_rate(workload, bigger, 1.0) == pytest.approx(2 * once, rel=1e-3)


def test_an_unknown_suite_or_cell_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="full, ci"):
        suite.cells_of("nightly")
    with pytest.raises(ConfigError, match="ci-short, ci-cpu, ci-council"):
        suite.cells_of("ci", ("ci-short", "ci-long"))
    assert [c.name for c in suite.cells_of("ci", ("ci-council", "ci-short"))] == [
        "ci-short",
        "ci-council",
    ]


def test_the_ci_suite_prints_every_target_and_a_verdict_per_cell(tmp_path: Path) -> None:
    out = tmp_path / "suite.json"
    result = CliRunner().invoke(
        cli, ["bench", "--suite", "ci", "--json", str(out)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    cells = suite.ci_cells()
    assert [c["name"] for c in doc["cells"]] == [c.name for c in cells]
    lines = result.output.splitlines()
    header = next(n for n, line in enumerate(lines) if line.startswith("cell "))
    for column in ("steps/min", "mean program (s)", "p99 program (s)", "later TTFT p99 (s)",
                   "longest wait (s)", "verdict"):  # fmt: skip
        assert column in lines[header]
    rows = [line.split() for line in lines[header + 2 :] if line.strip()][
        : sum(len(c.arms) for c in cells)
    ]
    assert [(r[0], r[1]) for r in rows] == [(c.name, a.label) for c in cells for a in c.arms]
    for cell, entry in zip(cells, doc["cells"], strict=True):
        judged = entry["verdict"]
        results = entry["results"]
        assert set(results) == {a.label for a in cell.arms}
        # The verdict is computed from the figures, not taken from anywhere else.
        best = judged["baseline"]
        assert judged["steps_ratio"] == pytest.approx(
            results[judged["candidate"]]["steps_per_min"] / results[best]["steps_per_min"]
        )
        assert judged["passed"] == (
            judged["steps_ratio"] >= suite.MIN_STEPS_RATIO
            and judged["p99_ratio"] <= suite.MAX_P99_RATIO
            and not results[judged["candidate"]]["errors"]
        )
        verdict_word = "PASS" if judged["passed"] else "FAIL"
        assert any(line.startswith(cell.name) and verdict_word in line for line in lines[header:])
        assert all(r["program_time_mean_s"] > 0 for r in results.values())
    assert "cells pass" in result.output


MIXED = suite.Cell("m", "mixed", BenchConfig(virtual=True, interactive=4), suite._arms())


@pytest.mark.parametrize(
    ("ttft", "held", "passed"),
    [
        (12.0, 3.0, True),  # 1.2x the baseline's, held exactly the bound: both inclusive
        (12.1, 1.0, False),  # interactive later calls' TTFT p99 1.21x
        (5.0, 3.01, False),  # an interactive call held past its bound
        (5.0, None, False),  # a hold nobody measured is no promise kept
    ],
)
def test_where_programs_are_interactive_the_verdict_asks_for_their_tail_and_bound(
    ttft: float, held: float | None, passed: bool
) -> None:
    more = {"interactive_ttft_later_p99_s": ttft}
    if held is not None:
        more["interactive_wait_max_s"] = held
    results = {
        "default": figures(50.0, 300.0, interactive_ttft_later_p99_s=10.0),
        "tr": figures(60.0, 250.0, **more),
    }
    judged = suite.verdict(MIXED, results)
    assert judged.passed is passed
    assert judged.interactive_bound_s == 3.0
    assert "interactive:" in judged.line()
    # A cell without interactive programs is judged as before, whatever the figures say.
    plain = suite.Cell("c", "c", BenchConfig(virtual=True), suite._arms())
    assert suite.verdict(plain, results).interactive_bound_s is None


def test_the_mixed_cell_has_4_interactive_programs_among_32_and_rows_per_class() -> None:
    cell = next(c for c in suite.full_cells() if c.name == "mixed")
    config = cell.config
    assert (config.interactive, config.programs, config.concurrency, config.kv_tokens) == (
        4,
        32,
        32,
        432_000,
    )
    classes = config.program_classes(workload_for(config))
    assert sorted(classes.values()).count("interactive") == 4
    assert len(classes) == 32
    assert "--interactive 4" in cell.command(cell.arms[0])
    result = suite.CellResult(cell, {"default": figures(26.0, 3000.0), "tr": figures(33.0, 2400.0)})
    labels = [row[1] for row in suite.rows([result])[1:]]
    assert labels == [
        "default",
        "default, interactive",
        "default, batch",
        "tr",
        "tr, interactive",
        "tr, batch",
    ]
