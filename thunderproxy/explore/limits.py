"""Bounds on what one Datasette query may cost the proxy it runs in.

Datasette's ``sql_time_limit_ms`` interrupts a query between SQLite instructions, but one
instruction can run for as long as it likes: ``select randomblob(1e9)`` built a 1 GB value in a
single step, and rendering it as JSON stalled the proxy's event loop (Datasette shares it) for
seconds and held gigabytes. So every connection Datasette opens gets three more bounds:

- ``SQLITE_LIMIT_LENGTH``: no string or blob over ``MAX_VALUE_BYTES``; SQLite refuses to build
  one ("string or blob too big") before spending the time or the memory;
- ``SQLITE_LIMIT_COLUMN``: at most ``MAX_COLUMNS`` columns, so one row stays small too;
- a row factory that refuses a result once its values pass ``MAX_RESULT_BYTES`` in all, so
  ``max_returned_rows`` rows of large values cannot add up either.
"""

from __future__ import annotations

import sqlite3
import weakref
from collections.abc import Callable
from typing import Any

#: Largest string or blob a query may build (the audit db's largest values are a few KB).
MAX_VALUE_BYTES = 1024 * 1024
#: Most columns in a result, table or view (the widest audit view has fewer than 40).
MAX_COLUMNS = 100
#: Largest result (sum of its values' lengths) one query may return.
MAX_RESULT_BYTES = 8 * 1024 * 1024

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


def bound_connection(conn: sqlite3.Connection) -> None:
    """Apply the bounds to one of Datasette's connections (after Datasette set its row
    factory)."""
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    conn.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, MAX_COLUMNS)
    conn.row_factory = budgeted(conn.row_factory or (lambda _c, values: values))
