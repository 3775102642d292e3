"""The council's durable store: conversations, messages, jobs and job events in SQLite.

It owns one connection of its own (WAL, in the same db file as the audit log) used only from
worker threads, one call at a time. Event appends are awaited: an event exists for a follower
only once it is committed, so a stream replayed after a crash shows exactly what a live
follower saw. Concurrent appends share one commit (group commit), so several members
streaming at once cost one transaction per batch, not one per chunk.

A statement SQLite refuses for a passing reason (another connection holding the write lock past
the busy timeout, as a backup or VACUUM does; a full disk; an I/O error) is tried again, up to
``ATTEMPTS`` times with a growing pause in between (trio time); then ``StoreUnavailable`` names
the db and the cause. When the audit writer recreates a deleted or replaced db file, the store
reconnects to the new one before its next statement (``db_generation``).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from ..audit import migrations
from ..clock import WallClock
from ..errors import AuditError
from .errors import StoreUnavailable
from .records import Job

T = TypeVar("T")

log = logging.getLogger("thunderproxy.council")

#: How long one statement waits for another connection's write lock (SQLite's busy timeout).
BUSY_TIMEOUT_MS = 5000
#: Tries of one statement before it fails with ``StoreUnavailable``, and the pause before the
#: second (doubled before each further one).
ATTEMPTS = 4
RETRY_PAUSE_S = 0.25

#: Job statuses that mean the job is still to be run (or resumed after a restart).
UNFINISHED = ("pending", "stage1", "stage2", "stage3")


@dataclass(frozen=True)
class Event:
    """One numbered event of a job: the unit of its SSE stream (``id:`` is ``seq``)."""

    job_id: str
    seq: int
    at: float
    type: str
    data: dict[str, Any]

    def payload(self) -> dict[str, Any]:
        return {"type": self.type, "seq": self.seq, **self.data}


@dataclass
class _Batch:
    rows: list[tuple[str, int, float, str, str | None, str]]
    done: trio.Event
    error: BaseException | None = None


def connect(path: str) -> sqlite3.Connection:
    """A second connection to the (audit) db, migrated, in WAL mode.

    Only through SQLite: the file must never be opened and closed outside it while the audit
    writer holds it, because closing any descriptor of a file drops every POSIX lock this
    process holds on it, and another process could then checkpoint the WAL under the writer.
    """
    try:
        conn = sqlite3.connect(path, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        migrations.apply(conn)
    except sqlite3.Error as exc:
        raise AuditError(
            f"Cannot open the council's tables in {path!r}: {exc}; pass --db with a writable path."
        ) from exc
    return conn


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _loads(value: str | None) -> Any:
    return None if value is None else json.loads(value)


class JobStore:
    """Async access to the council tables. Open with :meth:`open`; close with :meth:`aclose`."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        clock: WallClock,
        *,
        path: str = "",
        db_generation: Callable[[], int] | None = None,
    ) -> None:
        self._conn = conn
        self._conn.row_factory = sqlite3.Row
        self._clock = clock
        self._lock = trio.Lock()
        self._batch = _Batch([], trio.Event())
        self._flush_lock = trio.Lock()
        self._path = path
        self._db_generation = db_generation
        self._generation = 0 if db_generation is None else db_generation()
        #: Statements tried again after SQLite refused them, and those that failed for good.
        self.retries = 0
        self.failures = 0

    @classmethod
    async def open(
        cls,
        path: str,
        clock: WallClock | None = None,
        *,
        db_generation: Callable[[], int] | None = None,
    ) -> JobStore:
        conn = await trio.to_thread.run_sync(connect, path)
        return cls(conn, clock or WallClock(), path=path, db_generation=db_generation)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            async with self._lock:
                await trio.to_thread.run_sync(self._conn.close)

    def now(self) -> float:
        return self._clock.unix(trio.current_time())

    def _reconnect(self) -> None:
        """In a worker thread: move to the db file the audit writer recreated."""
        conn = connect(self._path)
        conn.row_factory = sqlite3.Row
        old, self._conn = self._conn, conn
        old.close()

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        # Shielded: a write the caller awaited is finished even if the caller is cancelled,
        # so the db never holds half of what a stage meant to save. Retries are bounded
        # (ATTEMPTS), so the shield cannot hold a stop for long.
        with trio.CancelScope(shield=True):
            async with self._lock:
                pause = RETRY_PAUSE_S
                for attempt in range(1, ATTEMPTS + 1):
                    try:
                        if self._db_generation is not None:
                            generation = self._db_generation()
                            if generation != self._generation:
                                await trio.to_thread.run_sync(self._reconnect)
                                self._generation = generation
                                log.warning("council store: reconnected to the recreated db")
                        return await trio.to_thread.run_sync(fn, self._conn)
                    except (sqlite3.OperationalError, AuditError) as exc:
                        # Locked, busy, full, I/O: passing causes; anything else is a bug.
                        if attempt == ATTEMPTS:
                            self.failures += 1
                            raise StoreUnavailable(
                                f"The council's tables in the audit db {self._path!r} cannot be "
                                f"written ({exc}; tried {ATTEMPTS} times over "
                                f"{RETRY_PAUSE_S * (2 ** (ATTEMPTS - 1) - 1):.2f} s plus "
                                f"SQLite's {BUSY_TIMEOUT_MS / 1000:g} s busy timeout each). "
                                "Another process may hold the db's write lock (a backup or "
                                "VACUUM) or the disk is full; try again once it is released."
                            ) from exc
                        self.retries += 1
                        log.warning(
                            "council store: attempt %d of %d failed (%s); trying again in %.2f s",
                            attempt,
                            ATTEMPTS,
                            exc,
                            pause,
                        )
                        await trio.sleep(pause)
                        pause *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    # --- conversations ---------------------------------------------------------------------
    async def create_conversation(self) -> dict[str, Any]:
        conversation = {"id": uuid.uuid4().hex, "created_at": self.now(), "title": None}

        def insert(conn: sqlite3.Connection) -> None:
            with conn:
                conn.execute(
                    "INSERT INTO council_conversations (id, created_at) VALUES (?, ?)",
                    (conversation["id"], conversation["created_at"]),
                )

        await self._run(insert)
        return {**conversation, "title": "New conversation", "messages": []}

    async def list_conversations(self) -> list[dict[str, Any]]:
        def select(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            rows = conn.execute(
                "SELECT c.id, c.created_at, c.title, "
                "(SELECT count(*) FROM council_messages m WHERE m.conversation_id = c.id) "
                "AS message_count FROM council_conversations c ORDER BY c.created_at DESC"
            ).fetchall()
            return [dict(row) for row in rows]

        return await self._run(select)

    async def get_conversation(self, conversation_id: str) -> dict[str, Any] | None:
        def select(conn: sqlite3.Connection) -> dict[str, Any] | None:
            row = conn.execute(
                "SELECT id, created_at, title FROM council_conversations WHERE id = ?",
                (conversation_id,),
            ).fetchone()
            if row is None:
                return None
            messages = []
            for m in conn.execute(
                "SELECT m.role, m.content, m.job_id, j.status, j.stage1, j.stage2, j.stage3, "
                "j.metadata, j.error FROM council_messages m "
                "LEFT JOIN council_jobs j ON j.id = m.job_id "
                "WHERE m.conversation_id = ? ORDER BY m.id",
                (conversation_id,),
            ):
                if m["role"] == "user":
                    messages.append({"role": "user", "content": m["content"]})
                else:
                    messages.append(
                        {
                            "role": "assistant",
                            "job_id": m["job_id"],
                            "status": m["status"],
                            "stage1": _loads(m["stage1"]),
                            "stage2": _loads(m["stage2"]),
                            "stage3": _loads(m["stage3"]),
                            "metadata": _loads(m["metadata"]),
                            "error": m["error"],
                        }
                    )
            return {**dict(row), "messages": messages}

        return await self._run(select)

    async def delete_conversation(self, conversation_id: str) -> bool:
        """Forget the conversation and its messages; its jobs and their events stay, as the
        audit history of what the council did."""

        def delete(conn: sqlite3.Connection) -> bool:
            with conn:
                conn.execute(
                    "DELETE FROM council_messages WHERE conversation_id = ?", (conversation_id,)
                )
                cursor = conn.execute(
                    "DELETE FROM council_conversations WHERE id = ?", (conversation_id,)
                )
            return cursor.rowcount > 0

        return await self._run(delete)

    async def set_title(self, conversation_id: str, title: str) -> None:
        def update(conn: sqlite3.Connection) -> None:
            with conn:
                conn.execute(
                    "UPDATE council_conversations SET title = ? WHERE id = ?",
                    (title, conversation_id),
                )

        await self._run(update)

    # --- jobs --------------------------------------------------------------------------------
    async def create_job(
        self,
        conversation_id: str,
        question: str,
        *,
        members: Sequence[str],
        chairman: str,
        title_model: str | None,
        client: str | None = None,
    ) -> str:
        """Record the user's message, the job and the assistant message it will fill, at once;
        ``client``: the configured client that asked (``[clients]``), whose calls its are."""
        job_id = uuid.uuid4().hex[:16]
        now = self.now()

        def insert(conn: sqlite3.Connection) -> None:
            with conn:
                first = not conn.execute(
                    "SELECT 1 FROM council_messages WHERE conversation_id = ? LIMIT 1",
                    (conversation_id,),
                ).fetchone()
                conn.execute(
                    "INSERT INTO council_jobs (id, conversation_id, question, status, members, "
                    "chairman, title_model, client, created_at, updated_at) "
                    "VALUES (?, ?, ?, 'pending', ?, ?, ?, ?, ?, ?)",
                    (job_id, conversation_id, question, _json(list(members)), chairman,
                     title_model if first else None, client, now, now),
                )  # fmt: skip
                conn.executemany(
                    "INSERT INTO council_messages (conversation_id, role, content, job_id, "
                    "created_at) VALUES (?, ?, ?, ?, ?)",
                    [
                        (conversation_id, "user", question, None, now),
                        (conversation_id, "assistant", None, job_id, now),
                    ],
                )

        await self._run(insert)
        return job_id

    async def get_job(self, job_id: str) -> Job | None:
        def select(conn: sqlite3.Connection) -> Job | None:
            row = conn.execute("SELECT * FROM council_jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                return None
            last_seq = conn.execute(
                "SELECT coalesce(max(seq), 0) FROM council_events WHERE job_id = ?", (job_id,)
            ).fetchone()[0]
            return Job.from_row(row, last_seq)

        return await self._run(select)

    async def latest_job(self, conversation_id: str) -> str | None:
        def select(conn: sqlite3.Connection) -> str | None:
            row = conn.execute(
                "SELECT id FROM council_jobs WHERE conversation_id = ? "
                "ORDER BY created_at DESC, rowid DESC LIMIT 1",
                (conversation_id,),
            ).fetchone()
            return None if row is None else str(row[0])

        return await self._run(select)

    async def unfinished_jobs(self) -> list[str]:
        def select(conn: sqlite3.Connection) -> list[str]:
            marks = ",".join("?" * len(UNFINISHED))
            rows = conn.execute(
                f"SELECT id FROM council_jobs WHERE status IN ({marks}) ORDER BY created_at",
                UNFINISHED,
            ).fetchall()
            return [str(r[0]) for r in rows]

        return await self._run(select)

    async def update_job(self, job_id: str, **fields: Any) -> None:
        """Set job columns; stage results and metadata are stored as JSON."""
        values = {
            k: _json(v) if k in ("stage1", "stage2", "stage3", "metadata") else v
            for k, v in fields.items()
        }
        values["updated_at"] = self.now()
        assignments = ", ".join(f"{name} = ?" for name in values)

        def update(conn: sqlite3.Connection) -> None:
            with conn:
                conn.execute(
                    f"UPDATE council_jobs SET {assignments} WHERE id = ?",
                    (*values.values(), job_id),
                )

        await self._run(update)

    # --- events ------------------------------------------------------------------------------
    async def append(self, job_id: str, seq: int, type: str, data: dict[str, Any]) -> Event:
        """Commit one event; returns once it is durable. Callers number their own job's
        events (one writer per job), so ``seq`` is known before the commit."""
        event = Event(job_id, seq, self.now(), type, data)
        batch = self._batch
        batch.rows.append((job_id, seq, event.at, type, data.get("model"), _json(data)))
        with trio.CancelScope(shield=True):
            async with self._flush_lock:
                if not batch.done.is_set():
                    # Whoever holds the lock first writes everything appended so far.
                    self._batch = _Batch([], trio.Event())
                    try:
                        await self._run(lambda conn: self._insert(conn, batch.rows))
                    except BaseException as exc:
                        batch.error = exc
                        raise
                    finally:
                        batch.done.set()
        if batch.error is not None:
            raise batch.error
        return event

    @staticmethod
    def _insert(
        conn: sqlite3.Connection, rows: list[tuple[str, int, float, str, str | None, str]]
    ) -> None:
        with conn:
            conn.executemany(
                "INSERT INTO council_events (job_id, seq, at, type, model, data) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                rows,
            )

    async def events(self, job_id: str, after: int = 0) -> list[Event]:
        def select(conn: sqlite3.Connection) -> list[Event]:
            rows = conn.execute(
                "SELECT seq, at, type, data FROM council_events WHERE job_id = ? AND seq > ? "
                "ORDER BY seq",
                (job_id, after),
            ).fetchall()
            return [Event(job_id, r[0], r[1], r[2], json.loads(r[3])) for r in rows]

        return await self._run(select)
