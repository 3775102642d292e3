"""The audit writer's parts, each driven alone (``AuditWriter``): a flush that waits out a held
write lock, the probe of a db that refused writes, a db file replaced under the writer, the
write loop, and the stop's flush; ``serve_audit_writer`` runs them together (test_storage.py,
tests/reliability)."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import trio
import trio.testing

from thunderproxy.audit.records import AuditRecord, RejectionRecord
from thunderproxy.audit.writer import (
    BUSY_MAX_PAUSE_S,
    BUSY_PAUSE_S,
    AuditWriter,
    BatchOutcome,
    StorageTrouble,
)


def rejection(i: int) -> RejectionRecord:
    return RejectionRecord(
        at=0.0, method="GET", path=f"/{i}", status=400, error_type="x", message="m"
    )


def rows(db: Path, table: str = "rejections") -> list[tuple[object, ...]]:
    with sqlite3.connect(db) as conn:
        return conn.execute(f"SELECT path, run_id FROM {table} ORDER BY id").fetchall()


async def opened(db: Path) -> AuditWriter:
    return await AuditWriter.open(str(db), run_info={"router": "test"}, check_interval=1.0)


@dataclass
class Scripted:
    """Stands for the batch writer: refuses for the lock ``busy`` times, then writes."""

    busy: int
    written: list[list[AuditRecord]] = field(default_factory=list)

    def write(self, batch: list[AuditRecord]) -> BatchOutcome:
        if self.busy:
            self.busy -= 1
            return BatchOutcome(busy=True)
        self.written.append(batch)
        return BatchOutcome(written=len(batch))


async def test_a_flush_writes_what_is_pending_and_counts_it(tmp_path: Path) -> None:
    writer = await opened(tmp_path / "a.db")
    writer.pending.extend(rejection(i) for i in range(3))
    await writer.flush()
    assert writer.pending == []
    assert (writer.audit.written, writer.audit.batches) == (3, 1)
    await writer.stop()
    assert rows(tmp_path / "a.db") == [("/0", 1), ("/1", 1), ("/2", 1)]


async def test_a_flush_waits_out_a_held_lock_with_growing_pauses(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    writer = await opened(tmp_path / "a.db")
    scripted = Scripted(busy=8)
    writer.batches = scripted  # type: ignore[assignment]
    writer.pending.append(rejection(0))
    began = trio.current_time()
    await writer.flush()
    pauses = [min(BUSY_MAX_PAUSE_S, BUSY_PAUSE_S * 2**k) for k in range(8)]
    assert trio.current_time() - began == sum(pauses)
    assert writer.audit.busy_retries == 8
    assert [len(b) for b in scripted.written] == [1]
    assert writer.busy_pause == BUSY_PAUSE_S  # a written batch starts the pauses anew


async def test_a_closing_log_leaves_a_locked_batch_to_the_stop(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    writer = await opened(tmp_path / "a.db")
    writer.batches = Scripted(busy=1)  # type: ignore[assignment]
    writer.pending.append(rejection(0))
    writer.audit.closing = True
    await writer.flush()
    assert len(writer.pending) == 1  # still pending: the stop's flush keeps trying
    await writer.flush(stopping=True)
    assert writer.pending == []


async def test_a_db_that_takes_writes_again_is_noticed_by_a_probe(tmp_path: Path) -> None:
    writer = await opened(tmp_path / "a.db")
    now = trio.current_time()
    writer.audit.storage = StorageTrouble("disk I/O error", "SQLITE_IOERR", now, now)
    await writer.probe_storage()
    assert writer.audit.storage is not None  # refused a moment ago: a probe says less
    writer.audit.storage.last_at = now - writer.check_interval
    await writer.probe_storage()
    assert writer.audit.storage is None
    await writer.stop()


async def test_a_db_file_deleted_under_the_writer_is_created_again(tmp_path: Path) -> None:
    db = tmp_path / "a.db"
    writer = await opened(db)
    await writer.check_file()
    assert writer.audit.db_recreated == 0  # the file it has open
    for suffix in ("", "-wal", "-shm"):
        await trio.Path(str(db) + suffix).unlink(missing_ok=True)
    await writer.check_file()
    assert (writer.audit.db_recreated, writer.audit.generation) == (1, 1)
    assert writer.audit.db_problem is not None
    assert "deleted" in writer.audit.db_problem
    writer.pending.append(rejection(7))
    await writer.flush()
    await writer.stop()
    assert rows(db) == [("/7", 1)]  # the same run id in the new file


async def test_the_write_loop_batches_until_the_log_is_closed(tmp_path: Path) -> None:
    writer = await opened(tmp_path / "a.db")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.write_loop)
            for i in range(5):
                writer.audit.record(rejection(i))
            while writer.audit.written < 5:  # noqa: ASYNC110 (the writer offers no event)
                await trio.sleep(0.01)
            assert writer.audit.batches == 1  # lingered to fill one batch
            writer.audit.record(rejection(5))
            await writer.audit.aclose()
    # The loop ends at the closed channel; what it had not written is the stop's.
    assert writer.audit.written + len(writer.pending) == 6
    await writer.stop()
    assert len(rows(tmp_path / "a.db")) == 6


async def test_the_stop_writes_what_is_left_and_the_runs_stop_time(tmp_path: Path) -> None:
    db = tmp_path / "a.db"
    writer = await opened(db)
    writer.audit.record(rejection(1))
    await writer.stop()
    assert rows(db) == [("/1", 1)]
    with sqlite3.connect(db) as conn:
        ((stopped_at,),) = conn.execute("SELECT stopped_at FROM runs").fetchall()
    assert stopped_at is not None
    writer.audit.record(rejection(2))  # after the stop: dropped, never raised
    assert writer.audit.dropped == 1
