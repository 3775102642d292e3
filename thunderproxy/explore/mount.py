"""Datasette inside the proxy's trio process, on the proxy's port, under ``/datasette/``.

Datasette is an asyncio app; trio-asyncio runs it inside a loop opened in the proxy's nursery,
and :class:`DatasetteMount` hands it the requests whose path starts with ``/datasette`` (one
string comparison; every other request goes straight to the proxy app).

Importing this module imports trio-asyncio, which patches asyncio process-wide: only the
``--datasette`` path imports it. aiofiles (used by Quart and by Datasette's static files) binds
``asyncio.get_running_loop`` when it is first imported; if Quart came first, that binding predates
the patch and every static file would fail with "no running event loop". The CLI imports this
module before Quart to avoid that, and :func:`_rebind_aiofiles` repairs the binding for callers
that imported Quart first (tests, embedding code).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio_asyncio

from ..http.auth import admin_allowed
from . import MOUNT_PATH, READ_METHODS
from .instance import build_datasette

#: ``/datasette``: requests for it are redirected to ``/datasette/``.
PREFIX = MOUNT_PATH.rstrip("/")
#: Worker threads Datasette's SQL queries run in (a trio capacity limiter bounds them).
SQL_THREADS = 3

Scope = dict[str, Any]
Receive = Any
Send = Any
ASGIApp = Any


def _rebind_aiofiles() -> None:
    base = sys.modules.get("aiofiles.base")
    if base is not None:
        base.get_running_loop = asyncio.get_running_loop  # type: ignore[attr-defined]


_rebind_aiofiles()


class DatasetteThreads(trio_asyncio.TrioExecutor):  # type: ignore[misc]
    """Runs Datasette's SQL in threads of its own, awaited from trio.

    Datasette caches one SQLite connection per thread, keyed by the database's name. trio's
    worker threads are shared by the whole process and outlive a proxy run, so with them a
    later Datasette (a second proxy in one process, as in tests) would find an earlier one's
    connection, to another file, and read that. Private threads end with their Datasette.
    trio-asyncio only accepts a ``TrioExecutor``, hence the subclass.
    """

    def __init__(self, max_workers: int) -> None:
        super().__init__(max_workers=max_workers)
        self._threads = ThreadPoolExecutor(max_workers, thread_name_prefix="datasette-sql")

    async def submit(self, func: Callable[..., Any], *args: Any) -> Any:
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake(_: Future[Any]) -> None:
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass  # nobody is waiting any more

        future = self._threads.submit(func, *args)
        future.add_done_callback(wake)
        # A cancelled request stops waiting; its query finishes in the thread and is dropped.
        await done.wait()
        return future.result()

    def shutdown(self, wait: bool | None = None) -> None:
        super().shutdown(wait)
        self._threads.shutdown(wait=bool(wait), cancel_futures=True)


def request_allowed(scope: Scope, admin_token: str) -> bool:
    """Whether a request under ``/datasette/`` may reach Datasette: with ``--admin-token``, only
    one that carries it (as a bearer token, or as the password of HTTP Basic auth so that a
    browser can ask for it)."""
    authorization = None
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            authorization = value.decode("latin-1")
    return admin_allowed(authorization, admin_token)


async def _respond(send: Send, status: int, body: dict[str, Any], headers: list[Any]) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class DatasetteMount:
    """The ASGI app Hypercorn serves when Datasette is on: ``/datasette/...`` goes to
    Datasette through trio-asyncio, everything else (lifespan included) to the proxy app."""

    def __init__(self, app: ASGIApp, datasette_app: ASGIApp, *, admin_token: str = "") -> None:
        self.app = app
        self.datasette = trio_asyncio.aio_as_trio(datasette_app)
        self.admin_token = admin_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        # The proxy's hot path pays for this one comparison and nothing else.
        if not path.startswith(PREFIX) or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if path != PREFIX and not path.startswith(MOUNT_PATH):
            await self.app(scope, receive, send)  # e.g. /datasette-foo is the backend's
            return
        if not request_allowed(scope, self.admin_token):
            error = {
                "message": "The audit log needs the admin token (--admin-token): send it as "
                "'Authorization: Bearer <token>', or as the password when the browser asks.",
                "type": "authentication_error",
            }
            challenge = (b"www-authenticate", b'Basic realm="thunderproxy"')
            await _respond(send, 401, {"error": error}, [challenge])
            return
        if scope["method"] not in READ_METHODS:
            # Read-only: no form, API or canned query of the explorer takes a write.
            error = {"message": "The audit log is read-only.", "type": "method_not_allowed"}
            await _respond(send, 405, {"error": error}, [(b"allow", b"GET, HEAD")])
            return
        if path == PREFIX:
            query = scope.get("query_string", b"")
            location = MOUNT_PATH.encode() + (b"?" + query if query else b"")
            await _respond(send, 302, {"location": location.decode()}, [(b"location", location)])
            return
        await self.datasette(
            scope, trio_asyncio.trio_as_aio(receive), trio_asyncio.trio_as_aio(send)
        )


@asynccontextmanager
async def open_datasette_mount(
    app: ASGIApp, db_path: str, *, admin_token: str = ""
) -> AsyncIterator[DatasetteMount]:
    """Datasette on the audit db at ``db_path`` in front of ``app``, inside a trio-asyncio loop
    that stays open until the block exits (after the HTTP server has drained)."""
    ds = build_datasette(db_path)
    try:
        async with trio_asyncio.open_loop():
            # Datasette runs its SQL through loop.run_in_executor(ds.executor), which
            # trio-asyncio accepts only for a TrioExecutor.
            ds.executor = threads = DatasetteThreads(SQL_THREADS)
            try:
                yield DatasetteMount(app, ds.app(), admin_token=admin_token)
            finally:
                threads.shutdown(wait=False)
    finally:
        for database in ds.databases.values():
            database.close()
