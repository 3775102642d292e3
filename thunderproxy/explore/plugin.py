"""The Datasette plugin thunderproxy registers for its explorer: it keeps Datasette read-only,
and bounds what one query may cost (``limits.py``).

Datasette 0.65 has no write API, but a canned query can be marked writable, debug pages exist
for the root actor, and a newer Datasette adds write actions; refusing every action that is not
a read covers all of them, whatever the metadata says.
"""

from __future__ import annotations

from typing import Any

from datasette import hookimpl

from .limits import bound_connection

#: The only actions anyone is granted: seeing pages and running read-only SQL.
READ_ACTIONS = frozenset(
    {"view-instance", "view-database", "view-table", "view-query", "execute-sql"}
)


@hookimpl  # type: ignore[untyped-decorator,misc]
def permission_allowed(datasette: Any, actor: Any, action: str, resource: Any) -> bool | None:
    # Datasette keeps the last definite answer of all plugins; this one registers after the
    # defaults, so its refusal stands. None leaves reads to Datasette's usual checks.
    if action not in READ_ACTIONS:
        return False
    return None


@hookimpl  # type: ignore[untyped-decorator,misc]
def prepare_connection(conn: Any) -> None:
    # Datasette shares the proxy's event loop and memory: no query may build huge values or
    # return a huge result (explore/limits.py).
    bound_connection(conn)
