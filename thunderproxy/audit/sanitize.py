"""Rows made storable before they reach SQLite: recording must never be able to fail serving.

Values in audit rows come from clients and backends (program ids, models, upstream error text,
usage counts), so they can hold anything Python can: text with unpaired surrogates that has no
UTF-8 form, integers past SQLite's 64-bit range, NaN or infinite floats, objects SQLite has no
type for. :func:`normalise_row` turns each into the nearest value SQLite stores and says what it
changed; the writer counts such rows as ``invalid`` and notes the change in the row's ``error``
column where the table has one.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Mapping
from typing import Any

#: SQLite's INTEGER is a signed 64-bit integer; Python refuses to bind anything larger.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: Tables whose ``error`` column carries notes about values changed on the way in.
NOTE_COLUMN = "error"
#: Longest note kept in a row, so a note cannot grow a row without bound.
MAX_NOTE_CHARS = 500


def storable_text(value: str) -> tuple[str, bool]:
    """``value`` as text SQLite can store (valid UTF-8); True if it had to be changed.

    An unpaired surrogate has no UTF-8 form: it is written as its escape (``\\ud800``), so the
    row keeps what was sent, readable, instead of being lost.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8"), True
    return value, False


def _storable(column: str, value: Any) -> tuple[Any, str | None]:
    """One value as SQLite can bind it, and a note when it changed."""
    if value is None or isinstance(value, bytes):
        return value, None
    if isinstance(value, bool):
        return int(value), None
    if isinstance(value, int):
        if INT64_MIN <= value <= INT64_MAX:
            return value, None
        clamped = INT64_MAX if value > 0 else INT64_MIN
        return clamped, f"{column} out of SQLite's integer range, clamped"
    if isinstance(value, float):
        if math.isfinite(value):
            return value, None
        return None, f"{column} was {value!r}, stored as NULL"
    if isinstance(value, str):
        text, changed = storable_text(value)
        return text, f"{column} held text with no UTF-8 form, escaped" if changed else None
    # Not a type SQLite binds (a producer passed a list, a dict, ...): keep its text form.
    text, _ = storable_text(repr(value))
    return text, f"{column} was a {type(value).__name__}, stored as text"


def normalise_row(row: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The row with every value storable, and one note per value that had to change.

    When the row has an ``error`` column the notes are appended to it, so whoever reads the row
    sees that a value in it is not what was reported.
    """
    out: dict[str, Any] = {}
    notes: list[str] = []
    isfinite = math.isfinite
    for column, value in row.items():
        kind = type(value)
        # Inline fast path: nearly every value is one of these, and this runs per value per row.
        if (
            value is None
            or (kind is str and value.isascii())
            or (kind is int and INT64_MIN <= value <= INT64_MAX)
            or (kind is float and isfinite(value))
        ):
            out[column] = value
            continue
        out[column], note = _storable(column, value)
        if note is not None:
            notes.append(note)
    if notes and NOTE_COLUMN in out:
        previous = out[NOTE_COLUMN]
        joined = "audit: " + "; ".join(notes)
        if isinstance(previous, str) and previous:
            joined = f"{previous} ({joined})"
        out[NOTE_COLUMN] = joined[:MAX_NOTE_CHARS]
    return out, notes


def refusal_cause(table: str, error: BaseException) -> str:
    """A short, bounded name for why a row was refused: the table and the kind of error.

    SQLite's own messages name a constraint or a column, never a value, so they are kept;
    Python's binding errors quote the offending value, so only their class is kept.
    """
    if isinstance(error, sqlite3.Error) and str(error):
        return f"{table}: {str(error).splitlines()[0][:120]}"
    return f"{table}: {type(error).__name__}"
