"""The HTTP/1.1 front (http/front.py) over real loopback connections: it serves the streamed
LLM routes itself, hands every other request to Hypercorn with the bytes it already read, and
answers malformed or oversized input exactly as Hypercorn does (the same proxy run with
``--http-front hypercorn`` is the reference)."""

from __future__ import annotations

import json
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer

from tests.conftest import query, running_proxy
from tests.http.test_relay_fastpath import answer_the_rest, burst_answer
from thunderproxy.bench.relay.relay_floor import requests
from thunderproxy.http.front import Connection, serve_front
from thunderproxy.sim.api.asgi import lifespan

CHAT = b"/v1/chat/completions"
BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
).encode()


#: The big answer: this many events of ``EVENT_BYTES`` each, far more than the sockets between
#: the backend and the client can hold (the client's receive buffer is set small; the proxy's
#: own buffers are the kernel's, up to a few tens of MB), and more than ``AHEAD``, so that a
#: proxy that buffered the whole answer fails the test.
EVENTS = 4_000
EVENT_BYTES = 16 * 1024
BIG = EVENTS * EVENT_BYTES
#: What the backend may be ahead of the client: the kernel's socket buffers on the way.
AHEAD = 48 * 1024 * 1024
sent_by_backend = [0]


async def send_big_answer(stream: trio.SocketStream) -> None:
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    await stream.send_all(head + b"transfer-encoding: chunked\r\n\r\n")
    token = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
    event = b"data: " + json.dumps(token).encode() + b"\n\n"
    event = event.replace(b'"x"', b'"' + b"x" * (EVENT_BYTES - len(event) + 1) + b'"')
    assert len(event) == EVENT_BYTES
    for _ in range(EVENTS):
        await stream.send_all(b"%x\r\n%b\r\n" % (len(event), event))
        sent_by_backend[0] += len(event)
    await stream.send_all(b"%x\r\n%b\r\n0\r\n\r\n" % (14, b"data: [DONE]\n\n"))


async def serve_backend(release: trio.Event, stream: trio.SocketStream) -> None:
    """A plain-socket backend: a whole streamed answer at once, except to a prompt of
    ``slow``, whose answer stops after its first chunk until ``release`` is set."""
    async for request in requests(stream):
        if request.target == CHAT and b'"slow"' in request.body:
            answer = burst_answer(4)
            first = answer.index(b"\r\n\r\n") + 4
            first = answer.index(b"\r\n", answer.index(b"\r\n", first) + 2) + 2
            await stream.send_all(answer[:first])
            await release.wait()
            await stream.send_all(answer[first:])
        elif request.target == CHAT and b'"big"' in request.body:
            await send_big_answer(stream)
        elif request.target == CHAT:
            await stream.send_all(burst_answer(4))
        else:
            await answer_the_rest(stream, request.target)


@asynccontextmanager
async def proxy(
    db: Path, release: trio.Event | None = None, **overrides: Any
) -> AsyncIterator[Any]:
    async with trio.open_nursery() as nursery:
        serve = partial(serve_backend, trio.Event() if release is None else release)
        listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        settings = {"metrics_interval": 600.0, "datasette": False, **overrides}
        async with running_proxy(db, backends=f"http://127.0.0.1:{port}", **settings) as running:
            yield running
        nursery.cancel_scope.cancel()


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def post(path: bytes, body: bytes, *extra: bytes) -> bytes:
    head = [b"POST %s HTTP/1.1" % path, b"host: proxy", b"content-length: %d" % len(body)]
    return b"\r\n".join([*head, *extra, b"", b""]) + body


async def exchange_raw(url: str, data: bytes, *, then: bytes = b"") -> bytes:
    """Send ``data`` (and ``then`` once something came back) on one connection; everything the
    server sends until it closes the connection."""
    stream = await trio.open_tcp_stream(*address(url))
    seen = b""
    async with stream:
        with trio.fail_after(20):
            try:
                await stream.send_all(data)
                while chunk := await stream.receive_some():
                    seen += chunk
                    if then:
                        await stream.send_all(then)
                        then = b""
            except trio.BrokenResourceError:
                pass  # reset: the server closed with bytes of ours unread (413, 408, 431)
    return seen


def responses(raw: bytes, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """The first ``count`` responses in ``raw``: status, headers (less the date) and body."""
    client = h11.Connection(h11.CLIENT)
    client.receive_data(raw)
    found: list[tuple[int, dict[str, str], bytes]] = []
    for _ in range(count):
        client.send(h11.Request(method="POST", target="/", headers=[("host", "x")]))
        client.send(h11.EndOfMessage())
        status, headers, body = 0, {}, b""
        while True:
            event = client.next_event()
            if isinstance(event, h11.Response):
                status = event.status_code
                headers = {
                    n.decode(): v.decode()
                    for n, v in event.headers
                    if n not in (b"date", b"x-request-id")
                }
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                raise AssertionError(f"incomplete response: {event!r} in {raw!r}")
        found.append((status, headers, body))
        if client.our_state is h11.DONE and client.their_state is h11.DONE:
            client.start_next_cycle()
    return found


@asynccontextmanager
async def front_alone(app: Any) -> AsyncIterator[str]:
    """``app`` served by the front alone on a loopback port; its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_front, app, Config(), sock, shutdown_trigger=stop.wait))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        stop.set()


class Counted:
    """How many exchanges the front served itself, and how many connections it handed to
    Hypercorn (counted where each starts)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: Counter[str] = Counter()
        exchange = Connection._exchange
        hypercorn = TCPServer.run

        async def counted_exchange(self_: Connection, request: Any) -> None:
            self.seen["front"] += 1
            await exchange(self_, request)

        async def counted_hypercorn(self_: TCPServer) -> None:
            self.seen["hypercorn"] += 1
            await hypercorn(self_)

        monkeypatch.setattr(Connection, "_exchange", counted_exchange)
        monkeypatch.setattr(TCPServer, "run", counted_hypercorn)


async def test_pipelined_calls_are_answered_in_order_and_the_rest_goes_to_hypercorn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = Counted(monkeypatch)
    async with proxy(tmp_path / "audit.db") as running:
        # Two streamed calls and a GET, in one write: the front answers the two, then hands
        # the connection, with the GET it has already read, to Hypercorn.
        data = post(CHAT, BODY) + post(CHAT, BODY) + b"GET /health HTTP/1.1\r\nhost: p\r\n\r\n"
        raw = await exchange_raw(running.url, data, then=b"GET /v1/models HTTP/1.1\r\n\r\n")
        # (the last request has no Host: Hypercorn's h11 refuses it and closes the connection)
    first, second, health, refused = responses(raw, 4)
    for status, headers, body in (first, second):
        assert status == 200
        assert headers["transfer-encoding"] == "chunked"
        assert headers["server"] == "hypercorn-h11"
        assert body.count(b'"content": " tok"') == 4
        assert body.endswith(b"data: [DONE]\n\n")
    assert health[0] == 200
    assert json.loads(health[2])["status"] in ("ok", "degraded")
    assert refused[0] == 400
    assert counted.seen == {"front": 2, "hypercorn": 1}
    steps = query(tmp_path / "audit.db", "select status from steps")
    assert steps == [{"status": 200}, {"status": 200}]


async def test_http2_with_prior_knowledge_is_hypercorns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = Counted(monkeypatch)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    settings = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame
    async with proxy(tmp_path / "audit.db") as running:
        stream = await trio.open_tcp_stream(*address(running.url))
        async with stream:
            await stream.send_all(preface + settings)
            with trio.fail_after(20):
                seen = b""
                while len(seen) < 9:
                    seen += await stream.receive_some()
    # Hypercorn's HTTP/2 answers with its own SETTINGS frame (type 4 on stream 0).
    assert seen[3] == 4
    assert seen[5:9] == b"\x00\x00\x00\x00"
    assert counted.seen == {"hypercorn": 1}


async def answers_to(tmp_path: Path, front: str, cases: list[bytes]) -> list[Any]:
    await trio.Path(tmp_path).mkdir()
    seen: list[Any] = []
    async with proxy(tmp_path / "audit.db", http_front=front, client_timeout=0.5) as running:
        for case in cases:
            raw = await exchange_raw(running.url, case)
            seen.append(responses(raw, 1)[0] if raw else None)
    return seen


async def test_malformed_oversized_and_slow_requests_are_answered_as_hypercorn_answers(
    tmp_path: Path,
) -> None:
    big = b"x-big: " + b"a" * 140_000
    cases = [
        b"POST /v1/chat/completions HTTP/1.1\r\nhost x\r\n\r\n",  # not a header line
        b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}",  # no Host
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: z\r\n\r\n",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # a TLS hello on the plain port
        post(CHAT, BODY, big)[:100_000],  # 431 from h11: a head past --max-header-bytes
        post(CHAT, BODY, b"x-big: " + b"a" * 65_500),  # 431 from the route's own count
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999\r\n\r\n",
        post(CHAT, b"{}")[:-1],  # 408: the body never ends (--client-timeout 0.5)
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n",  # a head that never ends
        # Not a POST: Hypercorn's, and the passthrough's refusal (403)
        b"GET /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        post(CHAT, BODY, b"connection: close"),  # served, then closed as asked
    ]
    front = await answers_to(tmp_path / "front", "fast", cases)
    hypercorn = await answers_to(tmp_path / "hypercorn", "hypercorn", cases)
    statuses = [None if answer is None else answer[0] for answer in front]
    assert statuses == [400, 400, 400, 400, 431, 431, 413, 408, None, 403, 200]
    assert front == hypercorn


async def test_another_route_and_a_websocket_after_a_call_on_one_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = Counted(monkeypatch)
    async with proxy(tmp_path / "audit.db") as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20) as client:
            first = await client.post("/v1/chat/completions", content=BODY)
            health = await client.get("/health")  # same keep-alive connection
            later = await client.post("/v1/chat/completions", content=BODY)
        assert (first.status_code, health.status_code, later.status_code) == (200, 200, 200)
        # The GET moved the first connection to Hypercorn for good: the third call was
        # Hypercorn's too.
        assert counted.seen == {"front": 1, "hypercorn": 1}
        upgrade = (
            b"GET /ws HTTP/1.1\r\nhost: p\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
            b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        raw = await exchange_raw(running.url, post(CHAT, BODY) + upgrade)
    call, websocket = responses(raw, 2)
    assert call[0] == 200
    # The app serves no websocket (the passthrough's catch-all route is HTTP only): Hypercorn
    # ran the handshake and answered the app's refusal, in the errors table's shape.
    assert websocket[0] == 400, websocket
    assert json.loads(websocket[2])["error"]["type"] == "invalid_request_error"
    assert counted.seen == {"front": 2, "hypercorn": 2}


async def test_a_client_that_leaves_mid_stream_cancels_its_exchange(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    release = trio.Event()
    async with proxy(db, release) as running:
        body = json.loads(BODY)
        body["program_id"] = "slow"
        body["messages"][0]["content"] = "slow"
        stream = await trio.open_tcp_stream(*address(running.url))
        await stream.send_all(post(CHAT, json.dumps(body).encode()))
        with trio.fail_after(20):
            seen = b""
            while b'"content": " tok"' not in seen:
                seen += await stream.receive_some()
        await stream.aclose()  # gone after the first token
        with trio.fail_after(20):
            while not query(db, "select status from steps"):
                await trio.sleep(0.02)
        program = running.services.scheduler.registry.get("slow")
        assert program is not None
        assert program.in_flight == 0
        release.set()
    assert query(db, "select status from steps") == [{"status": 499}]


async def test_a_client_that_reads_slowly_holds_the_backend_back(tmp_path: Path) -> None:
    """Backpressure: what the backend could send is bounded by what the client has read plus
    the sockets' buffers; a proxy that buffered without bound would take the whole answer."""
    sent_by_backend[0] = 0
    body = json.loads(BODY)
    body["messages"][0]["content"] = "big"
    async with proxy(tmp_path / "audit.db") as running:
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        await sock.connect(address(running.url))
        stream = trio.SocketStream(sock)
        async with stream:
            await stream.send_all(post(CHAT, json.dumps(body).encode()))
            received = 0
            done = False
            with trio.fail_after(60):
                while not done:
                    # Everything in this process (backend, proxy) waits: the client reads
                    # nothing meanwhile, so the backend is as far ahead as it can get.
                    await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                    ahead = sent_by_backend[0] - received
                    assert ahead < AHEAD, f"backend {ahead} bytes ahead of the client"
                    for _ in range(64):  # then read some: a few MB
                        data = await stream.receive_some(64 * 1024)
                        received += len(data)
                        if done := data.endswith(b"0\r\n\r\n"):
                            break
        assert received > BIG
        assert sent_by_backend[0] == BIG
    assert query(tmp_path / "audit.db", "select status from steps") == [{"status": 200}]


async def test_the_stop_closes_idle_connections_and_lets_a_stream_finish(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    release = trio.Event()
    body = json.loads(BODY)
    body["messages"][0]["content"] = "slow"
    async with proxy(db, release, shutdown_grace=20.0) as running:
        # An idle keep-alive connection that served a call, and a stream in flight.
        idle = await trio.open_tcp_stream(*address(running.url))
        busy = await trio.open_tcp_stream(*address(running.url))
        async with idle, busy:
            await idle.send_all(post(CHAT, BODY))
            await busy.send_all(post(CHAT, json.dumps(body).encode()))
            with trio.fail_after(20):
                seen = streamed = b""
                while not seen.endswith(b"0\r\n\r\n"):
                    seen += await idle.receive_some()
                while b'"content": " tok"' not in streamed:
                    streamed += await busy.receive_some()
            started = time.monotonic()
            running.shutdown.set()
            # Draining: a new call on another connection is refused, and told to close.
            late = await exchange_raw(running.url, post(CHAT, BODY))
            ((status, headers, _),) = responses(late, 1)
            assert (status, headers.get("connection")) == (503, "close")
            # The stream goes on to its end; then the stop closes both connections.
            release.set()
            with trio.fail_after(20):
                while chunk := await busy.receive_some():
                    streamed += chunk
                assert await idle.receive_some() == b""
        # Well within the 20 s grace: the idle connection did not hold the stop.
        assert time.monotonic() - started < 10
    assert streamed.endswith(b"0\r\n\r\n")
    assert query(db, "select status from steps") == [{"status": 200}, {"status": 200}]


async def test_an_app_that_starts_an_answer_and_returns_still_sends_its_head() -> None:
    """An app that ends without its body, or raises before answering: the client gets the
    head (then the close), or a 500, never a silent close."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        await receive()
        if scope["path"] == "/v1/completions":
            raise RuntimeError("the app failed before answering")
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async with front_alone(app) as url:
        started = await exchange_raw(url, post(CHAT, BODY))
        assert started.startswith(b"HTTP/1.1 200 ")
        assert b"transfer-encoding: chunked" in started.lower()
        failed = await exchange_raw(url, post(b"/v1/completions", BODY))
        assert responses(failed, 1)[0][0] == 500


async def test_a_body_through_the_writer_is_the_body_through_messages() -> None:
    """The front offers the relay a body writer (``BODY_WRITER``); what it writes is byte for
    byte what the same chunks sent as ASGI messages write."""
    from thunderproxy.http.fastpath import BODY_WRITER

    chunks = [b"data: one\n\n", b"", b"data: two\r\n\r\n", b"x" * 70_000]
    offered: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        await receive()
        writer = scope["extensions"].get(BODY_WRITER)
        offered.append(writer is not None)
        head = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        for chunk in chunks:
            if scope["path"] == "/v1/completions":
                await writer(chunk)
            else:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async with front_alone(app) as url:
        by_messages = await exchange_raw(url, post(CHAT, BODY))
        by_writer = await exchange_raw(url, post(b"/v1/completions", BODY))
    assert offered == [True, True]

    def without_date(raw: bytes) -> bytes:
        return b"\r\n".join(line for line in raw.split(b"\r\n") if not line.startswith(b"date:"))

    assert without_date(by_writer) == without_date(by_messages)
    assert responses(by_writer, 1)[0][2] == b"".join(chunks)


async def test_a_streamed_answers_head_reaches_the_client_before_its_first_chunk() -> None:
    """The head of a streamed answer goes out when the app starts it: a client reads it while
    the backend still works on the first token, not after it, in its time to first token."""
    first_chunk = trio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        await receive()
        head = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await first_chunk.wait()
        await send({"type": "http.response.body", "body": b"data: one\n\n", "more_body": False})

    async with front_alone(app) as url:
        stream = await trio.open_tcp_stream(*address(url))
        async with stream:
            await stream.send_all(post(CHAT, BODY))
            seen = b""
            with trio.fail_after(10):
                while b"\r\n\r\n" not in seen:
                    seen += await stream.receive_some()
                assert seen.startswith(b"HTTP/1.1 200 ")
                first_chunk.set()
                while not seen.endswith(b"0\r\n\r\n"):
                    seen += await stream.receive_some()
    ((status, headers, body),) = responses(seen, 1)
    assert (status, headers["content-type"], body) == (200, "text/event-stream", b"data: one\n\n")
