"""A db that refuses writes for its storage (full, read-only) loses every row that reaches it:
the audit log says ``degraded`` with the cause and the count while it lasts, and ``ok`` as soon as
the db takes writes again, with rows coming (a batch written) or without (a probe)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.conftest import query, wait_for
from tests.reliability.test_audit_rows import step
from thunderproxy.audit import AuditLog, serve_audit_writer, writer
from thunderproxy.audit.writer import FREE_MARGIN_BYTES, storage_refusal, takes_writes_again


class Opened:
    """The writer's connection, kept by a wrapped ``open_database`` so a test can make the db
    refuse writes as SQLite itself does (a page limit: SQLITE_FULL; query_only:
    SQLITE_READONLY)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.conn: sqlite3.Connection | None = None
        real = writer.open_database

        def opening(path: str) -> sqlite3.Connection:
            self.conn = real(path)
            return self.conn

        monkeypatch.setattr(writer, "open_database", opening)

    def run(self, sql: str) -> Any:
        assert self.conn is not None
        return self.conn.execute(sql).fetchone()


async def start_writer(nursery: trio.Nursery, db: Path, check_interval: float) -> AuditLog:
    audit: AuditLog = await nursery.start(
        lambda task_status: serve_audit_writer(
            str(db), run_info={}, check_interval=check_interval, task_status=task_status
        )
    )
    return audit


async def test_a_full_db_makes_the_log_degraded_while_rows_are_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "audit.db"
    opened = Opened(monkeypatch)
    async with trio.open_nursery() as nursery:
        # No idle probe meanwhile: the page limit is SQLite's, the file system has room, so a
        # probe would rightly find the db writable.
        audit = await start_writer(nursery, db, check_interval=60)
        audit.record(step(request_id="before"))
        await wait_for(lambda: audit.written == 1)
        assert audit.statistics().as_dict()["status"] == "ok"
        # No page more than it has: every new row needs one, so SQLite answers "database or
        # disk is full", as it does on a full file system.
        (pages,) = opened.run("PRAGMA page_count")
        opened.run(f"PRAGMA max_page_count = {pages}")
        for i in range(600):
            audit.record(step(request_id=f"lost-{i}", error="x" * 200))
        await wait_for(lambda: audit.written + audit.dropped == 601)
        # The first rows of the batch may fit where its pages have room; the rest cannot.
        stats = audit.statistics()
        assert stats.dropped >= 500
        assert stats.as_dict()["status"] == "degraded"
        problem = stats.degraded
        assert problem is not None
        assert "audit rows are being dropped" in problem
        assert "database or disk is full" in problem
        assert f"{stats.dropped} rows lost" in problem
        assert "Free space" in problem
        assert stats.dropped_by_cause == {"steps: database or disk is full": stats.dropped}

        # Room again, and rows coming: the first batch written ends it.
        written = audit.written
        opened.run("PRAGMA max_page_count = 1000000")
        audit.record(step(request_id="after"))
        await wait_for(lambda: audit.written == written + 1)
        assert audit.statistics().degraded is None
        assert audit.statistics().as_dict()["status"] == "ok"
        await audit.aclose()
    ids = [r["request_id"] for r in query(db, "SELECT request_id FROM steps")]
    assert ids[0] == "before"
    assert ids[-1] == "after"


async def test_a_read_only_db_is_degraded_until_a_probe_write_goes_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "audit.db"
    opened = Opened(monkeypatch)
    async with trio.open_nursery() as nursery:
        audit = await start_writer(nursery, db, check_interval=0.05)
        opened.run("PRAGMA query_only = 1")
        audit.record(step(request_id="lost"))
        await wait_for(lambda: audit.dropped == 1)
        problem = audit.statistics().degraded
        assert problem is not None
        assert "attempt to write a readonly database" in problem
        assert "writable" in problem
        # Nothing more comes: the writer's own probe finds the db writable again.
        opened.run("PRAGMA query_only = 0")
        await wait_for(lambda: audit.statistics().degraded is None, timeout=10)
        await audit.aclose()


def test_only_storage_causes_count_as_the_db_refusing_writes() -> None:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (x NOT NULL)")
    with pytest.raises(sqlite3.IntegrityError) as refused_row:
        conn.execute("INSERT INTO t VALUES (NULL)")
    assert storage_refusal(refused_row.value) is None  # a row's fault: the db is fine
    conn.execute("PRAGMA query_only = 1")
    with pytest.raises(sqlite3.OperationalError) as read_only:
        conn.execute("INSERT INTO t VALUES (1)")
    assert storage_refusal(read_only.value) == (
        "attempt to write a readonly database",
        "SQLITE_READONLY",
    )


def test_an_idle_full_db_takes_writes_again_only_with_room_for_a_batch() -> None:
    # A one-row probe fits into the WAL space a refused batch left; only free space counts.
    assert not takes_writes_again("SQLITE_FULL", True, 0)
    assert not takes_writes_again("SQLITE_FULL", True, FREE_MARGIN_BYTES - 1)
    assert takes_writes_again("SQLITE_FULL", True, FREE_MARGIN_BYTES)
    assert not takes_writes_again("SQLITE_FULL", False, 10 * FREE_MARGIN_BYTES)
    assert takes_writes_again("SQLITE_READONLY", True, 0)
    assert not takes_writes_again("SQLITE_IOERR", False, None)
