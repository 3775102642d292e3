"""Builds the one Datasette both ``serve`` (mounted) and ``explore`` (standalone) show: the audit
db under the stable name ``audit``, read-only, with the shipped metadata, canned queries and
dashboard charts, at ``/datasette/``.

Nothing here picks an event loop or a process: ``child`` (the process ``serve`` relays
``/datasette/`` to) and ``standalone`` both serve it through ``server.py``.
"""

from __future__ import annotations

import sqlite3
from importlib import resources
from pathlib import Path
from typing import Any

from datasette.app import Datasette
from datasette.database import Database
from datasette.plugins import pm
from datasette.utils import parse_metadata

from .. import __version__
from ..audit import migrations
from ..errors import AuditError
from . import plugin
from .limits import QueryClock
from .names import DATABASE_NAME, MOUNT_PATH

#: Datasette settings: read-only and fit for a db that grows while it is read.
SETTINGS: dict[str, Any] = {
    "base_url": MOUNT_PATH,
    # The db is live and may be large; no one should pull the file over HTTP.
    "allow_download": False,
    # Aggregations over a day of steps take more than Datasette's 1 s default. A query runs in
    # a thread of the explorer's own process; explore/limits.py holds this limit for every
    # query, single long SQLite instructions included.
    "sql_time_limit_ms": 5000,
    "facet_time_limit_ms": 500,
    # Every canned query answers in fewer rows; with limits.MAX_RESULT_BYTES it bounds what a
    # page holds and renders.
    "max_returned_rows": 1000,
    "num_sql_threads": 3,
}


#: The migration that creates the views the canned queries read.
VIEWS_MIGRATION = "003_views"


def load_metadata() -> dict[str, Any]:
    """The shipped metadata: titles, descriptions, facets, sort orders, queries, charts."""
    text = (
        resources.files("thunderproxy.explore")
        .joinpath("metadata.yaml")
        .read_text(encoding="utf-8")
    )
    metadata: dict[str, Any] = parse_metadata(text)
    return metadata


def canned_queries() -> dict[str, dict[str, Any]]:
    """Name -> canned query definition (title, description_html, params, sql)."""
    queries: dict[str, dict[str, Any]] = load_metadata()["databases"][DATABASE_NAME]["queries"]
    return queries


def check_database(path: str) -> None:
    """Refuse, with the remedy, a db Datasette could not show as documented."""
    if not Path(path).is_file():
        raise AuditError(
            f"No audit db at {path}; pass the file `thunderproxy serve --db` wrote "
            "(copy its -wal file along if the proxy is still running)."
        )
    wal = Path(f"{path}-wal")
    # Read before connecting: opening a db whose header says WAL creates an empty -wal file.
    had_wal = wal.exists()
    try:
        conn = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True)
        try:
            done = set(
                row[0] for row in conn.execute("SELECT name FROM schema_migrations").fetchall()
            )
        finally:
            conn.close()
    except sqlite3.Error as exc:
        if "no such table" in str(exc) and not had_wal:
            # A db in WAL mode copied alone: what the proxy wrote since its last checkpoint,
            # the tables themselves at first, is in the -wal file that was left behind.
            raise AuditError(
                f"{path} has no thunderproxy tables ({exc}), and there is no {wal.name} beside "
                f"it. If it was copied from a running proxy, its recent writes (the tables "
                f"included) are in that file: copy {wal.name} from the same folder along with "
                f"it, or stop the proxy before copying, or copy it whole with "
                f"`sqlite3 SOURCE.db '.backup {Path(path).name}'`."
            ) from exc
        raise AuditError(f"{path} is not a thunderproxy audit db: {exc}.") from exc
    # Later migrations add what other commands need; the explorer needs its views and below.
    missing = [
        m.name for m in migrations.available() if m.name <= VIEWS_MIGRATION and m.name not in done
    ]
    if missing:
        raise AuditError(
            f"{path} lacks schema migrations {', '.join(missing)}, which the views and queries "
            f"need; run `thunderproxy migrate --db {path}` on it (or on a copy) first."
        )


def register_plugin() -> None:
    """Register the read-only guard with Datasette's (process-wide) plugin manager, once."""
    if not pm.is_registered(plugin):
        pm.register(plugin, name="thunderproxy-explore")


class TimedDatabase(Database):  # type: ignore[misc]
    """A Datasette database whose every function of a connection (each query Datasette, a
    plugin or a page runs) is run under ``clock``'s time limit."""

    def __init__(self, ds: Datasette, path: str, clock: QueryClock) -> None:
        super().__init__(ds, path=path, is_mutable=True)
        self.clock = clock

    async def execute_fn(self, fn: Any) -> Any:
        clock = self.clock

        def timed(conn: sqlite3.Connection) -> Any:
            with clock.running(conn):
                return fn(conn)

        return await super().execute_fn(timed)


def build_datasette(
    db_path: str, clock: QueryClock | None = None, *, time_limit_ms: int | None = None
) -> Datasette:
    """A Datasette showing the audit db at ``db_path`` read-only under ``/datasette/``, every
    query under ``clock`` (by default one that interrupts queries past the time limit)."""
    register_plugin()
    settings = dict(SETTINGS)
    if time_limit_ms is not None:
        settings["sql_time_limit_ms"] = time_limit_ms
    if clock is None:
        clock = QueryClock(settings["sql_time_limit_ms"] / 1000)
    ds = Datasette(
        metadata=load_metadata(),
        settings=settings,
        version_note=f"thunderproxy {__version__}",
    )
    # Datasette adds an empty in-memory db when it is given no files; the explorer shows only
    # the audit db, under a name that does not depend on the file's name.
    if "_memory" in ds.databases:
        ds.remove_database("_memory")
    # Mutable, not immutable: the proxy keeps writing while Datasette reads (WAL). Datasette
    # opens mutable files with mode=ro, so its connections cannot write either way.
    ds.add_database(TimedDatabase(ds, str(Path(db_path).resolve()), clock), name=DATABASE_NAME)
    clock.start()
    return ds
