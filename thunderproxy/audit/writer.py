"""The single SQLite writer: request handlers hand records to a bounded memory channel without
waiting; one task batches them into the database from a worker thread.

Nothing on the request path touches SQLite. A full channel drops the record (counted in
``AuditLog.statistics()``) rather than slowing traffic; on a clean stop every accepted record
is written before the writer returns.

Nothing a row holds can stop the writer: values are made storable first (``sanitize``), and a
batch SQLite still refuses is retried row by row; a row refused on its own is dropped, counted
under its cause and logged once per cause.

Write-lock contention is waited out, not dropped: a batch refused because another connection
holds the write lock past the busy timeout (a backup, a VACUUM) is tried again, whole, after a
growing pause, each try counted (``busy_retries``); records meanwhile wait in the channel.

The db file is watched: every ``DB_CHECK_INTERVAL_S`` the writer compares the file at the path
with the one it has open (device and inode). A file deleted or replaced under it is logged as an
error, counted (``db_recreated``), shown as ``degraded`` in ``/health`` for
``DB_LOST_DEGRADED_S``, and the db is opened again at the path, migrated, with this run's
``runs`` row written again under the same run id (a new id only where the file found there
already has a run with that id). Rows the writer wrote between the loss and its check went to
the lost file.

A db that cannot take writes (a full disk, a read-only file system, an I/O error) loses every
row that reaches it: from the first batch it refuses for such a cause until it takes writes
again, ``/health`` says ``degraded`` with the cause and the rows lost (``AuditLog.storage``).
It takes writes again when a batch is written, or, with no rows coming, when a probe write
succeeds and (for a full disk) its file system has ``FREE_MARGIN_BYTES`` free: a one-row probe
alone fits into the space a refused transaction left in the WAL file.

The write loop is a supervised component (``audit_writer``, ``supervision.py``): an unexpected
failure restarts it with the same channel, so no producer ever sees it.

``AuditWriter`` holds the writer's state and its parts (the flush, the storage probe, the file
check and reopening, the write loop, the stop), each of which a test can drive alone;
``serve_audit_writer`` opens one and runs it.
"""

from __future__ import annotations

import contextlib
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
from ..supervision import Components, supervise
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
#: SQLite's busy timeout: how long one statement waits for another connection's write lock.
BUSY_TIMEOUT_MS = 5000
#: The pause before a batch refused for the write lock is tried again, doubled per refusal in a
#: row up to the maximum (on top of the busy timeout each try waits).
BUSY_PAUSE_S = 0.1
BUSY_MAX_PAUSE_S = 2.0
#: The cause records are dropped under when the lock is still held as the stop's flush ends.
BUSY_AT_STOP = "database is locked (held past the stop's flush grace)"
#: How often the writer checks that the file at --db is the one it has open.
DB_CHECK_INTERVAL_S = 1.0
#: How long /health says ``degraded`` after a deleted or replaced db was noticed.
DB_LOST_DEGRADED_S = 300.0
#: Free bytes a full file system must have again before an idle writer counts the db as
#: taking writes (a batch of 500 steps rows takes about 300 KB).
FREE_MARGIN_BYTES = 1 << 20


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
    #: Tries of a batch again after SQLite's write lock stayed held past the busy timeout.
    busy_retries: int = 0
    #: Times the db file was found deleted or replaced and opened again at its path.
    db_recreated: int = 0
    #: What happened to the db file last (None: nothing), while it still makes the proxy
    #: ``degraded`` (``DB_LOST_DEGRADED_S``), or why rows are being lost now (a full disk).
    degraded: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.degraded is None else "degraded",
            "problem": self.degraded,
            "accepted": self.accepted,
            "written": self.written,
            "dropped": self.dropped,
            "queued": self.queued,
            "batches": self.batches,
            "invalid": self.invalid,
            "dropped_by_cause": dict(self.dropped_by_cause),
            "busy_retries": self.busy_retries,
            "db_recreated": self.db_recreated,
        }


@dataclass
class StorageTrouble:
    """A spell of the db refusing writes for a cause of its storage, not of a row."""

    #: SQLite's message (``database or disk is full``) and result code name.
    cause: str
    code: str
    #: Trio time of the first refusal of the spell, and of the last.
    since: float
    last_at: float
    #: Rows lost in the spell.
    lost: int = 0


class AuditLog:
    """The producer side, handed out by :func:`serve_audit_writer` through ``task_status``."""

    def __init__(
        self, send: trio.MemorySendChannel[AuditRecord], run_id: int, *, path: str = ""
    ) -> None:
        self._send = send
        self.run_id = run_id
        #: The db's path, for the messages.
        self.path = path
        self.accepted = 0
        self.dropped = 0
        self.written = 0
        self.batches = 0
        self.invalid = 0
        self.dropped_by_cause: dict[str, int] = {}
        self.busy_retries = 0
        self.db_recreated = 0
        #: What happened to the db file last, and when (trio time).
        self.db_problem: str | None = None
        self.db_problem_at: float | None = None
        #: While the db refuses writes for its storage (full, read-only, I/O): since when,
        #: why, and the rows lost so far; None while it takes them.
        self.storage: StorageTrouble | None = None
        #: Bumped each time the db file is opened again: other connections to the same file
        #: (the council's store) reconnect when it changes.
        self.generation = 0
        #: Set by ``aclose``: a batch waiting for the write lock waits no longer than the
        #: stop's flush grace.
        self.closing = False
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

    def degraded(self, now: float) -> str | None:
        """What makes the audit log degraded at ``now``, or None: rows being lost now first,
        then a db file lost under it in the last ``DB_LOST_DEGRADED_S``."""
        trouble = self.storage
        if trouble is not None:
            return (
                f"audit rows are being dropped: the audit db {self.path!r} refuses writes "
                f"({trouble.cause}) for {now - trouble.since:.0f} s, {trouble.lost} rows lost "
                f"so far. {storage_remedy(trouble.code)}; rows are written again as soon as it "
                "takes them"
            )
        at = self.db_problem_at
        if at is None or now - at >= DB_LOST_DEGRADED_S:
            return None
        return self.db_problem

    def storage_refused(self, cause: str, code: str, lost: int, now: float) -> None:
        """A batch lost ``lost`` rows because the db refused writes for its storage."""
        if self.storage is None:
            self.storage = StorageTrouble(cause, code, now, now)
            log.error(
                "audit: the db %r refuses writes (%s): every row is dropped until it takes "
                "them again; /health says degraded meanwhile. %s.",
                self.path,
                cause,
                storage_remedy(code),
            )
        self.storage.lost += lost
        self.storage.last_at = now

    def storage_recovered(self, now: float) -> None:
        """The db took a write again: the spell of refusals is over."""
        trouble, self.storage = self.storage, None
        if trouble is not None:
            log.warning(
                "audit: the db %r takes writes again after %.0f s; %d rows were lost "
                "meanwhile (counted under audit.dropped_by_cause)",
                self.path,
                now - trouble.since,
                trouble.lost,
            )

    def statistics(self) -> AuditStatistics:
        queued = self._send.statistics().current_buffer_used
        try:
            degraded = self.degraded(trio.current_time())
        except RuntimeError:  # read outside a trio run (a report after it ended)
            degraded = self.db_problem
        return AuditStatistics(
            self.accepted,
            self.written,
            self.dropped,
            queued,
            self.batches,
            self.invalid,
            dict(self.dropped_by_cause),
            self.busy_retries,
            self.db_recreated,
            degraded,
        )

    async def aclose(self) -> None:
        """No more records; the writer flushes what it has and returns."""
        self.closing = True
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
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
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
    #: Nothing written: another connection held the write lock past the busy timeout.
    busy: bool = False
    #: The db refused rows for its storage (message, code name): ``storage_refusal``.
    storage: tuple[str, str] | None = None
    #: Rows lost for that cause.
    storage_lost: int = 0


#: SQLite's primary result codes for a lock held by another connection.
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
#: SQLite's primary result codes that say the db's storage refuses writes, whatever the row:
#: PERM, READONLY, IOERR, CORRUPT, FULL, CANTOPEN, NOTADB.
_STORAGE_CODES = frozenset({3, 8, 10, 11, 13, 14, 26})
_SQLITE_FULL = "SQLITE_FULL"


def storage_refusal(exc: BaseException) -> tuple[str, str] | None:
    """(message, primary code name) when SQLite refused for the db's storage, not for a row
    (a full disk, a read-only file system, an I/O error); else None."""
    if not isinstance(exc, sqlite3.Error):
        return None
    code = getattr(exc, "sqlite_errorcode", None)
    if not isinstance(code, int) or code & 0xFF not in _STORAGE_CODES:
        return None
    name = str(getattr(exc, "sqlite_errorname", "")).split("_")
    primary = "_".join(name[:2]) if len(name) >= 2 else f"SQLITE {code & 0xFF}"
    return str(exc).splitlines()[0][:120], primary


def storage_remedy(code: str) -> str:
    """What the operator does about a db refusing writes for ``code``."""
    if code == _SQLITE_FULL:
        return "Free space on its file system (or move --db to a larger one)"
    if code in ("SQLITE_READONLY", "SQLITE_PERM", "SQLITE_CANTOPEN"):
        return "Make the db, its folder and file system writable by the proxy"
    return "Check the disk and the file system under the db (dmesg), then restart the proxy"


def takes_writes_again(code: str, probe_written: bool, free_bytes: int | None) -> bool:
    """Whether an idle writer counts a db that refused writes for ``code`` as taking them
    again: its probe write went through and, for a full disk, its file system has
    ``FREE_MARGIN_BYTES`` free (a one-row probe fits where a batch did not)."""
    if not probe_written:
        return False
    if code != _SQLITE_FULL:
        return True
    return free_bytes is None or free_bytes >= FREE_MARGIN_BYTES


def is_busy(exc: BaseException) -> bool:
    """Whether SQLite refused for a lock another connection holds (worth waiting out)."""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)


def file_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``; None if there is none."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return (found.st_dev, found.st_ino)


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
        """Insert ``records``; with ``busy`` set nothing was written and all of them are to be
        tried again."""
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
        except Exception as exc:
            if is_busy(exc):
                return BatchOutcome(busy=True)
            # Rolled back: find the rows SQLite refuses by writing each on its own. Once one is
            # refused for the db's storage (full, read-only), the rest are too: they are
            # dropped under that cause without a failing transaction each.
            for key, values in grouped.items():
                for value in values:
                    if outcome.storage is not None:
                        outcome.refused.append(f"{key[0]}: {outcome.storage[0]}")
                        outcome.storage_lost += 1
                        continue
                    try:
                        with self.conn:
                            self.conn.execute(self._statement(key), value)
                    except Exception as exc:
                        outcome.refused.append(refusal_cause(key[0], exc))
                        outcome.storage = storage_refusal(exc)
                        outcome.storage_lost += outcome.storage is not None
                    else:
                        outcome.written += 1
        else:
            outcome.written = sum(len(values) for values in grouped.values())
        return outcome

    def probe(self, path: str) -> tuple[bool, int | None]:
        """Whether a write commits now (this run's row rewritten as it is), and the bytes
        free to the proxy on the file system of the db at ``path`` (None where it cannot
        tell)."""
        folder = os.path.dirname(os.path.abspath(path))
        try:
            with self.conn:
                self.conn.execute(
                    "UPDATE runs SET stopped_at = stopped_at WHERE id = ?", (self.run_id,)
                )
            written = True
        except sqlite3.Error:
            written = False
        try:
            found = os.statvfs(folder)
        except OSError:
            return written, None
        if found.f_flag & os.ST_RDONLY:
            return False, 0
        return written, found.f_bavail * found.f_frsize


def _sidecar_identities(path: str) -> dict[str, tuple[int, int] | None]:
    """(device, inode) of the db's -wal and -shm files as they are now."""
    if path == ":memory:":
        return {}
    return {suffix: file_identity(path + suffix) for suffix in ("-wal", "-shm")}


class _RunRow:
    """This run's ``runs`` row: written at start, and again into a db file recreated under the
    writer (same id where the new file has it free)."""

    def __init__(self, run_info: Mapping[str, Any], started_at: float) -> None:
        self.values = normalise_row(
            {
                "started_at": started_at,
                "version": str(run_info.get("version", "")),
                "router": str(run_info.get("router", "")),
                "backends": ",".join(run_info.get("backends", ())),
                "settings": json.dumps(
                    dict(run_info.get("settings", {})), default=str, sort_keys=True
                ),
            }
        )[0]

    def insert(self, conn: sqlite3.Connection, run_id: int | None = None) -> int:
        columns = dict(self.values) if run_id is None else {"id": run_id, **self.values}
        with conn:
            cursor = conn.execute(
                f"INSERT INTO runs ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                tuple(columns.values()),
            )
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    def insert_again(self, conn: sqlite3.Connection, run_id: int) -> int:
        """The run id to go on with in a recreated file: ``run_id`` unless that file already
        has a run of that id (a copy of another db put in its place)."""
        try:
            return self.insert(conn, run_id)
        except sqlite3.IntegrityError:
            return self.insert(conn)


class AuditWriter:
    """The one writer of the audit db, in parts that can each be driven alone: ``flush`` (write
    what is pending, waiting out a held write lock), ``probe_storage`` (whether a db refusing
    writes takes them again), ``check_file`` (a db file deleted or replaced under it, opened
    again by ``reopen``), ``write_loop`` (batches from the channel, and the checks every
    ``check_interval``) and ``stop`` (the flush of every accepted record, then this run's stop
    time). ``open`` makes one over a migrated db with this run's row written;
    :func:`serve_audit_writer` runs it."""

    def __init__(
        self,
        path: str,
        conn: sqlite3.Connection,
        run_row: _RunRow,
        run_id: int,
        clock: WallClock,
        *,
        queue_size: int,
        check_interval: float,
        identity: tuple[int, int] | None,
        sidecars: dict[str, tuple[int, int] | None],
    ) -> None:
        self.path = path
        self.clock = clock
        self.run_row = run_row
        self.check_interval = check_interval
        #: (device, inode) of the db file it has open, and of its -wal and -shm files.
        self.identity = identity
        self.sidecars = sidecars
        send, self.receive = trio.open_memory_channel[AuditRecord](queue_size)
        #: The producers' side, handed out once the writer is open.
        self.audit = AuditLog(send, run_id, path=path)
        self.batches = _BatchWriter(conn, run_id, clock.unix)
        #: Records taken from the channel and not yet written.
        self.pending: list[AuditRecord] = []
        self.busy_pause = BUSY_PAUSE_S

    @classmethod
    async def open(
        cls,
        path: str,
        *,
        run_info: Mapping[str, Any],
        queue_size: int = 10_000,
        check_interval: float | None = None,
    ) -> AuditWriter:
        """Migrate the db at ``path`` and write this run's row; ``check_interval``: seconds
        between checks of the db file (``DB_CHECK_INTERVAL_S`` if None)."""
        clock = WallClock()
        conn = await trio.to_thread.run_sync(open_database, path)
        identity = file_identity(path) if path != ":memory:" else None
        sidecars = await trio.to_thread.run_sync(_sidecar_identities, path)
        run_row = _RunRow(run_info, clock.unix(trio.current_time()))
        run_id = await trio.to_thread.run_sync(run_row.insert, conn)
        return cls(
            path,
            conn,
            run_row,
            run_id,
            clock,
            queue_size=queue_size,
            check_interval=DB_CHECK_INTERVAL_S if check_interval is None else check_interval,
            identity=identity,
            sidecars=sidecars,
        )

    async def flush(self, *, stopping: bool = False) -> None:
        """Write ``pending``; a batch refused for the write lock stays pending and is tried
        again after a pause (the pause is where a stop may cancel the wait). Once the log is
        closing, only the stop's flush (``stopping``, bounded by its grace) keeps trying."""
        audit, pending = self.audit, self.pending
        while pending:
            batch = pending[:]
            # An accepted batch is written even if the run is being cancelled meanwhile.
            with trio.CancelScope(shield=True):
                outcome = await trio.to_thread.run_sync(self.batches.write, batch)
            if outcome.busy:
                if audit.busy_retries == 0:
                    log.warning(
                        "audit: the db %r is locked by another connection (a backup or "
                        "VACUUM?); batches wait and are tried again, counted under "
                        "audit.busy_retries",
                        self.path,
                    )
                audit.busy_retries += 1
                if audit.closing and not stopping:
                    return
                await trio.sleep(self.busy_pause)
                self.busy_pause = min(BUSY_MAX_PAUSE_S, self.busy_pause * 2)
                continue
            self.busy_pause = BUSY_PAUSE_S
            del pending[: len(batch)]
            self._count(outcome)

    def _count(self, outcome: BatchOutcome) -> None:
        """A written batch's figures into the log, and whether the db refuses for its storage."""
        audit = self.audit
        audit.written += outcome.written
        audit.invalid += outcome.invalid
        audit.batches += 1
        for cause in outcome.refused:
            audit.count_dropped(cause)
        now = trio.current_time()
        if outcome.storage is not None:
            audit.storage_refused(*outcome.storage, outcome.storage_lost, now)
        elif outcome.written:
            audit.storage_recovered(now)

    async def probe_storage(self) -> None:
        """With no rows coming, ask the db whether it takes writes again."""
        trouble = self.audit.storage
        if trouble is None or self.path == ":memory:":
            return
        if trio.current_time() - trouble.last_at < self.check_interval:
            return  # batches are still being refused: they say more than a probe
        with trio.CancelScope(shield=True):
            written, free = await trio.to_thread.run_sync(self.batches.probe, self.path)
        if takes_writes_again(trouble.code, written, free):
            self.audit.storage_recovered(trio.current_time())

    def reopen(self) -> tuple[sqlite3.Connection, int]:
        """In a worker thread: open the db again at its path, with this run's row."""
        path = self.path
        try:
            self.batches.conn.close()
        except sqlite3.Error:
            pass
        # The lost file's -wal and -shm may still lie at the path (deleted alone, or renamed
        # away): a new db must not read them as its own, so they go if they are the ones this
        # writer had (the same device and inode).
        for suffix, known in self.sidecars.items():
            if known is not None and file_identity(path + suffix) == known:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path + suffix)
        new = open_database(path)
        try:
            new_id = self.run_row.insert_again(new, self.batches.run_id)
        except BaseException:
            new.close()
            raise
        self.sidecars = _sidecar_identities(path)
        return new, new_id

    async def check_file(self) -> None:
        """Notice a db file deleted or replaced under the writer, and open it again."""
        path, audit, batches = self.path, self.audit, self.batches
        found = await trio.to_thread.run_sync(file_identity, path)
        if found == self.identity:
            return
        problem = (
            f"the audit db {path!r} was deleted under the running proxy"
            if found is None
            else f"the audit db {path!r} was replaced by another file under the running proxy"
        )
        audit.db_problem = problem
        audit.db_problem_at = trio.current_time()
        try:
            with trio.CancelScope(shield=True):
                conn, new_id = await trio.to_thread.run_sync(self.reopen)
        except (AuditError, sqlite3.Error) as exc:
            log.error(
                "%s; opening it again failed (%s); trying again in %.0f s; rows written "
                "meanwhile are lost with the old file",
                problem,
                exc,
                self.check_interval,
            )
            return
        batches.conn = conn
        self.identity = file_identity(path)
        audit.db_recreated += 1
        audit.generation += 1
        if new_id != batches.run_id:
            log.error("audit: run id %d is taken in the new file; this run goes on as %d",
                      batches.run_id, new_id)  # fmt: skip
        batches.run_id = audit.run_id = new_id
        log.error(
            "%s; rows written since the last check (%.0f s ago at most) are lost with it. "
            "Created it again with the migrations and this run's row (run %d); /health says "
            "degraded for %.0f s. Move or back up the db with the proxy stopped.",
            problem,
            self.check_interval,
            new_id,
            DB_LOST_DEGRADED_S,
        )

    async def write_loop(self, *, task_status: trio.TaskStatus[None]) -> None:
        """Batches from the channel until it is closed; every ``check_interval`` the db file
        and its storage checked. The supervised component ``audit_writer``."""
        task_status.started()
        pending, receive = self.pending, self.receive
        next_check = trio.current_time() + self.check_interval
        while True:
            with trio.move_on_at(next_check):
                try:
                    if not pending:
                        pending.append(await receive.receive())
                    with trio.move_on_after(MAX_LINGER_S):
                        while len(pending) < MAX_BATCH:
                            pending.append(await receive.receive())
                except trio.EndOfChannel:
                    return
            await self.flush()
            if pending:
                return  # closing while the lock is held: the stop's flush takes over
            if trio.current_time() >= next_check:
                if self.identity is not None:
                    await self.check_file()
                await self.probe_storage()
                next_check = trio.current_time() + self.check_interval

    async def stop(self) -> None:
        """Write every record accepted (within ``FLUSH_GRACE_S``; what a held lock keeps out
        is counted as dropped), then this run's stop time, and close the db."""
        pending = self.pending
        with trio.move_on_after(FLUSH_GRACE_S) as scope:
            scope.shield = True
            while True:
                try:
                    pending.append(self.receive.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
            self.receive.close()
            await self.flush(stopping=True)
        if pending:
            for _ in pending:
                self.audit.count_dropped(BUSY_AT_STOP)
            pending.clear()
        stopped_at = self.clock.unix(trio.current_time())
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self.finish_run, stopped_at)

    def finish_run(self, stopped_at: float) -> None:
        """In a worker thread: this run's stop time into its row, and the db closed."""
        conn = self.batches.conn
        try:
            with conn:
                conn.execute(
                    "UPDATE runs SET stopped_at = ? WHERE id = ?",
                    (stopped_at, self.batches.run_id),
                )
        except sqlite3.Error as exc:
            log.error("audit: could not record this run's stop time (%s)", exc)
        finally:
            conn.close()


async def serve_audit_writer(
    path: str,
    *,
    run_info: Mapping[str, Any],
    queue_size: int = 10_000,
    components: Components | None = None,
    check_interval: float | None = None,
    task_status: trio.TaskStatus[AuditLog] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Own the audit db: migrate it, then write batches until the AuditLog is closed.

    ``task_status.started(audit_log)`` is called once the schema is current and this run's row
    exists, so producers can record from the first request on. The write loop runs as the
    supervised component ``audit_writer`` of ``components`` (a registry of its own if None);
    it checks the db file every ``check_interval`` seconds (``DB_CHECK_INTERVAL_S`` if None).
    """
    writer = await AuditWriter.open(
        path, run_info=run_info, queue_size=queue_size, check_interval=check_interval
    )
    try:
        task_status.started(writer.audit)
        await supervise(components or Components(), "audit_writer", writer.write_loop)
    finally:
        await writer.stop()
