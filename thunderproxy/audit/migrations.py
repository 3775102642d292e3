"""Numbered SQL migrations, applied in order at startup and recorded in ``schema_migrations``.

The files live in the repository's top-level ``migrations/`` folder; wheels and the zipapp carry
them inside the package as ``thunderproxy/migrations/``.
"""

from __future__ import annotations

import re
import sqlite3
import time
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from ..errors import AuditError

_NAME = re.compile(r"^(\d{3})_[a-z0-9_]+\.sql$")


@dataclass(frozen=True)
class Migration:
    name: str
    sql: str


def _folder() -> Traversable:
    packaged = resources.files("thunderproxy") / "migrations"
    if packaged.is_dir():
        return packaged
    # Running from a source checkout (or an editable install): the top-level folder.
    return Path(__file__).resolve().parents[2] / "migrations"


def available() -> list[Migration]:
    found = [
        Migration(entry.name.removesuffix(".sql"), entry.read_text(encoding="utf-8"))
        for entry in _folder().iterdir()
        if _NAME.match(entry.name)
    ]
    return sorted(found, key=lambda m: m.name)


def _ensure_table(conn: sqlite3.Connection) -> None:
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations (name TEXT PRIMARY KEY, applied_at REAL)"
    )
    conn.commit()


def applied(conn: sqlite3.Connection) -> dict[str, float]:
    _ensure_table(conn)
    return dict(conn.execute("SELECT name, applied_at FROM schema_migrations").fetchall())


def pending(conn: sqlite3.Connection) -> list[Migration]:
    done = applied(conn)
    return [m for m in available() if m.name not in done]


def apply(conn: sqlite3.Connection) -> list[str]:
    """Apply every pending migration, each atomically with its bookkeeping row."""
    names = []
    for migration in pending(conn):
        try:
            conn.executescript(
                "BEGIN;\n"
                + migration.sql
                + "\n;INSERT INTO schema_migrations (name, applied_at) VALUES "
                + f"('{migration.name}', {time.time()!r});\nCOMMIT;"
            )
        except sqlite3.Error as exc:
            conn.rollback()
            raise AuditError(
                f"Migration {migration.name} failed: {exc}; the db is left at the previous "
                "migration. Restore a backup or point --db at a new file."
            ) from exc
        names.append(migration.name)
    return names
