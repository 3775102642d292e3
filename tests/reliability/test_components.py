"""Components fail alone: a crashing long-lived task restarts and shows in /health and /metrics,
a council job that cannot write its events fails with a clear status while the proxy serves
on, a write lock held past SQLite's busy timeout is waited out and counted, and an audit db
deleted under the proxy is noticed, reported and created again."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import query
from tests.council.helpers import MODELS, council_proxy, new_conversation, read_sse
from tests.reliability.test_audit_rows import step
from thunderproxy.audit import writer
from thunderproxy.council import store as job_store
from thunderproxy.scheduling.scheduler import Scheduler
from thunderproxy.supervision import Components, State

CHAT = {"model": MODELS[0], "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


async def health(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/health")
    assert response.status_code == 200
    body: dict[str, Any] = response.json()
    return body


async def health_until(client: httpx.AsyncClient, check: Any, timeout: float = 15.0) -> Any:
    """/health polled until ``check(body)`` holds; returns that body."""
    with trio.fail_after(timeout):
        while True:
            body = await health(client)
            if check(body):
                return body
            await trio.sleep(0.05)


async def chat_served(client: httpx.AsyncClient) -> None:
    with trio.fail_after(30):
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text


async def test_a_crashing_component_restarts_and_shows_in_health(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = True
    real_tick = Scheduler.tick

    def tick(self: Scheduler) -> None:
        if failing:
            raise RuntimeError("tick exploded")
        real_tick(self)

    monkeypatch.setattr(Scheduler, "tick", tick)
    async with (
        council_proxy(tmp_path / "a.db", monitor_interval=0.05) as (proxy, _sim),
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        # Each start fails at once, so the monitor spends its time waiting out its backoff.
        body = await health_until(
            client, lambda b: b["components"]["resume_monitor"]["state"] == "restarting"
        )
        monitor = body["components"]["resume_monitor"]
        assert monitor["last_error"] == "RuntimeError: tick exploded"
        assert body["status"] == "degraded"
        assert any("resume_monitor restarting" in reason for reason in body["degraded"])
        exposition = (await client.get("/metrics/prometheus")).text
        assert 'thunderproxy_component_up{component="resume_monitor"} 0.0' in exposition
        # The rest of the proxy serves on.
        await chat_served(client)
        assert body["components"]["council"]["state"] == "running"

        failing = False
        body = await health_until(
            client,
            lambda b: (
                b["components"]["resume_monitor"]["state"] == "running"
                and b["components"]["resume_monitor"]["restarts"] >= 1
            ),
        )
        assert body["status"] == "ok"
        restarts = body["components"]["resume_monitor"]["restarts"]
        exposition = (await client.get("/metrics/prometheus")).text
        assert (
            f'thunderproxy_component_restarts_total{{component="resume_monitor"}} {restarts:.1f}'
            in exposition
        )
        assert 'thunderproxy_component_up{component="resume_monitor"} 1.0' in exposition
        metrics = (await client.get("/metrics")).json()
        assert metrics["components"]["resume_monitor"]["restarts"] == restarts


async def test_a_council_job_whose_events_cannot_be_written_fails_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Failure injected at the store seam: every event commit is refused as SQLite refuses one
    # while another process holds the write lock past the busy timeout.
    refuse = False
    real_insert = job_store.JobStore._insert

    def insert(conn: sqlite3.Connection, rows: Any) -> None:
        if refuse:
            raise sqlite3.OperationalError("database is locked")
        real_insert(conn, rows)

    monkeypatch.setattr(job_store.JobStore, "_insert", staticmethod(insert))
    monkeypatch.setattr(job_store, "RETRY_PAUSE_S", 0.01, raising=False)
    db = tmp_path / "council.db"
    async with (
        council_proxy(db) as (proxy, _sim),
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        conversation = await new_conversation(client)
        refuse = True
        url = f"/council/api/conversations/{conversation}/message/stream"
        with trio.fail_after(30):
            async with client.stream("POST", url, json={"content": "Why?"}) as response:
                assert response.status_code == 200
                events = await read_sse(response)
        assert events[-1]["type"] == "error"
        assert events[-1]["recorded"] is False
        assert "could not record" in events[-1]["message"]
        assert "cannot be written" in events[-1]["message"]

        # The same, asked without a stream: a clear 503, not a 500 or a cut connection.
        other = await new_conversation(client)
        with trio.fail_after(30):
            answer = await client.post(
                f"/council/api/conversations/{other}/message", json={"content": "Why?"}
            )
        assert answer.status_code == 503
        assert answer.json()["error"]["type"] == "service_unavailable"

        # The proxy serves on, its council too, and once the db takes writes again, jobs run.
        await chat_served(client)
        body = await health(client)
        assert body["components"]["council"]["state"] == "running"
        refuse = False
        third = await new_conversation(client)
        url = f"/council/api/conversations/{third}/message/stream"
        with trio.fail_after(60):
            async with client.stream("POST", url, json={"content": "Why?"}) as response:
                assert (await read_sse(response))[-1]["type"] == "complete"
    # The job that could not record is left where it stood, for the next start to resume.
    job = events[0]["job_id"]
    assert query(db, "SELECT status FROM council_jobs WHERE id = ?", job)[0]["status"] == "stage1"


async def test_a_write_lock_held_past_the_busy_timeout_is_waited_out_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Short timeouts keep the test fast; the lock is held far longer than all of them.
    monkeypatch.setattr(writer, "BUSY_TIMEOUT_MS", 20)
    monkeypatch.setattr(job_store, "BUSY_TIMEOUT_MS", 20)
    monkeypatch.setattr(job_store, "RETRY_PAUSE_S", 0.02)
    db = tmp_path / "locked.db"
    async with (
        council_proxy(db) as (proxy, _sim),
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        conversation = await new_conversation(client)
        await chat_served(client)
        await health_until(client, lambda b: b["audit"]["written"] >= 1)

        # Another process's backup or VACUUM: an exclusive write lock on the db.
        holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
        await trio.to_thread.run_sync(holder.execute, "BEGIN EXCLUSIVE")
        try:
            url = f"/council/api/conversations/{conversation}/message"
            answer = await client.post(url, json={"content": "Why?"})
            assert answer.status_code == 503
            assert "write lock" in answer.json()["error"]["message"]
            # LLM calls are served meanwhile; their rows wait for the lock.
            await chat_served(client)
            body = await health_until(client, lambda b: b["audit"]["busy_retries"] >= 2)
            assert body["audit"]["dropped"] == 0
            assert body["components"]["audit_writer"]["state"] == "running"
            exposition = (await client.get("/metrics/prometheus")).text
            assert "thunderproxy_audit_busy_retries_total" in exposition
        finally:
            await trio.to_thread.run_sync(holder.execute, "ROLLBACK")
            holder.close()
        body = await health_until(client, lambda b: b["audit"]["queued"] == 0)
        assert body["audit"]["dropped"] == 0
    steps = query(db, "SELECT status FROM steps WHERE program_id NOT LIKE 'council:%'")
    assert [s["status"] for s in steps] == [200, 200]


async def test_a_deleted_audit_db_is_noticed_reported_and_created_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer, "DB_CHECK_INTERVAL_S", 0.1)
    db = tmp_path / "gone.db"
    async with (
        council_proxy(db) as (proxy, _sim),
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        await chat_served(client)
        await health_until(client, lambda b: b["audit"]["written"] >= 1)
        run_id = proxy.audit.run_id
        for suffix in ("", "-wal", "-shm"):
            os.unlink(f"{db}{suffix}")

        body = await health_until(client, lambda b: b["audit"]["db_recreated"] == 1)
        assert body["status"] == "degraded"
        assert body["audit"]["status"] == "degraded"
        assert "was deleted" in body["audit"]["problem"]
        assert any("was deleted" in reason for reason in body["degraded"])
        exposition = (await client.get("/metrics/prometheus")).text
        assert "thunderproxy_audit_db_recreated_total 1.0" in exposition
        assert "thunderproxy_audit_degraded 1.0" in exposition

        # Rows land in the new file, under the same run, and the council's store follows.
        await chat_served(client)
        conversation = await new_conversation(client)
        await health_until(client, lambda b: b["audit"]["queued"] == 0)
        assert proxy.audit.run_id == run_id
    assert db.exists()
    runs = query(db, "SELECT id, stopped_at FROM runs")
    assert [r["id"] for r in runs] == [run_id]
    assert runs[0]["stopped_at"] is not None
    steps = query(db, "SELECT run_id, status FROM steps")
    assert steps == [{"run_id": run_id, "status": 200}]
    saved = query(db, "SELECT id FROM council_conversations")
    assert [c["id"] for c in saved] == [conversation]


async def test_a_stop_while_the_write_lock_is_held_ends_within_the_flush_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer, "BUSY_TIMEOUT_MS", 20)
    monkeypatch.setattr(writer, "FLUSH_GRACE_S", 0.5)
    db = tmp_path / "held.db"
    holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            audit: writer.AuditLog = await nursery.start(
                lambda task_status: writer.serve_audit_writer(
                    str(db), run_info={}, task_status=task_status
                )
            )
            await trio.to_thread.run_sync(holder.execute, "BEGIN EXCLUSIVE")
            audit.record(step(request_id="waits"))
            while audit.busy_retries < 2:
                await trio.sleep(0.01)
            # The lock is never released: the stop gives up after its grace, counting the row.
            await audit.aclose()
    holder.execute("ROLLBACK")
    holder.close()
    assert audit.written == 0
    assert audit.dropped_by_cause == {writer.BUSY_AT_STOP: 1}


async def test_a_db_replaced_by_another_file_is_opened_again_under_a_free_run_id(
    tmp_path: Path,
) -> None:
    db = tmp_path / "audit.db"
    other = tmp_path / "other.db"
    async with trio.open_nursery() as nursery:
        audit: writer.AuditLog = await nursery.start(
            lambda task_status: writer.serve_audit_writer(
                str(db), run_info={}, check_interval=0.05, task_status=task_status
            )
        )
        assert audit.run_id == 1
        audit.record(step(request_id="before"))
        with trio.fail_after(10):
            while audit.written < 1:
                await trio.sleep(0.01)
        # Another db, whose run 1 is someone else's, moved over ours.
        conn = writer.open_database(str(other))
        with conn:
            conn.execute(
                "INSERT INTO runs (started_at, version, router, backends, settings) "
                "VALUES (0, 'x', 'x', '', '{}')"
            )
        conn.close()
        os.replace(other, db)
        with trio.fail_after(10):
            while audit.db_recreated < 1:
                await trio.sleep(0.01)
        assert "was replaced" in (audit.statistics().degraded or "")
        assert audit.run_id == 2
        audit.record(step(request_id="after"))
        await audit.aclose()
    assert [r["request_id"] for r in query(db, "SELECT request_id FROM steps")] == ["after"]
    assert query(db, "SELECT run_id FROM steps")[0]["run_id"] == 2
    assert [r["version"] for r in query(db, "SELECT version FROM runs ORDER BY id")] == ["x", ""]


async def test_the_audit_writer_restarts_after_a_failure_and_keeps_every_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "audit.db"
    components = Components()
    real_identity = writer.file_identity
    failed: list[str] = []

    def identity(path: str) -> tuple[int, int] | None:
        if not failed:
            failed.append(path)
            raise OSError("stat failed")
        return real_identity(path)

    async with trio.open_nursery() as nursery:
        audit: writer.AuditLog = await nursery.start(
            lambda task_status: writer.serve_audit_writer(
                str(db),
                run_info={},
                components=components,
                check_interval=0.05,
                task_status=task_status,
            )
        )
        monkeypatch.setattr(writer, "file_identity", identity)
        audit.record(step(request_id="one"))
        with trio.fail_after(10):
            while not components.snapshot()[0].restarts:
                await trio.sleep(0.01)
        audit.record(step(request_id="two"))
        await audit.aclose()
    (component,) = components.snapshot()
    assert component.name == "audit_writer"
    assert component.last_error == "OSError: stat failed"
    assert component.state is State.STOPPED
    rows = query(db, "SELECT request_id FROM steps ORDER BY id")
    assert [r["request_id"] for r in rows] == ["one", "two"]
