"""The single SQLite writer: request handlers hand records to a bounded memory channel without
waiting; one task batches them into the database from a worker thread.

Nothing on the request path touches SQLite. A full channel drops the record (counted in
``AuditLog.statistics()``) rather than slowing traffic; on a clean stop every accepted record
is written before the writer returns.

Nothing a row holds can stop the writer: values are made storable first (``sanitize``), and a
batch SQLite still refuses is retried row by row; a row refused on its own is dropped, counted
under its cause and logged once per cause.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import tempfile
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from ..clock import WallClock
from ..errors import AuditError, ConfigError
from . import migrations
from .records import AuditRecord, ToUnix
from .sanitize import normalise_row, refusal_cause

log = logging.getLogger("thunderproxy.audit")

#: Rows per INSERT batch, and how long the writer lingers to fill one.
MAX_BATCH = 500
MAX_LINGER_S = 0.05
#: How long a stop may spend flushing records already accepted.
FLUSH_GRACE_S = 10.0
#: The cause under which records refused by a full channel are counted.
QUEUE_FULL = "queue full (raise --audit-queue)"
#: Distinct drop causes kept apart; any further cause is counted under OTHER_CAUSE.
MAX_CAUSES = 64
OTHER_CAUSE = "other"


@dataclass(frozen=True)
class AuditStatistics:
    """A snapshot of the writer. ``dropped`` counts every record lost, whatever the cause:
    refused by a full channel, or accepted and then refused by SQLite (``dropped_by_cause``
    names each cause, ``<table>: <reason>``); ``invalid`` counts rows written with a value
    changed to make it storable (clamped, escaped or NULL; noted in the row's ``error``)."""

    accepted: int
    written: int
    dropped: int
    queued: int
    batches: int
    invalid: int = 0
    dropped_by_cause: Mapping[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "written": self.written,
            "dropped": self.dropped,
            "queued": self.queued,
            "batches": self.batches,
            "invalid": self.invalid,
            "dropped_by_cause": dict(self.dropped_by_cause),
        }


class AuditLog:
    """The producer side, handed out by :func:`serve_audit_writer` through ``task_status``."""

    def __init__(self, send: trio.MemorySendChannel[AuditRecord], run_id: int) -> None:
        self._send = send
        self.run_id = run_id
        self.accepted = 0
        self.dropped = 0
        self.written = 0
        self.batches = 0
        self.invalid = 0
        self.dropped_by_cause: dict[str, int] = {}
        #: Called with every record, kept or dropped: the proxy's counters learn here, in the
        #: one place every step and transition passes (statistics.Counters).
        self.observers: list[Callable[[AuditRecord], None]] = []

    def record(self, record: AuditRecord) -> None:
        """Queue one record; never blocks, never raises (a full or closed queue drops it)."""
        for observe in self.observers:
            try:
                observe(record)
            except Exception:  # a counter's fault must not cost the row, nor fail serving
                log.exception("an audit observer failed on a %s record", type(record).__name__)
        try:
            self._send.send_nowait(record)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            self.count_dropped(QUEUE_FULL)
        else:
            self.accepted += 1

    def count_dropped(self, cause: str) -> None:
        """One record lost for ``cause``; the first loss of each cause is logged, the rest only
        counted, so a producer that keeps sending bad rows cannot flood the log."""
        self.dropped += 1
        if cause not in self.dropped_by_cause and len(self.dropped_by_cause) >= MAX_CAUSES:
            cause = OTHER_CAUSE
        if cause not in self.dropped_by_cause:
            self.dropped_by_cause[cause] = 0
            log.error(
                "audit: a record was dropped (%s); further drops for this cause are only "
                "counted, under audit.dropped_by_cause in /metrics and /health",
                cause,
            )
        self.dropped_by_cause[cause] += 1

    def statistics(self) -> AuditStatistics:
        queued = self._send.statistics().current_buffer_used
        return AuditStatistics(
            self.accepted,
            self.written,
            self.dropped,
            queued,
            self.batches,
            self.invalid,
            dict(self.dropped_by_cause),
        )

    async def aclose(self) -> None:
        """No more records; the writer flushes what it has and returns."""
        await self._send.aclose()


def check_database_path(path: str) -> None:
    """Refuse a ``--db`` that cannot become the audit db, before anything starts: a folder, a
    path in a folder that does not exist (never created silently: a typo would scatter dbs),
    a file or folder that cannot be written. Creates the file (0600) when it is missing."""
    if path == ":memory:":
        return
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise ConfigError(
            f"--db {path!r} is a directory; pass a file path such as "
            f"{str(target / 'thunderproxy.db')!r}."
        )
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise ConfigError(
            f"--db {path!r}: the folder {str(folder)!r} {what}; create it first "
            "or pass --db a path in an existing folder."
        )
    try:
        # SQLite in WAL mode keeps <db>-wal and <db>-shm beside the db: the folder must take
        # new files even when the db itself exists.
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(
            f"--db {path!r}: the folder {str(folder)!r} is not writable ({exc.strerror}); "
            "SQLite writes its -wal and -shm files beside the db. Pass --db a path in a "
            "writable folder."
        ) from None
    try:
        # Created 0600: the log names programs and backends; it is nobody else's business.
        os.close(os.open(target, os.O_CREAT | os.O_RDWR, 0o600))
    except OSError as exc:
        raise ConfigError(
            f"--db {path!r} cannot be written ({exc.strerror}); make it writable or pass "
            "--db another file."
        ) from None


def open_database(path: str) -> sqlite3.Connection:
    """Open (creating it user-only readable) and migrate the audit db, in WAL mode."""
    try:
        check_database_path(path)
    except ConfigError as exc:
        raise AuditError(exc.message) from None
    try:
        # Successive to_thread calls may run on different worker threads; only the writer task
        # ever uses this connection, so sharing it across threads is safe.
        conn = sqlite3.connect(path, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=5000")
        migrations.apply(conn)
    except sqlite3.Error as exc:
        raise AuditError(f"Cannot open the audit db {path!r}: {exc}") from exc
    return conn


@dataclass
class BatchOutcome:
    """What one batch came to: rows written, rows written with a changed value, rows lost."""

    written: int = 0
    invalid: int = 0
    refused: list[str] = field(default_factory=list)


class _BatchWriter:
    """Turns records into rows and inserts them, in a worker thread (never on the trio loop).

    Plain ``executemany`` with one cached statement per table and column set: about 3x the
    rate of sqlite-utils' ``insert_all``, which re-inspects the table on every call. A batch
    SQLite refuses is written again one row per transaction, so one bad row costs only itself.
    """

    def __init__(self, conn: sqlite3.Connection, run_id: int, to_unix: ToUnix) -> None:
        self.conn = conn
        self.run_id = run_id
        self.to_unix = to_unix
        self._statements: dict[tuple[str, tuple[str, ...]], str] = {}

    def _statement(self, key: tuple[str, tuple[str, ...]]) -> str:
        statement = self._statements.get(key)
        if statement is None:
            table, columns = key
            statement = self._statements[key] = (
                f"INSERT INTO {table} ({', '.join(columns)}) "
                f"VALUES ({', '.join('?' * len(columns))})"
            )
        return statement

    def write(self, records: list[AuditRecord]) -> BatchOutcome:
        outcome = BatchOutcome()
        grouped: dict[tuple[str, tuple[str, ...]], list[tuple[Any, ...]]] = defaultdict(list)
        for record in records:
            try:
                row, notes = normalise_row(record.row(self.to_unix))
            except Exception as exc:  # a record that cannot even be turned into a row
                outcome.refused.append(refusal_cause(record.table, exc))
                continue
            if notes:
                outcome.invalid += 1
            row["run_id"] = self.run_id
            grouped[(record.table, tuple(row))].append(tuple(row.values()))
        try:
            with self.conn:
                for key, values in grouped.items():
                    self.conn.executemany(self._statement(key), values)
        except Exception:
            # Rolled back: find the rows SQLite refuses by writing each on its own.
            for key, values in grouped.items():
                for value in values:
                    try:
                        with self.conn:
                            self.conn.execute(self._statement(key), value)
                    except Exception as exc:
                        outcome.refused.append(refusal_cause(key[0], exc))
                    else:
                        outcome.written += 1
        else:
            outcome.written = sum(len(values) for values in grouped.values())
        return outcome


async def serve_audit_writer(
    path: str,
    *,
    run_info: Mapping[str, Any],
    queue_size: int = 10_000,
    task_status: trio.TaskStatus[AuditLog] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Own the audit db: migrate it, then write batches until the AuditLog is closed.

    ``task_status.started(audit_log)`` is called once the schema is current and this run's row
    exists, so producers can record from the first request on.
    """
    clock = WallClock()
    conn = await trio.to_thread.run_sync(open_database, path)

    started_at = clock.unix(trio.current_time())

    def start_run() -> int:
        with conn:
            cursor = conn.execute(
                "INSERT INTO runs (started_at, version, router, backends, settings)"
                " VALUES (?, ?, ?, ?, ?)",
                tuple(
                    normalise_row(
                        {
                            "started_at": started_at,
                            "version": str(run_info.get("version", "")),
                            "router": str(run_info.get("router", "")),
                            "backends": ",".join(run_info.get("backends", ())),
                            "settings": json.dumps(
                                dict(run_info.get("settings", {})), default=str, sort_keys=True
                            ),
                        }
                    )[0].values()
                ),
            )
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    run_id = await trio.to_thread.run_sync(start_run)
    send, receive = trio.open_memory_channel[AuditRecord](queue_size)
    audit = AuditLog(send, run_id)
    writer = _BatchWriter(conn, run_id, clock.unix)
    pending: list[AuditRecord] = []

    async def flush() -> None:
        if not pending:
            return
        batch = pending[:]
        pending.clear()
        outcome = await trio.to_thread.run_sync(writer.write, batch)
        audit.written += outcome.written
        audit.invalid += outcome.invalid
        audit.batches += 1
        for cause in outcome.refused:
            audit.count_dropped(cause)

    try:
        task_status.started(audit)
        async for record in receive:
            pending.append(record)
            with trio.move_on_after(MAX_LINGER_S):
                while len(pending) < MAX_BATCH:
                    pending.append(await receive.receive())
            # An accepted batch is written even if the run is being cancelled meanwhile.
            with trio.CancelScope(shield=True):
                await flush()
    except trio.EndOfChannel:
        pass
    finally:
        with trio.move_on_after(FLUSH_GRACE_S) as scope:
            scope.shield = True
            while True:
                try:
                    pending.append(receive.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
            receive.close()
            await flush()
            stopped_at = clock.unix(trio.current_time())

            def finish_run() -> None:
                with conn:
                    conn.execute(
                        "UPDATE runs SET stopped_at = ? WHERE id = ?", (stopped_at, run_id)
                    )
                conn.close()

            await trio.to_thread.run_sync(finish_run)
