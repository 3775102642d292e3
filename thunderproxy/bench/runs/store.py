"""Bench results into the SQLite db (tables of ``migrations/004_bench.sql``).

Written after a target has run, never during: virtual runs have no SQLite under the mock clock,
and real runs leave the db to the proxy's own writer while it runs. Virtual runs of a
thunderproxy target also store their audit records as an ordinary ``runs`` row with its
transitions, steps, decisions and backend samples, so Datasette shows them like real runs.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Sequence
from typing import Any

from ... import __version__
from ...audit.records import AuditRecord
from ...audit.writer import open_database
from ..workloads.workload import Workload
from .virtual import TargetResult

RESULT_COLUMNS = (
    "steps_per_min",
    "steps_per_min_busy",
    "programs_completed",
    "programs_total",
    "steps_completed",
    "output_tokens_per_s",
    "prefix_hit_rate",
    "prefill_tokens",
    "evicted_prefix_tokens",
    "recomputed_prefill_tokens",
    "preemptions",
    "evictions",
    "step_latency_p50_s",
    "step_latency_p99_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "program_time_mean_s",
    "program_time_p50_s",
    "program_time_p99_s",
    "pause_time_total_s",
    "errors",
    "duration_s",
)


def start_bench_run(
    db: str,
    *,
    version: str = __version__,
    command: Sequence[str],
    trace: str,
    workload: Workload,
    clock: str,
    config: dict[str, Any],
) -> int:
    conn = open_database(db)
    try:
        with conn:
            cursor = conn.execute(
                "INSERT INTO bench_runs (started_at, version, command, trace, workload, clock,"
                " config, notes) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    time.time(),
                    version,
                    " ".join(command),
                    trace,
                    workload.name,
                    clock,
                    json.dumps(config, default=str, sort_keys=True),
                    json.dumps(list(workload.notes)),
                ),
            )
        assert cursor.lastrowid is not None
        return cursor.lastrowid
    finally:
        conn.close()


def finish_bench_run(db: str, bench_run_id: int) -> None:
    conn = open_database(db)
    try:
        with conn:
            conn.execute(
                "UPDATE bench_runs SET finished_at = ? WHERE id = ?", (time.time(), bench_run_id)
            )
    finally:
        conn.close()


def _insert_audit_run(
    conn: sqlite3.Connection, result: TargetResult, records: Iterable[AuditRecord]
) -> int:
    """A virtual run's audit records as a ``runs`` row of their own; times become Unix seconds
    counted from when the result is stored (virtual second 0 = now)."""
    origin = time.time() - (result.log.finished_at - result.log.started_at)
    settings = {**result.proxy_settings, "virtual": True}
    cursor = conn.execute(
        "INSERT INTO runs (started_at, stopped_at, version, router, backends, settings, clock)"
        " VALUES (?, ?, ?, ?, ?, ?, 'simulated')",
        (
            origin,
            origin + result.log.finished_at,
            __version__,
            str(settings.get("router", result.target)),
            "virtual",
            json.dumps(settings, default=str, sort_keys=True),
        ),
    )
    run_id = cursor.lastrowid
    assert run_id is not None
    statements: dict[tuple[str, tuple[str, ...]], list[tuple[Any, ...]]] = {}
    for record in records:
        row = record.row(lambda t: origin + t)
        row["run_id"] = run_id
        statements.setdefault((record.table, tuple(row)), []).append(tuple(row.values()))
    for (table, columns), values in statements.items():
        conn.executemany(
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
            values,
        )
    return run_id


def mark_clock(db: str, run_id: int, *, time_scale: float) -> None:
    """Record on a real-time run's ``runs`` row that its backends were simulated at
    ``time_scale`` wall seconds per simulated second (migration 014): its times in the db are
    wall seconds, the bench's and the demo's printed figures simulated ones."""
    conn = open_database(db)
    try:
        with conn:
            conn.execute(
                "UPDATE runs SET clock = 'wall', time_scale = ? WHERE id = ?", (time_scale, run_id)
            )
    finally:
        conn.close()


def save_result(db: str, bench_run_id: int, result: TargetResult) -> int:
    """One target's figures and client-side calls (and, for virtual thunderproxy runs, its
    audit records); returns the ``bench_results`` id."""
    conn = open_database(db)
    try:
        with conn:
            if result.audit_records:
                result.proxy_run_id = _insert_audit_run(conn, result, result.audit_records)
            summary = result.summary()
            columns = ["bench_run_id", "target", "concurrency", "kv_tokens", "proxy_run_id"]
            values: list[Any] = [
                bench_run_id,
                result.target,
                result.concurrency,
                result.kv_tokens,
                result.proxy_run_id,
            ]
            for key in (*RESULT_COLUMNS, "proxy_cpu_s", "wall_s"):
                columns.append(key)
                values.append(summary.get(key))
            columns.append("figures")
            values.append(json.dumps(summary, default=str, sort_keys=True))
            cursor = conn.execute(
                f"INSERT INTO bench_results ({', '.join(columns)}) "
                f"VALUES ({', '.join('?' * len(columns))})",
                values,
            )
            result_id = cursor.lastrowid
            assert result_id is not None
            log = result.log
            scale = log.time_scale
            t0 = log.started_at

            def sim(t: float | None) -> float | None:
                return None if t is None else (t - t0) / scale

            conn.executemany(
                "INSERT INTO bench_steps (bench_result_id, program_id, step, attempt, sent_s,"
                " first_token_s, finished_s, prompt_tokens, output_tokens, reusable_tokens,"
                " cached_tokens, status, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        result_id,
                        s.program_id,
                        s.step,
                        s.attempt,
                        sim(s.sent_at),
                        sim(s.first_token_at),
                        sim(s.finished_at),
                        s.prompt_tokens,
                        s.output_tokens,
                        s.reusable_tokens,
                        s.cached_tokens,
                        s.status,
                        s.error,
                    )
                    for s in log.steps
                ],
            )
        return result_id
    finally:
        conn.close()
