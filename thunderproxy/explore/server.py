"""Datasette, an asyncio app, served on Hypercorn's trio worker through trio-asyncio: the stack
the proxy itself runs on, used by the explorer's process (``child.py``).

Importing this module imports trio-asyncio, which patches asyncio process-wide: only the
explorer's process (and ``explore``) imports it, never the proxy. aiofiles (used by Datasette's
static files) binds ``asyncio.get_running_loop`` when it is first imported; a binding made before
the patch would fail every static file with "no running event loop", so :func:`_rebind_aiofiles`
points it at the patched function.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import trio
import trio_asyncio
from hypercorn.config import Config
from hypercorn.trio import serve

Scope = dict[str, Any]
ASGIApp = Any


def _rebind_aiofiles() -> None:
    base = sys.modules.get("aiofiles.base")
    if base is not None:
        base.get_running_loop = asyncio.get_running_loop  # type: ignore[attr-defined]


_rebind_aiofiles()


class DatasetteThreads(trio_asyncio.TrioExecutor):  # type: ignore[misc]
    """Runs Datasette's SQL in threads of its own, awaited from trio.

    Datasette runs its SQL through ``loop.run_in_executor(ds.executor)``, which trio-asyncio
    accepts only for a ``TrioExecutor``, hence the subclass. Datasette caches one SQLite
    connection per thread; these threads are Datasette's alone and never run anything else.
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
        # A cancelled request stops waiting; its query finishes in the thread (the time limit
        # ends it) and is dropped.
        await done.wait()
        return future.result()

    def shutdown(self, wait: bool | None = None) -> None:
        super().shutdown(wait)
        self._threads.shutdown(wait=bool(wait), cancel_futures=True)


def on_trio(app: ASGIApp) -> ASGIApp:
    """The asyncio ASGI ``app`` as a trio one: each call runs on the trio-asyncio loop that is
    open around the server, with trio's ``receive`` and ``send`` awaited from asyncio."""
    as_trio = trio_asyncio.aio_as_trio(app)

    async def call(scope: Scope, receive: Any, send: Any) -> None:
        await as_trio(scope, trio_asyncio.trio_as_aio(receive), trio_asyncio.trio_as_aio(send))

    return call


def hypercorn_config(bind: str, *, keep_alive_s: float, graceful_s: float) -> Config:
    config = Config()
    config.bind = [bind]
    config.accesslog = None
    config.loglevel = "WARNING"
    config.keep_alive_timeout = keep_alive_s
    config.graceful_timeout = graceful_s
    return config


async def _until_signal() -> None:
    # SIGTERM or SIGINT stops the server gracefully; the process then exits 0.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            return


async def serve_datasette(
    ds: Any,
    config: Config,
    *,
    sql_threads: int,
    wrap: Callable[[ASGIApp], ASGIApp] = lambda app: app,
    ready: Callable[[list[str]], None] | None = None,
) -> None:
    """Serve the Datasette ``ds`` (``wrap`` around its app) on Hypercorn as ``config`` binds it,
    until SIGTERM or SIGINT; ``ready(binds)`` once it listens and Datasette has started."""
    async with trio_asyncio.open_loop():
        ds.executor = threads = DatasetteThreads(sql_threads)
        try:
            async with trio.open_nursery() as nursery:
                binds: list[str] = await nursery.start(
                    partial(serve, wrap(on_trio(ds.app())), config, shutdown_trigger=_until_signal)
                )
                if ready is not None:
                    ready(binds)
        finally:
            threads.shutdown(wait=False)
