"""Run the simulator as an HTTP server: embedded (`open_simulator`, `serve_simulator`).

Both own one nursery holding the engine's step loop and hypercorn's trio worker.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from .api.app import SimApp
from .config import SimConfig
from .engine.core import Engine


@dataclass
class Simulator:
    """A running simulator: its base URL, engine (simulator truth) and ASGI app."""

    url: str
    engine: Engine
    app: SimApp


def _hypercorn_config(host: str, port: int) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.loglevel = "WARNING"
    # Agents idle between turns (tool calls) longer than hypercorn's 5 s default.
    config.keep_alive_timeout = 120.0
    config.graceful_timeout = 2.0
    # A proxy in front opens hundreds of connections at once under load.
    config.backlog = 4096
    return config


def _build(config: SimConfig, epoch: float | None) -> tuple[Engine, SimApp]:
    # The one wall-clock read: simulated second 0 as Unix time, for `created` fields.
    engine = Engine(config, epoch=time.time() if epoch is None else epoch)
    return engine, SimApp(engine)


@asynccontextmanager
async def open_simulator(
    config: SimConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    epoch: float | None = None,
) -> AsyncIterator[Simulator]:
    """Start engine and HTTP server; on exit, fail what is still in flight and stop."""
    engine, app = _build(config, epoch)
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        urls = await nursery.start(
            partial(
                serve, cast(Any, app), _hypercorn_config(host, port), shutdown_trigger=shutdown.wait
            )
        )
        try:
            yield Simulator(urls[0], engine, app)
        finally:
            # Failing in-flight requests first lets hypercorn drain at once instead of
            # waiting out its graceful timeout on open streams.
            app.stopping.set()
            engine.kill()
            shutdown.set()
            with trio.move_on_after(5):
                await app.wait_idle()
            nursery.cancel_scope.cancel()


async def serve_simulator(
    config: SimConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    epoch: float | None = None,
    shutdown_trigger: trio.Event | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled (or until `shutdown_trigger` is set, which drains first).

    Calls `task_status.started(url)` once the socket accepts connections.
    """
    engine, app = _build(config, epoch)
    trigger = shutdown_trigger if shutdown_trigger is not None else trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)

        async def stop_parked() -> None:
            await trigger.wait()
            app.stopping.set()

        nursery.start_soon(stop_parked)
        urls = await nursery.start(
            partial(
                serve, cast(Any, app), _hypercorn_config(host, port), shutdown_trigger=trigger.wait
            )
        )
        task_status.started(urls[0])
        await trigger.wait()
        with trio.move_on_after(5):
            await app.wait_idle()
        nursery.cancel_scope.cancel()
