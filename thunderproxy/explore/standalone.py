"""``thunderproxy explore DB``: the same Datasette pages as ``serve`` mounts, for a db copied off a
server, served by uvicorn on plain asyncio.

``serve``'s explorer process (``child.py``) runs the same server on a Unix socket.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from . import MOUNT_PATH, READ_METHODS
from .instance import build_datasette, check_database

Scope = dict[str, Any]


def with_root_redirect(app: Any) -> Any:
    """``/`` and anything outside ``/datasette/`` redirect to ``/datasette/``, where Datasette
    lives (it keeps the mounted path so links copied from a server's pages still work); any
    method but GET and HEAD is refused."""

    async def redirecting(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        if scope["method"] not in READ_METHODS:
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


class Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # uvicorn raises the signal again once it has stopped gracefully, which ends the
        # process by that signal; like `serve`, `explore` exits 0 after a clean stop.
        self._captured_signals.clear()


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
    config = uvicorn.Config(
        with_root_redirect(ds.app()),
        lifespan="on",
        log_level="warning",
        access_log=False,
        loop="asyncio",
        http="h11",
    )
    server = Server(config)
    if ready is not None:
        # The socket already listens: connections made now wait in its backlog.
        ready(url)
    server.run(sockets=[sock])
