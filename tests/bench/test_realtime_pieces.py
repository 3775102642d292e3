"""The pure parts of real-time runs: child command lines, proxy run lookup (the /proc parsing
is tests/bench/test_machine.py's)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from thunderproxy.audit.writer import open_database
from thunderproxy.bench.config import BenchConfig
from thunderproxy.bench.runs.realtime import (
    proxy_run_figures,
    serve_argv,
    sim_argv,
)
from thunderproxy.sim import SimConfig


def test_simulator_flags_name_only_what_differs_from_the_defaults() -> None:
    argv = sim_argv(
        SimConfig(kv_capacity_tokens=1_000, enable_prompt_tokens_details=True, time_scale=0.1),
        port=0,
    )
    assert argv[argv.index("--kv-capacity-tokens") + 1] == "1000"
    assert "--enable-prompt-tokens-details" in argv
    assert argv[argv.index("--time-scale") + 1] == "0.1"
    assert "--profile" not in argv


def test_proxy_flags_carry_the_scaled_settings() -> None:
    settings = BenchConfig().settings(
        "tr", scale=0.1, host="127.0.0.1", port=0, db="x.db", backends="http://127.0.0.1:1"
    )
    argv = serve_argv(settings)
    assert argv[argv.index("--router") + 1] == "tr"
    assert argv[argv.index("--pause-cooldown") + 1] == "0.5"
    assert argv[argv.index("--port") + 1] == "0"
    assert "--no-restore" in argv


def test_the_bench_proxy_run_is_found_after_the_runs_before_it(tmp_path: Path) -> None:
    db = str(tmp_path / "a.db")
    conn = open_database(db)
    with conn:
        for router in ("tr", "default", "tr"):
            conn.execute(
                "INSERT INTO runs (started_at, version, router, backends, settings)"
                " VALUES (0, 'v', ?, '', '{}')",
                (router,),
            )
        conn.execute(
            "INSERT INTO steps (run_id, request_id, program_id, step, endpoint, stream,"
            " arrived_at, finished_at, queue_s, total_s, status)"
            " VALUES (3, 'p-1', 'p', 1, '/v1/chat/completions', 1, 0, 1, 2.5, 1, 200)"
        )
    conn.close()
    assert proxy_run_figures(db, 1, "tr") == (3, 2.5, 0)
    assert proxy_run_figures(db, 3, "tr") == (None, None, None)
    assert sqlite3.connect(db).execute("select count(*) from bench_runs").fetchone() == (0,)
