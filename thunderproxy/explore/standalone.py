"""``thunderproxy explore DB``: the same Datasette pages as ``serve`` mounts, for a db copied off a
server, on Hypercorn's trio worker through trio-asyncio (``server.py``).

``serve``'s explorer process (``child.py``) runs the same server on a Unix socket.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from .instance import SETTINGS, build_datasette, check_database
from .names import MOUNT_PATH, PROBE_PATH, READ_METHODS
from .server import hypercorn_config, serve_datasette

Scope = dict[str, Any]


def with_root_redirect(app: Any) -> Any:
    """``/`` and anything outside ``/datasette/`` redirect to ``/datasette/``, where Datasette
    lives (it keeps the mounted path so links copied from a server's pages still work); any
    method but GET and HEAD is refused. ``PROBE_PATH`` is answered 200 here, on the server's
    own event loop: the proxy asks it every second whether the process still answers."""

    async def redirecting(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        if scope["path"] == PROBE_PATH:
            status, headers = 200, []
        elif scope["method"] not in READ_METHODS:
            status, headers = 405, [(b"allow", b"GET, HEAD")]
        elif scope["path"].startswith(MOUNT_PATH):
            await app(scope, receive, send)
            return
        else:
            status, headers = 302, [(b"location", MOUNT_PATH.encode())]
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*headers, (b"content-length", b"0")],
            }
        )
        await send({"type": "http.response.body", "body": b""})

    return redirecting


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free one (the caller reads it back)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def serve_standalone(
    db_path: str, *, host: str, port: int, ready: Callable[[str], None] | None = None
) -> None:
    """Serve Datasette on ``db_path`` until SIGINT/SIGTERM; ``ready(url)`` once it listens."""
    check_database(db_path)
    ds = build_datasette(db_path)
    sock = bind(host, port)
    shown_host = f"[{host}]" if ":" in host else host
    url = f"http://{shown_host}:{sock.getsockname()[1]}{MOUNT_PATH}"
    # Hypercorn takes over the bound socket (a busy port was refused above, as an OSError).
    config = hypercorn_config(f"fd://{sock.detach()}", keep_alive_s=5.0, graceful_s=3.0)

    def started(_binds: list[str]) -> None:
        if ready is not None:
            ready(url)

    run_explorer(ds, config, started)


def run_explorer(ds: Any, config: Any, ready: Callable[[list[str]], None]) -> None:
    """Serve the Datasette ``ds`` as the explorer serves it (its SQL threads, ``/`` redirected
    to the audit db) on Hypercorn as ``config`` binds it, until SIGTERM or SIGINT; ``ready`` once
    it listens. The proxy's explorer process and ``thunderproxy explore`` both run this."""
    trio.run(
        partial(
            serve_datasette,
            ds,
            config,
            sql_threads=SETTINGS["num_sql_threads"],
            wrap=with_root_redirect,
            ready=ready,
        )
    )
