"""Every canned query and view, run on the db of a real end-to-end run (``scenario.py``), must
give the answers the scripted traffic implies, not merely execute."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.explore import scenario
from tests.explore.conftest import raw, run_canned
from tests.explore.scenario import History
from thunderproxy.explore.instance import canned_queries, load_metadata
from thunderproxy.explore.links import bucket_for, dashboard_url


def utc(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def by(rows: list[dict[str, Any]], key: str) -> dict[Any, dict[str, Any]]:
    return {row[key]: row for row in rows}


def test_every_query_is_documented_and_declares_exactly_its_parameters() -> None:
    queries = canned_queries()
    assert len(queries) >= 10
    for name, query in queries.items():
        assert query["title"], name
        assert query["description_html"], name
        used = set(re.findall(r":([a-z_]+)", query["sql"]))
        assert used == set(query["params"]), name


#: Created by the migrations: the explorer's metadata must describe each of them.
CORE = {
    "runs", "transitions", "steps", "backend_samples", "decisions", "schema_migrations",
    "program_states", "step_timings", "program_summary", "backend_timeline", "rejections",
    "bench_runs", "bench_results", "bench_steps", "worker_events", "worker_seen",
}  # fmt: skip


def test_every_table_view_and_column_is_described(history: History) -> None:
    tables = load_metadata()["databases"]["audit"]["tables"]
    assert set(tables) >= CORE
    for name, meta in tables.items():
        assert meta["title"], name
        assert meta["description"], name
        columns = raw(history.db, f"select name from pragma_table_info('{name}')")
        assert set(meta["columns"]) == {c["name"] for c in columns}, name
        for column in meta.get("facets", []) + [meta.get("sort_desc")]:
            assert column is None or column in meta["columns"], (name, column)


def test_throughput(history: History) -> None:
    rows = run_canned(history.db, "throughput")
    assert sum(r["steps"] for r in rows) == 11
    assert sum(r["ok_steps"] for r in rows) == 9
    assert sum(r["failed_steps"] for r in rows) == 1
    assert sum(r["client_gone_steps"] for r in rows) == 1
    tokens = raw(history.db, "select sum(completion_tokens) as n from steps where status < 400")
    # 5 words for each ok call but beta's (alpha 3, gamma 2, delta 1, epsilon 1)
    expected = 7 * 5 + 2 * scenario.BETA_WORDS
    assert sum(r["completion_tokens"] for r in rows) == tokens[0]["n"] == expected
    # alpha's pause and epsilon's queueing (it is created paused)
    assert sum(r["pauses"] for r in rows) == 2
    size = default_bucket(history.db)
    assert size < 60  # the run lasts seconds: one 60 s bucket would hide its shape
    assert {b - a for a, b in zip(starts_of(rows), starts_of(rows)[1:], strict=False)} == {size}
    for row in rows:
        assert row["tokens_per_s"] == round(row["completion_tokens"] / size, 3)

    per_second = run_canned(history.db, "throughput", bucket="1")
    starts = [r["bucket_start"] for r in per_second]
    assert starts == [starts[0] + i for i in range(len(starts))], "no bucket is skipped"
    assert sum(r["steps"] for r in per_second) == 11

    after_gap = run_canned(history.db, "throughput", since=str(history.gap_at), bucket="3600")
    assert [(r["steps"], r["programs"]) for r in after_gap] == [(1, 1)]
    assert after_gap[0]["max_queue_s"] >= scenario.MAX_WAIT_S * 0.9
    before_gap = run_canned(history.db, "throughput", until=utc(history.gap_at), bucket="3600")
    assert sum(r["steps"] for r in before_gap) == 10
    assert sum(r["steps"] for r in run_canned(history.db, "throughput", since="-1 hour")) == 11
    assert run_canned(history.db, "throughput", since="+1 hour") == []


def starts_of(rows: list[dict[str, Any]]) -> list[float]:
    return [r["bucket_start"] for r in rows]


def default_bucket(db: Path) -> int:
    """The bucket the time series choose when given none: links.bucket_for over the span of
    the latest run's data, as the link the demo prints states it."""
    run = raw(db, "select * from runs order by id desc limit 1")[0]
    times = raw(
        db,
        "select min(t) as lo, max(t) as hi from (select finished_at as t from steps "
        "where finished_at >= ? union all select at from backend_samples where at >= ?)",
        run["started_at"],
        run["started_at"],
    )[0]
    poll_s = json.loads(run["settings"])["metrics_interval"]
    return bucket_for(times["hi"] - times["lo"], poll_s)


def test_time_series_default_to_the_latest_run_in_a_fitting_bucket(
    history: History, history_copy: Path
) -> None:
    # A later run with one step, far from the first: blank times now mean that run alone.
    conn = sqlite3.connect(history_copy)
    later = raw(history_copy, "select max(finished_at) as t from steps")[0]["t"] + 86400
    conn.execute(
        "insert into runs (started_at, stopped_at, version, router, backends, settings) "
        "values (?, ?, 'x', 'tr', '', ?)",
        (later - 20, later + 20, json.dumps({"metrics_interval": 1.0, "backend_specs": []})),
    )
    conn.execute(
        "insert into steps (run_id, request_id, program_id, step, backend, endpoint, model, "
        "stream, arrived_at, sent_at, finished_at, queue_s, total_s, completion_tokens, "
        "status) select max(id), 'r', 'later', 1, 'http://x', '/v1/chat/completions', 'm', 0, "
        "?, ?, ?, 0, 1, 7, 200 from runs",
        (later - 1, later - 1, later),
    )
    conn.commit()
    conn.close()
    latest = run_canned(history_copy, "throughput")
    assert [(r["steps"], r["completion_tokens"]) for r in latest] == [(1, 7)]
    # Bucket: the smallest that fits the data in 30 rows, and no shorter than a poll.
    assert latest[0]["tokens_per_s"] == round(7 / bucket_for(0, 1.0), 3)
    first = run_canned(history_copy, "throughput", run_id="1")
    assert sum(r["steps"] for r in first) == 11
    assert {r["bucket_start"] % default_bucket(history.db) for r in first} == {0}
    everything = run_canned(history_copy, "throughput", since="0", bucket="86400")
    assert sum(r["steps"] for r in everything) == 12


def test_buckets_fit_spans() -> None:
    assert bucket_for(35) == 2  # the demo: 18 points, not one 60 s bucket
    assert bucket_for(35, poll_s=3) == 5
    assert bucket_for(30) == 1
    assert bucket_for(3600) == 120
    assert bucket_for(10**9) == 86400


def test_the_dashboard_link_states_the_run_window_and_bucket() -> None:
    url = dashboard_url("http://127.0.0.1:8300", 7, 1000.0, 1035.0, poll_s=0.5)
    assert url == (
        "http://127.0.0.1:8300/datasette/-/dashboards/scheduling"
        "?run_id=7&since=1000.000&until=1035.001&bucket=2"
    )
    assert dashboard_url("http://h/datasette/", 7, 1000.0, 1035.0).startswith(
        "http://h/datasette/-/dashboards/scheduling?"
    )
    running = dashboard_url("http://h", 8, 1000.0, None)
    assert running.endswith("?run_id=8&since=1000.000&until=&bucket=")


def test_waited_longest(history: History) -> None:
    rows = run_canned(history.db, "waited_longest")
    assert rows[0]["program_id"] == "epsilon"
    assert [r["program_id"] for r in rows[1:]] != []
    programs = by(rows, "program_id")
    assert set(programs) == set(scenario.PROGRAMS)
    epsilon, alpha, beta = programs["epsilon"], programs["alpha"], programs["beta"]
    assert epsilon["waited_s"] >= scenario.MAX_WAIT_S * 0.9
    assert epsilon["why"] == "queue:capacity_full x1"
    assert epsilon["last_decision"] == "queue:capacity_full"
    assert alpha["pauses"] == 1
    assert alpha["paused_s"] == pytest.approx(scenario.PAUSE_S, abs=1e-4)
    assert alpha["why"] == "pause:over_capacity x1"
    assert alpha["kv_used_pct_at_decision"] == round(100 * scenario.PAUSE_USED / 16000, 1)
    assert (beta["why"], beta["pauses"], beta["paused_s"]) == (None, 0, 0)
    waits = raw(history.db, "select program_id, sum(queue_s) as s from steps group by 1")
    for wait in waits:
        assert programs[wait["program_id"]]["waited_s"] == round(wait["s"], 4)
    assert [
        r["program_id"] for r in run_canned(history.db, "waited_longest", since=str(history.gap_at))
    ] == ["epsilon"]


def test_program_timeline(history: History) -> None:
    rows = run_canned(history.db, "program_timeline", program_id="alpha")
    states = [r["what"] for r in rows if r["kind"] == "state"]
    assert states == [
        "reasoning", "acting", "paused", "acting", "reasoning", "acting", "reasoning", "acting",
        "stopped",
    ]  # fmt: skip
    assert [r["what"] for r in rows if r["kind"] == "decision"] == ["admit", "pause", "resume"]
    paused = next(r for r in rows if r["what"] == "paused")
    assert paused["duration_s"] == pytest.approx(scenario.PAUSE_S, abs=1e-4)
    assert (paused["why"], paused["ended_by_or_inputs"]) == (
        "paused: over_capacity",
        "resumed: fits",
    )
    pause = next(r for r in rows if r["what"] == "pause")
    assert pause["ended_by_or_inputs"].startswith("used 15800/16000 tokens; program 1200 tokens")
    assert rows[0]["t_s"] == 0
    assert [r["t_s"] for r in rows] == sorted(r["t_s"] for r in rows)
    shown = datetime.strptime(paused["at_utc"], "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC)
    assert shown.timestamp() == pytest.approx(history.paused_at, abs=2e-3)

    epsilon = run_canned(history.db, "program_timeline", program_id="epsilon")
    assert (epsilon[0]["what"], epsilon[0]["why"]) == ("paused", "queued: capacity_full")
    assert [r["what"] for r in epsilon if r["kind"] == "decision"] == ["queue", "force_resume"]

    since_resume = run_canned(
        history.db, "program_timeline", program_id="alpha", since=str(history.resumed_at - 1e-3)
    )
    assert since_resume[0]["what"] in ("acting", "resume")
    assert since_resume[0]["t_s"] == 0
    assert run_canned(history.db, "program_timeline", program_id="nobody") == []


def test_decision_log(history: History) -> None:
    rows = run_canned(history.db, "decision_log")
    assert len(rows) == raw(history.db, "select count(*) as n from decisions")[0]["n"] == 8
    assert [r["at_utc"] for r in rows] == sorted((r["at_utc"] for r in rows), reverse=True)
    assert {r["program_id"] for r in rows if r["action"] == "admit"} == set(scenario.PROGRAMS[:4])
    (pause,) = run_canned(history.db, "decision_log", action="pause")
    assert (pause["program_id"], pause["rule"], pause["used_pct"]) == (
        "alpha",
        "over_capacity",
        98.8,
    )
    epsilon = run_canned(history.db, "decision_log", program_id="epsilon")
    assert [r["action"] for r in epsilon] == ["force_resume", "queue"]
    assert epsilon[0]["waited_s"] >= scenario.MAX_WAIT_S * 0.9
    assert run_canned(history.db, "decision_log", program_id="alpha", action="queue") == []
    # Figures the rule had no value for (-1 in the row's JSON) are shown as null.
    raw_details = [
        json.loads(r["detail"])
        for r in raw(history.db, "select detail from decisions")
        if r["detail"]
    ]
    shown = [json.loads(r["detail"]) for r in rows if r["detail"]]
    assert len(shown) == len(raw_details)
    for detail in shown:
        assert -1 not in detail.values()
    placeholders = sum(v == -1 for d in raw_details for v in d.values())
    assert sum(v is None for d in shown for v in d.values()) >= placeholders


def test_latency_breakdown(history: History) -> None:
    rows = by(run_canned(history.db, "latency_breakdown"), "program_id")
    counts = {name: row["steps"] for name, row in rows.items()}
    # failed calls (gamma's 500, delta's 499) are not latencies
    assert counts == {"alpha": 3, "beta": 2, "gamma": 2, "delta": 1, "epsilon": 1}
    assert rows["epsilon"]["dominant"] == "queue"
    assert rows["beta"]["dominant"] == "decode"
    assert rows["alpha"]["dominant"] == "tool"
    for row in rows.values():
        shares = ("queue_pct", "prefill_pct", "decode_pct", "unsplit_pct", "tool_pct")
        assert sum(row[k] for k in shares) == pytest.approx(100, abs=0.3)
    steps = raw(history.db, "select * from steps where status < 400 and program_id = 'beta'")
    assert rows["beta"]["avg_decode_s"] == round(sum(s["decode_s"] for s in steps) / 2, 4)
    assert rows["beta"]["avg_tool_s"] == round(sum(s["tool_s"] or 0 for s in steps) / 2, 4)
    assert rows["beta"]["avg_unsplit_s"] == 0
    assert rows["beta"]["avg_decode_s"] >= (scenario.BETA_WORDS - 1) * scenario.BETA_DELAY_S
    alpha = raw(history.db, "select * from steps where program_id = 'alpha'")
    unsplit = sum(s["total_s"] - s["queue_s"] for s in alpha) / 3
    assert rows["alpha"]["avg_unsplit_s"] == round(unsplit, 4)
    only = run_canned(history.db, "latency_breakdown", program_id="beta", backend=history.backend)
    assert [r["program_id"] for r in only] == ["beta"]
    assert run_canned(history.db, "latency_breakdown", backend="http://elsewhere") == []


def test_program_steps(history: History) -> None:
    gamma = run_canned(history.db, "program_steps", program_id="gamma")
    assert [r["step"] for r in gamma] == [1, 2, 3]
    assert [r["outcome"] for r in gamma] == ["ok", "backend_error", "ok"]
    assert "fake failure" in gamma[1]["error"]
    assert [r["prompt_tokens"] for r in gamma] == [10, None, 30]
    assert [r["recomputed_tokens"] for r in gamma] == [2, None, 22]
    beta = run_canned(history.db, "program_steps", program_id="beta")
    assert all(r["prefill_s"] > 0 and r["decode_s"] > 0 and r["unsplit_s"] is None for r in beta)
    alpha = run_canned(history.db, "program_steps", program_id="alpha")
    # alpha's second call came after the pause: its tool time includes it
    assert alpha[1]["tool_s"] >= scenario.PAUSE_S + scenario.TOOL_S


def test_prefix_cache_by_program(history: History) -> None:
    rows = run_canned(history.db, "prefix_cache_by_program")
    assert [r["recomputed_tokens"] for r in rows] == sorted(
        (r["recomputed_tokens"] for r in rows), reverse=True
    )
    programs = by(rows, "program_id")
    alpha = programs["alpha"]
    # 1, 2 and 3 messages of 10 prompt tokens each; the fake backend caches 8 every time
    assert (alpha["prompt_tokens"], alpha["cached_tokens"], alpha["recomputed_tokens"]) == (
        60,
        24,
        36,
    )
    assert (alpha["hit_rate"], alpha["steps"], alpha["steps_without_usage"]) == (0.4, 3, 0)
    assert programs["gamma"]["steps_without_usage"] == 1
    assert programs["delta"]["steps_without_usage"] == 1
    assert all(r["backend"] == history.backend for r in rows)


def test_prefix_cache_over_time(history: History) -> None:
    rows = run_canned(history.db, "prefix_cache_over_time", bucket="3600")
    assert sum(r["prompt_tokens"] for r in rows) == 160
    assert sum(r["cached_tokens"] for r in rows) == 72
    assert sum(r["recomputed_tokens"] for r in rows) == 88
    # the fake backend exposes no prefix-cache counters
    assert all(r["backend_hit_rate"] is None for r in rows)
    alpha = run_canned(history.db, "prefix_cache_over_time", program_id="alpha", bucket="3600")
    assert sum(r["prompt_tokens"] for r in alpha) == 60
    assert sum(r["hit_rate"] * r["prompt_tokens"] for r in alpha) == pytest.approx(24)


def test_backend_usage(history: History) -> None:
    rows = run_canned(history.db, "backend_usage", bucket="3600")
    samples = raw(
        history.db, "select count(*) as n, max(programs) as programs from backend_samples"
    )[0]
    assert sum(r["polls"] for r in rows) == samples["n"] >= 3
    assert {r["backend"] for r in rows} == {history.backend}
    assert all(r["avg_kv_usage_pct"] == 25.0 and r["capacity_tokens"] == 16000 for r in rows)
    assert max(r["max_programs"] for r in rows) == samples["programs"]
    assert sum(r["failed_polls"] for r in rows) == 0
    assert run_canned(history.db, "backend_usage", backend="http://elsewhere") == []
    # Named by host: the fake backend's port is a random one.
    assert {r["backend_label"] for r in rows} == {"127.0.0.1"}
    # Peaks as reported: the largest poll of each bucket.
    peak = raw(history.db, "select max(kv_usage) * 100 as pct from backend_samples")[0]["pct"]
    assert max(r["max_kv_usage_pct"] for r in rows) == round(peak, 2)


def test_backend_usage_breaks_its_series_where_polls_stop(
    history: History, history_copy: Path
) -> None:
    # Half a minute without polls in the middle of the run (a proxy stopped, say).
    conn = sqlite3.connect(history_copy)
    conn.execute("update backend_samples set at = at + 30 where at > ?", (history.gap_at,))
    conn.execute("update runs set stopped_at = stopped_at + 30")
    conn.commit()
    conn.close()
    rows = run_canned(history_copy, "backend_usage", bucket="1")
    polled = [r["bucket_start"] for r in rows if r["polls"]]
    breaks = [r for r in rows if not r["polls"]]
    # One empty row, a bucket after the last poll before the gap: the chart's line breaks.
    assert [r["bucket_start"] for r in breaks] == [
        a + 1 for a, b in zip(polled, polled[1:], strict=False) if b - a > 1
    ]
    assert len(breaks) == 1
    assert breaks[0]["max_kv_usage_pct"] is None
    assert breaks[0]["backend_label"] == "127.0.0.1"


def test_failures(history: History) -> None:
    rows = run_canned(history.db, "failures")
    assert [(r["program_id"], r["step"]) for r in rows] == [("gamma", 2), ("delta", 1)]
    gamma, delta = rows
    assert (gamma["status"], gamma["outcome"], gamma["retried"]) == (500, "backend_error", 1)
    assert (delta["status"], delta["outcome"], delta["retried"]) == (499, "client_gone", 1)
    assert delta["error"] == "client closed the connection before the response ended"
    assert gamma["retry_outcome"] == delta["retry_outcome"] == "ok"
    assert gamma["retry_after_s"] >= 0
    assert delta["retry_after_s"] >= 0
    assert len(run_canned(history.db, "failures", program_id="delta")) == 1
    assert run_canned(history.db, "failures", since=str(history.gap_at)) == []


def test_refused(history: History) -> None:
    rows = run_canned(history.db, "refused")
    assert [(r["path"], r["status"], r["error_type"], r["program_id"]) for r in rows] == [
        ("/programs/release", 404, "not_found_error", "ghost"),
        ("/v1/chat/completions", 400, "invalid_request_error", None),
    ]
    assert "not valid JSON" in rows[1]["message"]
    assert run_canned(history.db, "refused", until=str(history.gap_at)) == []


def test_slowest_steps(history: History) -> None:
    arrived = raw(history.db, "select arrived_at from steps where program_id = 'epsilon'")
    day = utc(arrived[0]["arrived_at"])[:10]
    rows = run_canned(history.db, "slowest_steps", day=day)
    assert len(rows) == 11
    assert [r["total_s"] for r in rows] == sorted((r["total_s"] for r in rows), reverse=True)
    assert (rows[0]["program_id"], rows[0]["dominant"]) == ("epsilon", "queue")
    beta = [r for r in rows if r["program_id"] == "beta"]
    assert {r["dominant"] for r in beta} == {"decode"}
    if day == datetime.now(UTC).strftime("%Y-%m-%d"):
        assert run_canned(history.db, "slowest_steps") == rows
    assert run_canned(history.db, "slowest_steps", day="2000-01-01") == []


def test_program_summary_view(history: History) -> None:
    rows = by(raw(history.db, "select * from program_summary"), "program_id")
    assert set(rows) == set(scenario.PROGRAMS)
    alpha = rows["alpha"]
    assert (alpha["steps"], alpha["pauses"], alpha["last_status"]) == (3, 1, "stopped")
    assert alpha["paused_s"] == pytest.approx(scenario.PAUSE_S, abs=1e-4)
    assert (alpha["prompt_tokens"], alpha["recomputed_tokens"], alpha["cache_hit_rate"]) == (
        60,
        36,
        0.4,
    )
    assert (rows["gamma"]["failed_steps"], rows["gamma"]["client_gone_steps"]) == (1, 0)
    assert (rows["delta"]["failed_steps"], rows["delta"]["client_gone_steps"]) == (1, 1)
    assert rows["epsilon"]["max_queue_s"] >= scenario.MAX_WAIT_S * 0.9


def test_step_timings_and_backend_timeline_views(history: History) -> None:
    outcomes = raw(history.db, "select outcome, count(*) as n from step_timings group by 1")
    assert {r["outcome"]: r["n"] for r in outcomes} == {
        "ok": 9,
        "backend_error": 1,
        "client_gone": 1,
    }
    timeline = raw(history.db, "select * from backend_timeline order by at")
    assert all(r["kv_usage_pct"] == 25.0 for r in timeline)
    assert timeline[0]["prefix_hit_rate"] is None  # nothing to compare the first poll with


def test_views_answer_on_an_empty_db(tmp_path: Path) -> None:
    from thunderproxy.audit.writer import open_database

    db = tmp_path / "empty.db"
    open_database(str(db)).close()
    for name, query in canned_queries().items():
        params = {"program_id": "x"} if "program_id" in query["params"] else {}
        assert run_canned(db, name, **params) == [], name


def test_call_waits_are_split_into_admission_and_mid_program(history: History) -> None:
    summary = by(raw(history.db, "select * from wait_summary"), "wait_kind")
    steps = raw(history.db, "select step, queue_s from steps")
    for kind, first in (("admission", True), ("mid_program", False)):
        waits = [s["queue_s"] for s in steps if (s["step"] <= 1) == first]
        assert summary[kind]["calls"] == len(waits)
        assert summary[kind]["max_wait_s"] == round(max(waits), 3)
    # The scripted wait for capacity (epsilon's) is in the summary of its own kind.
    epsilon = raw(history.db, "select * from call_waits where program_id = 'epsilon'")
    longest = max(epsilon, key=lambda r: r["waited_s"])
    assert longest["waited_s"] >= scenario.MAX_WAIT_S * 0.9
    assert summary[longest["wait_kind"]]["max_wait_s"] >= longest["waited_s"] - 0.001


# --- one run per page ----------------------------------------------------------------------------

#: Columns holding times, shifted for the second run so that the two runs overlap as the demo's
#: replays do (both in simulated time, started seconds apart).
TIMES = ("at", "arrived_at", "sent_at", "first_token_at", "finished_at", "started_at", "stopped_at")
#: Tables with a row per run's event, copied into the second run.
PER_RUN = ("steps", "transitions", "backend_samples", "decisions")


def _copy_db(source: Path, target: Path) -> Path:
    for suffix in ("", "-wal"):
        if Path(str(source) + suffix).exists():
            shutil.copy(str(source) + suffix, str(target) + suffix)
    return target


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [row[1] for row in conn.execute(f"pragma table_info('{table}')") if row[1] != "id"]


def two_overlapping_runs(history: History, tmp_path: Path) -> Path:
    """The scenario's run 1, then a run 2 copied from it 5 s later (its programs renamed, no
    pause), then an idle run 3 that made no call: the demo's db after ``demo``."""
    db = _copy_db(history.db, tmp_path / "two.db")
    conn = sqlite3.connect(db)
    shift = 5.0

    def copy(table: str, where: str = "") -> None:
        columns = _columns(conn, table)
        values = []
        for column in columns:
            if column == "run_id":
                values.append("2")
            elif column == "program_id":
                values.append("'r2-' || program_id")
            elif column in TIMES:
                values.append(f"{column} + {shift}")
            else:
                values.append(column)
        conn.execute(
            f"insert into {table} ({', '.join(columns)}) select {', '.join(values)} "
            f"from {table} where run_id = 1 {where}"
        )

    runs = _columns(conn, "runs")
    shifted = [f"{c} + {shift}" if c in TIMES else c for c in runs]
    conn.execute(f"insert into runs ({', '.join(runs)}) select {', '.join(shifted)} from runs")
    for table in PER_RUN:
        copy(table, "and to_status != 'paused'" if table == "transitions" else "")
    last = conn.execute("select max(stopped_at) from runs").fetchone()[0]
    conn.execute(
        "insert into runs (started_at, stopped_at, version, router, backends, settings) "
        "values (?, null, 'x', 'tr', '', '{}')",
        (last + 60,),
    )
    conn.commit()
    conn.close()
    return db


def only_run(db: Path, run_id: int, target: Path) -> Path:
    """``db`` with every other run's rows deleted."""
    _copy_db(db, target)
    conn = sqlite3.connect(target)
    for table in PER_RUN:
        conn.execute(f"delete from {table} where run_id != ?", (run_id,))
    conn.execute("delete from runs where id != ?", (run_id,))
    conn.commit()
    conn.close()
    return target


def dashboard_charts() -> dict[str, str]:
    board = load_metadata()["plugins"]["datasette-dashboards"]["scheduling"]
    return {name: chart["query"] for name, chart in board["charts"].items()}


def run_sql(db: Path, sql: str, **params: str) -> list[dict[str, Any]]:
    """A chart's query as the dashboard runs it: every filter sent, blank unless given."""
    filters = ("since", "until", "bucket", "run_id", "program_id", "backend")
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        values = {name: params.get(name, "") for name in filters}
        return [dict(row) for row in conn.execute(sql, values)]
    finally:
        conn.close()


def test_each_query_and_chart_with_a_run_id_shows_that_run_alone(
    history: History, tmp_path: Path
) -> None:
    """Two runs whose times overlap: a query given run_id answers exactly what it answers on a
    db holding that run alone, window narrowed or not (failed before: the window was the
    run's, the rows anyone's)."""
    db = two_overlapping_runs(history, tmp_path)
    alone = {r: only_run(db, r, tmp_path / f"run{r}.db") for r in (1, 2)}
    with_run = {n: q for n, q in canned_queries().items() if "run_id" in q["params"]}
    assert {"throughput", "backend_usage", "prefix_cache_over_time", "latency_breakdown"} <= set(
        with_run
    )
    run1 = raw(db, "select started_at, stopped_at from runs where id = 1")[0]
    narrowed = {"since": str(run1["started_at"] + 2), "until": str(run1["stopped_at"] - 2)}
    for run_id in (1, 2):
        for params in ({}, narrowed):
            for name in with_run:
                mixed = run_canned(db, name, run_id=str(run_id), **params)
                assert mixed == run_canned(alone[run_id], name, run_id=str(run_id), **params), (
                    name,
                    run_id,
                    params,
                )
            for name, sql in dashboard_charts().items():
                shown = run_sql(db, sql, run_id=str(run_id), **params)
                assert shown == run_sql(alone[run_id], sql, run_id=str(run_id), **params), name
    # The story the two runs tell apart: run 1 paused programs, run 2 none.
    pauses = {
        r: sum(x["pauses"] for x in run_canned(db, "throughput", run_id=str(r))) for r in (1, 2)
    }
    assert pauses == {1: 2, 2: 0}
    states = run_sql(db, dashboard_charts()["states"], run_id="2")
    assert states
    assert all(s["program_id"].startswith("r2-") for s in states)
    assert "paused" not in {s["status"] for s in states}


def test_with_no_run_given_pages_open_the_latest_run_that_made_calls(
    history: History, tmp_path: Path
) -> None:
    """Run 3 is a proxy that served nothing (the demo's own, after its replays): blank means
    run 2, not run 3's empty page."""
    db = two_overlapping_runs(history, tmp_path)
    for name in ("throughput", "latency_breakdown", "prefix_cache_over_time", "backend_usage"):
        assert run_canned(db, name) == run_canned(db, name, run_id="2"), name
    assert sum(r["steps"] for r in run_canned(db, "throughput")) == 11
    for name, sql in dashboard_charts().items():
        assert run_sql(db, sql) == run_sql(db, sql, run_id="2"), name
    # Times without a run still span every run.
    everything = run_canned(db, "throughput", since="0", bucket="86400")
    assert sum(r["steps"] for r in everything) == 22


def test_a_finished_program_is_drawn_acting_only_until_it_is_presumed_ended(
    history_copy: Path,
) -> None:
    """A session that ended without a release: acting from its last answer until its idle lease
    retires it 600 s later. The chart stops its bar where the proxy presumed it ended (4 times
    its longest tool gap, at least 60 s), not at the retire."""
    conn = sqlite3.connect(history_copy)
    start = conn.execute("select max(stopped_at) from runs").fetchone()[0] + 100
    conn.execute(
        "insert into runs (started_at, stopped_at, version, router, backends, settings) "
        "values (?, ?, 'x', 'tr', '', '{}')",
        (start, start + 1000),
    )
    run = conn.execute("select max(id) from runs").fetchone()[0]
    moves = [
        (start + 1, None, "reasoning", "first request", 0),
        (start + 2, "reasoning", "acting", "response complete", 1),
        (start + 22, "acting", "reasoning", "tool finished", 1),  # a 20 s tool gap
        (start + 23, "reasoning", "acting", "response complete", 2),
        (start + 623, "acting", "stopped", "idle lease", 2),
    ]
    conn.executemany(
        "insert into transitions (run_id, at, program_id, from_status, to_status, reason, "
        "backend, step) values (?, ?, 'done', ?, ?, ?, 'http://b', ?)",
        [(run, at, f, t, why, step) for at, f, t, why, step in moves],
    )
    conn.executemany(
        "insert into steps (run_id, request_id, program_id, step, backend, endpoint, model, "
        "stream, arrived_at, sent_at, finished_at, queue_s, total_s, tool_s, status) "
        "values (?, ?, 'done', ?, 'http://b', '/v1/chat/completions', 'm', 0, ?, ?, ?, 0, 1, "
        "?, 200)",
        [(run, "r1", 1, start + 1, start + 1, start + 2, None),
         (run, "r2", 2, start + 22, start + 22, start + 23, 20.0)],
    )  # fmt: skip
    conn.commit()
    conn.close()
    bars = run_sql(history_copy, dashboard_charts()["states"], run_id=str(run))
    # Rounded to the millisecond the chart draws in: the seconds come back through
    # milliseconds of a Unix time, which a float does not always hold to the last digit
    # (2.000000238 once, where the run's start fell between two floats).
    acting = [(round(b["start_ms"] / 1000 - start, 3), round(b["end_ms"] / 1000 - start, 3))
              for b in bars if b["status"] == "acting"]  # fmt: skip
    # The first acting span ended with the next call; the last is cut at 4 x 20 s of silence.
    assert acting == [(2, 22), (23, 23 + 80)]


def test_simulated_backends_are_named_as_such_in_the_legend(history_copy: Path) -> None:
    conn = sqlite3.connect(history_copy)
    conn.execute("update backend_samples set backend = 'http://sim-0.invalid'")
    conn.execute("update steps set backend = 'http://sim-0.invalid'")
    conn.commit()
    conn.close()
    for name in ("backend_usage", "prefix_cache_over_time"):
        labels = {r["backend_label"] for r in run_canned(history_copy, name)}
        assert labels == {"simulator"}, name


def test_outcomes_are_drawn_success_green_and_failure_red() -> None:
    board = load_metadata()["plugins"]["datasette-dashboards"]["scheduling"]
    scale = board["charts"]["outcomes"]["display"]["encoding"]["color"]["scale"]
    colours = dict(zip(scale["domain"], scale["range"], strict=True))
    assert colours == {
        "ok_steps": "#2ca02c",
        "failed_steps": "#d62728",
        "client_gone_steps": "#ff7f0e",
    }


def test_a_runs_page_counts_the_call_that_ended_at_its_stop(history_copy: Path) -> None:
    """The demo's runs end with their last call: with no times given, that call is in the run's
    page, as in the link the demo prints (its window ends 1 ms after the stop)."""
    conn = sqlite3.connect(history_copy)
    stop = conn.execute("select max(finished_at) from steps").fetchone()[0]
    conn.execute("update runs set stopped_at = ?", (stop,))
    conn.commit()
    conn.close()
    run = raw(history_copy, "select started_at, stopped_at from runs")[0]
    link = {"since": str(run["started_at"]), "until": str(run["stopped_at"] + 0.001)}
    blank = run_canned(history_copy, "throughput", run_id="1")
    assert sum(r["steps"] for r in blank) == 11
    assert sum(r["steps"] for r in run_canned(history_copy, "throughput", **link)) == 11
