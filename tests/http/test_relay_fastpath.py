"""The relay's fast path, counted over a real loopback stream: whatever upstream bytes one read
brings go downstream in one write, never one write per event.

Not a timing test: it counts the proxy's socket writes to its client while one streamed call is
relayed. A backend that writes a whole 40-event answer (40 HTTP
chunks) at once must cost the proxy a handful of downstream writes; a relay that went back to
one write per chunk or per event (httpx's reader, a per-event loop) makes 40 or more.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import query, running_proxy
from thunderproxy.bench.relay.relay_floor import requests
from thunderproxy.http.app import ProxyHTTPConnection
from thunderproxy.http.fastpath import FastRoutes
from thunderproxy.http.front import Connection

EVENTS = 40
METRICS = (
    b"# TYPE vllm:cache_config_info gauge\n"
    b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n'
)


def _chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def burst_answer(events: int) -> bytes:
    """A streamed chat answer as one write: head, ``events`` token chunks and the usage chunk,
    each its own HTTP chunk, and the end."""
    token = {"choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": events}}
    body = [_chunked(b"data: " + json.dumps(token).encode() + b"\n\n") for _ in range(events)]
    body.append(_chunked(b"data: " + json.dumps(usage).encode() + b"\n\n"))
    body.append(_chunked(b"data: [DONE]\n\n"))
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    return head + b"".join(body) + b"0\r\n\r\n"


def plain(status: int, body: bytes, content_type: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        content_type,
        len(body),
        body,
    )


async def serve_burst_backend(stream: trio.SocketStream) -> None:
    """A plain-socket backend, so that how its answer is split into writes is exact."""
    async for request in requests(stream):
        path = request.target
        if path == b"/v1/chat/completions":
            await stream.send_all(burst_answer(EVENTS))
        else:
            await answer_the_rest(stream, path)


async def answer_the_rest(stream: trio.SocketStream, path: bytes) -> None:
    """What a plain-socket backend answers besides its completions: its metrics, its one
    model ``m``, and an empty 200 to anything else."""
    if path == b"/metrics":
        await stream.send_all(plain(200, METRICS, b"text/plain"))
    elif path == b"/v1/models":
        models = json.dumps({"object": "list", "data": [{"id": "m"}]}).encode()
        await stream.send_all(plain(200, models, b"application/json"))
    else:
        await stream.send_all(plain(200, b"", b"text/plain"))


@asynccontextmanager
async def proxy_before_burst_backend(
    db: Path, **overrides: Any
) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """A proxy recording to ``db`` in front of the burst backend, and a client of the proxy."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, serve_burst_backend, 0, host="127.0.0.1")
        )
        backend_port = listeners[0].socket.getsockname()[1]
        async with (
            running_proxy(
                db,
                backends=f"http://127.0.0.1:{backend_port}",
                metrics_interval=600.0,
                datasette=False,
                **overrides,
            ) as proxy,
            httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
        ):
            yield proxy, client
        nursery.cancel_scope.cancel()


class SocketCounter:
    """Counts the server side's socket writes (Hypercorn's, through trio's SocketStream, and
    the HTTP front's) by the local port of the socket: the proxy's port counts its writes to
    its clients."""

    def __init__(self) -> None:
        self.sends: Counter[int] = Counter()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        send_all = trio.SocketStream.send_all

        async def counted_send(self_: trio.SocketStream, data: Any) -> None:
            self.sends[self_.socket.getsockname()[1]] += 1
            await send_all(self_, data)

        monkeypatch.setattr(trio.SocketStream, "send_all", counted_send)
        # The HTTP front writes to its clients' sockets directly.
        front_write = Connection._write

        async def counted_write(self_: Connection, data: bytes) -> None:
            self.sends[self_.sock.getsockname()[1]] += 1
            await front_write(self_, data)

        monkeypatch.setattr(Connection, "_write", counted_write)


async def relay_one_stream(
    tmp_path: Path, counter: SocketCounter, check: Callable[[int, list[str]], Awaitable[None]]
) -> None:
    db = tmp_path / "audit.db"
    async with proxy_before_burst_backend(db) as (proxy, client):
        proxy_port = int(proxy.url.rsplit(":", 1)[1])
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with trio.fail_after(30):
            counter.sends.clear()
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = [line async for line in response.aiter_lines() if line]
            writes = counter.sends[proxy_port]
        await check(writes, lines)
    (step,) = query(db, "select status, completion_tokens, prompt_tokens from steps")
    # Usage was read on the way, though the client never saw the usage chunk.
    assert step == {"status": 200, "completion_tokens": EVENTS, "prompt_tokens": 7}


async def test_a_burst_of_events_goes_downstream_in_a_few_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = SocketCounter()
    counter.install(monkeypatch)

    async def check(writes: int, lines: list[str]) -> None:
        # Everything the client asked for, and the usage chunk it did not ask for hidden.
        assert lines.count('data: {"choices": [{"index": 0, "delta": {"content": " tok"}, '
                           '"finish_reason": null}]}') == EVENTS  # fmt: skip
        assert lines[-1] == "data: [DONE]"
        assert not any('"usage"' in line for line in lines)
        # The backend wrote the whole answer at once: the response head, the body in one or
        # two pieces (the proxy's first read may end mid-answer) and the last chunk (the
        # front sends the head with the first piece). None counted: the count missed a writer.
        assert 1 <= writes <= 4, f"{writes} downstream writes for {EVENTS} events at once"

    await relay_one_stream(tmp_path, counter, check)


class TaskCounter(trio.abc.Instrument):
    """Counts the trio tasks spawned while it is installed."""

    def __init__(self) -> None:
        self.spawned = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.spawned += 1


async def relay_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, front: str = "fast"
) -> dict[str, int]:
    """One streamed call on a warm keep-alive connection: how many exchanges went through
    Quart, through the fast path and through the HTTP front (``--http-front``), and how many
    tasks the proxy spawned for it."""
    await trio.Path(tmp_path).mkdir()
    seen: Counter[str] = Counter()
    quart_call = ProxyHTTPConnection.__call__
    fast_call = FastRoutes.__call__

    async def counted_quart(self_: ProxyHTTPConnection, *args: Any) -> None:
        seen["quart"] += 1
        await quart_call(self_, *args)

    async def counted_fast(self_: FastRoutes, *args: Any) -> None:
        seen["fast"] += 1
        await fast_call(self_, *args)

    async def counted_front(self_: Connection, *args: Any) -> None:
        seen["front"] += 1
        await front_exchange(self_, *args)

    front_exchange = Connection._exchange
    monkeypatch.setattr(ProxyHTTPConnection, "__call__", counted_quart)
    monkeypatch.setattr(FastRoutes, "__call__", counted_fast)
    monkeypatch.setattr(Connection, "_exchange", counted_front)
    async with proxy_before_burst_backend(tmp_path / "audit.db", http_front=front) as (_, client):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with trio.fail_after(30):
            # The first call opens the client's connection and the backend's: not counted.
            for counted in (False, True):
                seen.clear()
                tasks = TaskCounter()
                if counted:
                    trio.lowlevel.add_instrument(tasks)
                try:
                    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                        assert response.status_code == 200
                        assert [line async for line in response.aiter_lines() if line]
                finally:
                    if counted:
                        trio.lowlevel.remove_instrument(tasks)
    return {**seen, "tasks": tasks.spawned}


async def test_a_streamed_call_skips_quart_hypercorn_and_their_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = await relay_counted(tmp_path / "fast", monkeypatch)
    # The same call served by Hypercorn instead of the front (--http-front hypercorn).
    hypercorn = await relay_counted(tmp_path / "hypercorn", monkeypatch, "hypercorn")
    # The same call with the fast path turned away: Quart's route serves it.
    monkeypatch.setattr(FastRoutes, "route", staticmethod(lambda scope: None))
    quart = await relay_counted(tmp_path / "quart", monkeypatch, "hypercorn")
    assert fast == {"front": 1, "fast": 1, "tasks": fast["tasks"]}, fast
    assert hypercorn == {"fast": 1, "tasks": hypercorn["tasks"]}, hypercorn
    assert quart == {"quart": 1, "tasks": quart["tasks"]}, quart
    # Hypercorn spawns two tasks per request (the request's, and its idle-connection
    # watcher), which the front does not; quart-trio adds a nursery of two to Hypercorn's,
    # the fast path one (the disconnect watcher).
    assert hypercorn["tasks"] == quart["tasks"] - 1, (hypercorn, quart)
    assert fast["tasks"] == hypercorn["tasks"] - 2, (fast, hypercorn)


async def answers(tmp_path: Path) -> list[tuple[int, dict[str, str], bytes]]:
    """Status, headers (less the date) and body of a few refused and answered calls, and the
    rejection rows they left."""
    await trio.Path(tmp_path).mkdir()
    hi = [{"role": "user", "content": "hi"}]
    requests: list[tuple[str, bytes, dict[str, bytes]]] = [
        ("/v1/chat/completions", b"{not json", {}),
        ("/v1/chat/completions", json.dumps({"model": "nope", "messages": hi}).encode(), {}),
        ("/v1/messages", json.dumps({"model": "m"}).encode(), {}),
        ("/v1/chat/completions", json.dumps({"model": "m", "messages": hi}).encode(), {}),
        ("/v1/chat/completions", b"{}", {"x-program-id": b"\xff"}),
        ("/v1/responses", b"[]", {}),
    ]
    seen: list[tuple[int, dict[str, str], bytes]] = []
    db = tmp_path / "audit.db"
    # 'none': the unknown model is refused (404), not sent to the one model the backend serves.
    async with proxy_before_burst_backend(db, default_model="none") as (_, client):
        for path, content, headers in requests:
            r = await client.post(path, content=content, headers=headers)
            kept = {k: v for k, v in r.headers.items() if k not in ("date", "x-request-id")}
            seen.append((r.status_code, kept, r.content))
    rows = query(db, "select method, path, status, error_type, message from rejections")
    seen.append((len(rows), {}, json.dumps(rows).encode()))
    return seen


async def test_the_fast_path_answers_as_the_quart_route_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = await answers(tmp_path / "fast")
    monkeypatch.setattr(FastRoutes, "route", staticmethod(lambda scope: None))
    quart = await answers(tmp_path / "quart")
    assert [status for status, _, _ in fast[:-1]] == [400, 404, 400, 200, 400, 400]
    assert fast == quart
