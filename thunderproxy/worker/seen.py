"""The request numbers a worker accepted, kept in its audit db so that a replay is refused after a
restart as it is within one run (``worker_seen``, migrations/012_worker_seen.sql).

Each accepted signed request is a ``WorkerSeenRecord`` written through the AuditLog like every
other row (the request never waits for SQLite); at startup the newest ``REPLAY_WINDOW`` numbers
are read back into the ``ReplayGuard`` before the first request is served.
"""

from __future__ import annotations

import logging
import sqlite3

import trio

from .state import REPLAY_WINDOW, WorkerState

log = logging.getLogger("thunderproxy.worker")


def load_seen(path: str, window: int) -> tuple[list[int], int | None]:
    """The newest ``window`` request numbers accepted under the audit db at ``path``, newest
    first, and the next older one (None if there is none): numbers at or below it are refused as
    stale. Rows older than that are deleted, so the table holds about one window."""
    if not path or path == ":memory:":
        return [], None
    conn = sqlite3.connect(path, timeout=10)
    try:
        numbers = [
            reqnum
            for (reqnum,) in conn.execute(
                "SELECT DISTINCT reqnum FROM worker_seen ORDER BY reqnum DESC LIMIT ?",
                (window + 1,),
            )
        ]
        floor = numbers.pop() if len(numbers) > window else None
        if floor is not None:
            with conn:
                conn.execute("DELETE FROM worker_seen WHERE reqnum < ?", (floor,))
    finally:
        conn.close()
    return numbers, floor


async def restore_seen(state: WorkerState, db: str) -> None:
    """Fill the replay guard from the audit db (already migrated by the writer)."""
    numbers, floor = await trio.to_thread.run_sync(load_seen, db, REPLAY_WINDOW)
    state.replay.restore(numbers, floor)
    if numbers:
        log.info(
            "worker: %d signed request numbers read back from %s (up to %d); their replays "
            "are refused",
            len(numbers),
            db,
            max(numbers),
        )
