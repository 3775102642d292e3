"""Bounds on what one Datasette query may cost the proxy it runs in.

Datasette's ``sql_time_limit_ms`` interrupts a query between SQLite instructions, but one
instruction can run for as long as it likes: ``select randomblob(1e9)`` built a 1 GB value in a
single step, and rendering it as JSON stalled the proxy's event loop (Datasette shares it) for
seconds and held gigabytes. So every connection Datasette opens gets three more bounds:

- ``SQLITE_LIMIT_LENGTH``: no string or blob over ``MAX_VALUE_BYTES``; SQLite refuses to build
  one ("string or blob too big") before spending the time or the memory;
- ``SQLITE_LIMIT_COLUMN``: at most ``MAX_COLUMNS`` columns, so one row stays small too;
- a row factory that refuses a result once its values pass ``MAX_RESULT_BYTES`` in all, so
  ``max_returned_rows`` rows of large values cannot add up either;
- ``SQLITE_LIMIT_LIKE_PATTERN_LENGTH``: a LIKE or GLOB pattern of at most ``MAX_PATTERN_BYTES``.
  Matching is one instruction costing the value's length times the pattern's: a 20,000-byte
  pattern against a 1 MB value ran 87 s past a 5 s limit; at 100 bytes it takes 0.5 s.

Datasette's time limit is a progress handler it installs around its own queries only, and no
progress handler runs inside one instruction (``instr()`` of a 1 MB value and a 100 kB needle
took 5.8 s in one). :class:`QueryClock` holds the limit for every query a connection runs: its
own progress handler for code that runs SQL without Datasette's, ``interrupt()`` once the limit
is past, and, for an instruction that still runs ``HARD_GRACE_S`` later, a callback that the
explorer's process answers by exiting (its supervisor starts a fresh one).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

#: Largest string or blob a query may build (the audit db's largest values are a few KB).
MAX_VALUE_BYTES = 1024 * 1024
#: Most columns in a result, table or view (the widest audit view has fewer than 40).
MAX_COLUMNS = 100
#: Largest result (sum of its values' lengths) one query may return.
MAX_RESULT_BYTES = 8 * 1024 * 1024
#: Longest LIKE or GLOB pattern (the canned queries use none; a search box needs a few words).
MAX_PATTERN_BYTES = 100
#: After the time limit, how long a query may go on before ``interrupt()`` is called for it.
INTERRUPT_GRACE_S = 0.25
#: After the time limit, how long a query stuck in one instruction may go on before the
#: ``overrun`` callback runs.
HARD_GRACE_S = 1.0
#: How often the watchdog thread looks at the running queries.
WATCH_INTERVAL_S = 0.05
#: SQLite instructions between two looks of the progress handler (about 0.1 ms of work).
PROGRESS_STEPS = 1000

log = logging.getLogger("thunderproxy.explore")

RowFactory = Callable[[sqlite3.Cursor, tuple[Any, ...]], Any]


class ResultTooLarge(sqlite3.OperationalError):
    """Raised from the row factory: Datasette shows it as the query's error."""


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes)) else 8


def budgeted(factory: RowFactory, budget: int = MAX_RESULT_BYTES) -> RowFactory:
    """``factory`` (Datasette's ``sqlite3.Row``) that counts each cursor's result size and
    refuses the row that takes it past ``budget``."""
    spent: weakref.WeakKeyDictionary[sqlite3.Cursor, int] = weakref.WeakKeyDictionary()

    def row(cursor: sqlite3.Cursor, values: tuple[Any, ...]) -> Any:
        total = spent.get(cursor, 0) + sum(_size(v) for v in values)
        if total > budget:
            raise ResultTooLarge(
                f"Query result is larger than {budget // (1024 * 1024)} MiB, the explorer's "
                "limit; select fewer rows or columns, or length()/substr() of large values."
            )
        spent[cursor] = total
        return factory(cursor, values)

    return row


#: SQL functions no query of the explorer may call. ``fts3_tokenizer(name)`` returns a
#: tokenizer's address in the process (a pointer leak) and ``fts3_tokenizer(name, blob)`` sets
#: it: a query could point SQLite at any memory. ``load_extension`` would load any library.
REFUSED_FUNCTIONS = frozenset({"fts3_tokenizer", "load_extension"})


def refuse_unsafe_functions(
    action: int, arg1: str | None, arg2: str | None, _db: str | None, _trigger: str | None
) -> int:
    """The explorer's SQLite authorizer: every statement is allowed but calls of
    ``REFUSED_FUNCTIONS``, which SQLite then refuses with "not authorized"."""
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in REFUSED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def bound_connection(conn: sqlite3.Connection) -> None:
    """Apply the bounds to one of Datasette's connections (after Datasette set its row
    factory)."""
    conn.set_authorizer(refuse_unsafe_functions)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    conn.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, MAX_COLUMNS)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, MAX_PATTERN_BYTES)
    conn.row_factory = budgeted(conn.row_factory or (lambda _c, values: values))


@dataclass
class _Running:
    conn: sqlite3.Connection
    deadline: float
    interrupted: bool = False


class QueryClock:
    """Holds the time limit for every query run through :meth:`running`, in any thread.

    ``overrun(seconds)`` is called from the watchdog thread, once per query, when a query is
    still running ``HARD_GRACE_S`` after its limit: it is stuck in one instruction that neither
    the progress handler nor ``interrupt()`` can end, and only ending the process frees its
    thread and CPU. ``time.monotonic`` is read here, not trio's clock: this runs in Datasette's
    SQL threads and a watchdog thread, outside any trio run.
    """

    def __init__(self, limit_s: float, overrun: Callable[[float], None] | None = None) -> None:
        self.limit_s = limit_s
        self.overrun = overrun
        self._running: dict[int, _Running] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="explore-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @contextmanager
    def running(self, conn: sqlite3.Connection) -> Iterator[None]:
        """Run one query (or Datasette's function of a connection) under the limit."""
        deadline = time.monotonic() + self.limit_s

        def past_deadline() -> int:
            return 1 if time.monotonic() >= deadline else 0

        # Datasette replaces this handler with its own (same or shorter limit) around the
        # queries it times, and removes it after; code that runs SQL without it keeps this one.
        conn.set_progress_handler(past_deadline, PROGRESS_STEPS)
        key = threading.get_ident()
        with self._lock:
            self._running[key] = _Running(conn, deadline)
        try:
            yield
        finally:
            with self._lock:
                del self._running[key]
            conn.set_progress_handler(None, PROGRESS_STEPS)

    def _watch(self) -> None:
        overrun = self.overrun
        while not self._stop.wait(WATCH_INTERVAL_S):
            now = time.monotonic()
            with self._lock:
                late = [r for r in self._running.values() if now >= r.deadline + INTERRUPT_GRACE_S]
            for query in late:
                past = now - query.deadline + self.limit_s
                if not query.interrupted:
                    query.interrupted = True
                    query.conn.interrupt()  # ends it at its next instruction
                elif now >= query.deadline + HARD_GRACE_S and overrun is not None:
                    log.error(
                        "explorer: a query has run %.1f s, past its %.1f s limit, inside one "
                        "SQLite instruction that cannot be interrupted",
                        past,
                        self.limit_s,
                    )
                    overrun(past)
                    overrun = None
