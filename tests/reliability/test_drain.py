"""SIGTERM with many streams in flight: a real ``serve`` process (embedded simulator), the
signal sent while some streams are still connecting, and every stream accounted for.

Every request either runs to its ``data: [DONE]`` with a 200 step row, or, if it reached the
proxy after the signal, gets a 503 with Retry-After and a rejection row. None may see a reset
or a cut stream, and the process exits 0 within --shutdown-grace.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from tests.conftest import query, spawn_serving
from thunderproxy.http.app import ThunderproxyApp
from thunderproxy.http.drain import Drain

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: Generous: the check is that nothing is lost, not how fast two shared cores decode.
GRACE = 60.0


@dataclass
class Run:
    streams: int
    signal_after: int
    outcomes: Counter[str] = field(default_factory=Counter)
    done: int = 0
    refused: int = 0
    steps: list[dict[str, object]] = field(default_factory=list)
    refusals: int = 0
    stop_s: float = 0.0


async def drain_run(tmp_path: Path, *, streams: int, signal_after: int, tokens: int) -> Run:
    """``streams`` concurrent streams; SIGTERM once ``signal_after`` have their first chunk."""
    db = tmp_path / f"drain-{streams}-{signal_after}.db"
    argv = [sys.executable, "-m", "thunderproxy", "serve", "--port", "0", "--db", str(db)]
    argv += ["--no-datasette", "--shutdown-grace", str(GRACE)]
    process, url = await spawn_serving(argv, dict(os.environ))
    run = Run(streams, signal_after)
    first_chunks = 0
    time_to_signal = trio.Event()
    limits = httpx.Limits(max_connections=streams * 2)

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        nonlocal first_chunks
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"{i}"}], "stream": True}
        headers = {"X-Sim-Output-Tokens": str(tokens), "X-Program-Id": f"drain-{i}"}
        text = ""
        try:
            async with client.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as r:
                async for chunk in r.aiter_text():
                    if not text:
                        first_chunks += 1
                        if first_chunks == signal_after:
                            time_to_signal.set()
                    text += chunk
        except httpx.HTTPError as exc:
            run.outcomes[f"{type(exc).__name__}: {exc}"] += 1
            return
        if r.status_code == 200 and text.endswith("data: [DONE]\n\n"):
            run.done += 1
            run.outcomes["done"] += 1
        elif r.status_code == 503 and r.headers.get("retry-after") and "shutting down" in text:
            run.refused += 1
            run.outcomes["503"] += 1
        else:
            run.outcomes[f"{r.status_code} {text[-200:]!r}"] += 1

    try:
        async with (
            httpx.AsyncClient(base_url=url, timeout=GRACE, limits=limits) as client,
            trio.open_nursery() as nursery,
        ):
            for i in range(streams):
                nursery.start_soon(stream, client, i)
            with trio.fail_after(GRACE):
                await time_to_signal.wait()
            signalled_at = trio.current_time()
            process.send_signal(signal.SIGTERM)
            # Drain stderr so the process never blocks on a full pipe while it logs.
            assert process.stderr is not None
            nursery.start_soon(_discard, process.stderr)
            with trio.fail_after(GRACE + 10):
                assert await process.wait() == 0
            run.stop_s = trio.current_time() - signalled_at
    finally:
        if process.returncode is None:
            process.kill()
    run.steps = query(db, "select status, count(*) as n from steps group by status")
    run.refusals = query(db, "select count(*) as n from rejections where status = 503")[0]["n"]
    return run


async def _discard(stream: trio.abc.ReceiveStream) -> None:
    while await stream.receive_some():
        pass


def check(run: Run) -> None:
    assert run.outcomes.keys() <= {"done", "503"}, run.outcomes
    assert run.done + run.refused == run.streams
    # Every stream that had started when the signal came ran to its end.
    assert run.done >= run.signal_after
    assert run.steps == [{"status": 200, "n": run.done}], run.steps
    assert run.refusals == run.refused
    assert run.stop_s < GRACE


async def test_an_idle_keep_alive_connection_does_not_hold_up_the_stop() -> None:
    # quart-trio ends a request by cancelling its nursery when Hypercorn reports the disconnect,
    # which Hypercorn does while it recycles the connection, just before it starts the watcher
    # that closes the connection on shutdown; started in a cancelled scope, that watcher died at
    # once and an idle client kept Hypercorn waiting for its whole graceful timeout.
    app = ThunderproxyApp("idle")
    app.drain = Drain()

    @app.get("/")
    async def index() -> str:
        return "ok"

    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 30.0
    stop = trio.Event()
    # The client stays open, its connection idle, while the server stops.
    async with httpx.AsyncClient() as client:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                urls = await nursery.start(partial(serve, app, config, shutdown_trigger=stop.wait))
                for _ in range(2):  # the second on the same, recycled connection
                    assert (await client.get(urls[0] + "/")).text == "ok"
                stop.set()


async def test_sigterm_drains_every_stream_and_refuses_the_rest_cleanly(tmp_path: Path) -> None:
    # The signal comes when the first stream has begun and most are still connecting: before
    # the two-phase drain, a third of them were reset with no audit row.
    run = await drain_run(tmp_path, streams=50, signal_after=1, tokens=40)
    check(run)


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(10))
async def test_sigterm_drains_200_streams_every_time(tmp_path: Path, attempt: int) -> None:
    signal_after = [1, 200, 50, 150, 1, 100, 200, 20, 180, 1][attempt]
    run = await drain_run(tmp_path, streams=200, signal_after=signal_after, tokens=60)
    print(
        f"attempt {attempt}: signal after {signal_after} first chunks: {run.done} done, "
        f"{run.refused} refused 503, stopped in {run.stop_s:.1f} s"
    )
    check(run)
