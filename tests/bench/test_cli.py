"""`thunderproxy bench` from the command line, in virtual time: JSON, db rows, sweeps, replays."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.bench.synthetic import write_thunderagent
from tests.explore.conftest import run_canned
from thunderproxy.cli import cli

STABLE_KEYS = (
    "steps_per_min",
    "programs_completed",
    "prefix_hit_rate",
    "recomputed_prefill_tokens",
    "preemptions",
    "step_latency_p50_s",
    "step_latency_p99_s",
    "program_time_p50_s",
    "program_time_p99_s",
    "pause_time_total_s",
    "errors",
)


def bench(tmp_path: Path, *args: str) -> tuple[int, str]:
    trace = write_thunderagent(tmp_path / "calls.jsonl", programs=3, steps=3)
    argv = ["bench", "--virtual", "--trace", str(trace), "--kv-tokens", "6000",
            "--concurrency", "2", "--no-progress", "--db", str(tmp_path / "b.db"),
            *args]  # fmt: skip
    result = CliRunner().invoke(cli, argv, catch_exceptions=False)
    return result.exit_code, result.output


def rows(db: Path, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def test_one_target_prints_a_table_and_writes_json_and_db_rows(tmp_path: Path) -> None:
    code, output = bench(tmp_path, "--target", "tr", "--json", str(tmp_path / "out.json"))
    assert code == 0, output
    assert "steps_per_min" in output
    assert "imputed" in output
    doc = json.loads((tmp_path / "out.json").read_text())
    for key in STABLE_KEYS:
        assert key in doc, key  # a single result is also at the top level
    assert doc["results"][0]["target"] == "tr"
    assert doc["programs_completed"] == 3
    db = tmp_path / "b.db"
    assert rows(db, "select clock, workload from bench_runs") == [("virtual", "thunderagent")]
    ((target, run_id, steps),) = rows(
        db, "select target, proxy_run_id, steps_completed from bench_results"
    )
    assert (target, steps) == ("tr", 9)
    ((mean,),) = rows(db, "select program_time_mean_s from bench_results")
    assert mean == pytest.approx(doc["program_time_mean_s"])
    assert rows(db, "select count(*) from bench_steps") == [(9,)]
    # The virtual scheduler's audit rows are an ordinary run, readable like a real one.
    assert rows(db, f"select router, backends from runs where id = {run_id}") == [("tr", "virtual")]
    # Its times are simulated seconds, and the row says so (Datasette shows them as stored).
    assert rows(db, f"select clock, time_scale from runs where id = {run_id}") == [
        ("simulated", None)
    ]
    assert rows(db, f"select count(*) from steps where run_id = {run_id}") == [(9,)]


def test_several_targets_side_by_side_then_a_replay_of_the_audit_db(tmp_path: Path) -> None:
    code, output = bench(tmp_path, "--target", "direct,tr", "--json", str(tmp_path / "a.json"))
    assert code == 0, output
    header = next(line for line in output.splitlines() if line.startswith("figure"))
    assert header.split() == ["figure", "direct", "tr"]
    doc = json.loads((tmp_path / "a.json").read_text())
    assert "steps_per_min" not in doc
    assert len(doc["results"]) == 2
    # Replay what the tr run recorded, under the default router this time.
    db = tmp_path / "b.db"
    argv = ["bench", "--virtual", "--trace", str(db), "--target", "default", "--concurrency",
            "2", "--kv-tokens", "6000", "--no-progress", "--db", ""]  # fmt: skip
    replay = CliRunner().invoke(cli, argv, catch_exceptions=False)
    assert replay.exit_code == 0, replay.output
    assert "audit db replay: 3 programs" in replay.output


@pytest.mark.slow  # importing matplotlib alone takes seconds
def test_a_sweep_draws_its_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    code, output = bench(tmp_path, "--target", "direct,tr", "--sweep", "1,2", "--plot", str(png))
    assert code == 0, output
    assert "direct@1" in output
    assert "tr@2" in output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_without_matplotlib_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    code, output = bench(tmp_path, "--sweep", "1,2")
    assert code == 1
    assert "pip install 'thunderproxy[plot]'" in output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(("--target", "nginx"), "is not one of", id="target"),
        pytest.param(("--trace", "nope.jsonl"), "not found", id="trace"),
        pytest.param(("--set", "pause_cooldown"), "NAME=VALUE", id="set"),
        pytest.param(("--carry-answer", "2"), "[0, 1]", id="carry-answer"),
    ],
)
def test_mistakes_are_reported_before_anything_runs(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    code, output = bench(tmp_path, *args)
    assert code != 0
    assert message in output


def test_sweep_series_are_per_target_and_sorted_by_concurrency() -> None:
    from thunderproxy.bench.report.plot import series

    results = [
        {"target": "tr", "concurrency": 32, "steps_per_min": 2.0},
        {"target": "tr", "concurrency": 16, "steps_per_min": 1.0},
        {"target": "default", "concurrency": 16, "steps_per_min": None},
    ]
    assert series(results, "steps_per_min") == {"tr": [(16, 1.0), (32, 2.0)]}


def test_the_explorer_puts_a_bench_runs_targets_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    code, output = bench(tmp_path, "--target", "default,tr,oracle", "--json", str(out))
    assert code == 0, output
    measured = {r["target"]: r["steps_per_min"] for r in json.loads(out.read_text())["results"]}
    table = {row["target"]: row for row in run_canned(tmp_path / "b.db", "bench_compare")}
    assert list(table) == ["default", "tr", "oracle"]
    for target, spm in measured.items():
        assert table[target]["steps_per_min"] == round(spm, 1)
        assert table[target]["vs_default"] == round(spm / measured["default"], 2)
        assert table[target]["of_oracle"] == round(spm / measured["oracle"], 2)
    # An earlier run stays reachable by number once a later one exists.
    code, output = bench(tmp_path, "--target", "direct")
    assert code == 0, output
    assert [r["target"] for r in run_canned(tmp_path / "b.db", "bench_compare")] == ["direct"]
    earlier = run_canned(tmp_path / "b.db", "bench_compare", bench_run="1")
    assert [r["target"] for r in earlier] == ["default", "tr", "oracle"]
    assert earlier[0]["vs_default"] == 1.0


def test_workload_shape_flags_reach_the_prompts_and_no_release_leaves_programs_open(
    tmp_path: Path,
) -> None:
    code, output = bench(
        tmp_path, "--target", "tr", "--shared-prefix-tokens", "2500", "--carry-answer", "0.3",
        "--no-release", "--json", str(tmp_path / "out.json"),
    )  # fmt: skip
    assert code == 0, output
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["programs_completed"] == 3
    assert any(n.startswith("shared prefix: 2500 tokens") for n in doc["notes"])
    assert any("last 0.3 of each answer" in n for n in doc["notes"])
    assert doc["config"]["release"] is False
    db = tmp_path / "b.db"
    released = "select count(*) from transitions where reason = 'released by client'"
    assert rows(db, released) == [(0,)]
    # The same run with releases: every program is released by its agent.
    code, output = bench(tmp_path, "--target", "tr", "--shared-prefix-tokens", "2500")
    assert code == 0, output
    assert rows(db, released + " and run_id = (select max(run_id) from transitions)") == [(3,)]


def test_overhead_targets_are_the_routers_and_the_relays() -> None:
    from thunderproxy.bench.relay import overhead
    from thunderproxy.errors import ConfigError

    assert overhead.parse_targets("direct,tr,fastapi,litellm") == ("tr", "fastapi", "litellm")
    assert overhead.parse_targets("") == ("default",)
    with pytest.raises(ConfigError, match="fastapi, litellm"):
        overhead.parse_targets("default,oracle")
