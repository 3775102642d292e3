"""The relay's HTTP/1.1 client: de-chunking in any split, keep-alive reuse, a retry only for a
connection the server closed while idle, and an unfinished answer closing its connection."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from functools import partial

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderproxy.backends.base import UpstreamRequest
from thunderproxy.backends.h1 import ChunkedDecoder, Connection, H1Pool
from thunderproxy.errors import BackendProtocolError, BackendUnavailable

CHUNKED = b"5\r\nhello\r\n1;ext=1\r\n \r\n6\r\nworld!\r\n0\r\nx-trailer: 1\r\n\r\n"


@pytest.mark.parametrize("split", range(1, len(CHUNKED)))
def test_chunked_body_in_any_split(split: int) -> None:
    decoder = ChunkedDecoder()
    out = decoder.feed(CHUNKED[:split]) + decoder.feed(CHUNKED[split:])
    assert out == b"hello world!"
    assert decoder.done
    assert not decoder.extra


def test_chunked_body_byte_by_byte_and_whole() -> None:
    decoder = ChunkedDecoder()
    assert b"".join(decoder.feed(bytes([b])) for b in CHUNKED) == b"hello world!"
    whole = ChunkedDecoder()
    assert whole.feed(CHUNKED + b"HTTP/1.1") == b"hello world!"
    assert whole.done
    assert whole.extra  # bytes past the end: the connection is not reused


@pytest.mark.parametrize(
    "bad",
    [
        b"zz\r\nab\r\n",
        b"+5\r\nhello\r\n",
        b"2\r\nabXY",
        b"5" * 5000,
        b"5\r\nhelloXY",  # a whole chunk's length in one read, without its CRLF
        b"\r\nhello\r\n",  # no size at all
    ],
)
def test_malformed_framing_is_refused(bad: bytes) -> None:
    with pytest.raises(ValueError):
        ChunkedDecoder().feed(bad)


def frame(payload: bytes, extension: bytes = b"") -> bytes:
    return b"%x%b\r\n%b\r\n" % (len(payload), extension, payload)


def test_one_chunk_per_read_comes_out_as_its_data() -> None:
    """A stream read between chunks brings one whole chunk: its data, and the decoder is ready
    for the next chunk, whatever the data holds (CRLFs, hex digits, a size line's look)."""
    decoder = ChunkedDecoder()
    payloads = [b"data: {}\n\n", b"\r\n\r\n", b"a\r\n0\r\n\r\n", b"x" * 4097, b"5\r\nhello"]
    for payload in payloads:
        assert decoder.feed(frame(payload)) == payload
        assert not decoder.done
    assert decoder.feed(b"0\r\n\r\n") == b""
    assert decoder.done
    assert not decoder.extra


@settings(max_examples=200, deadline=None)
@given(
    payloads=st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=12),
    extension=st.sampled_from([b"", b";ext=1", b" "]),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=20),
    whole=st.booleans(),
)
def test_reads_of_whole_chunks_or_any_split_decode_alike(
    payloads: list[bytes], extension: bytes, cuts: list[int], whole: bool
) -> None:
    frames = [frame(p, extension) for p in payloads] + [b"0\r\n\r\n"]
    body = b"".join(frames)
    if whole:
        reads = frames  # one chunk per read, as a stream whose chunks come apart
    else:
        points = sorted({min(c, len(body)) for c in cuts} | {0, len(body)})
        reads = [body[a:b] for a, b in zip(points, points[1:], strict=False)]
    decoder = ChunkedDecoder()
    assert b"".join(decoder.feed(r) for r in reads) == b"".join(payloads)
    assert decoder.done
    assert not decoder.extra


ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n"


@asynccontextmanager
async def serving(backend: Callable[[trio.SocketStream], Awaitable[None]]) -> AsyncIterator[int]:
    """``backend`` serving loopback connections for the block; its port. Closed after it."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, backend, 0, host="127.0.0.1"))
        yield listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()


async def read_request(stream: trio.SocketStream) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        more = await stream.receive_some(65536)
        if not more:
            return None
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    sizes = [line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    length = int(sizes[0].split(b":")[1]) if sizes else 0
    while len(body) < length:
        body += await stream.receive_some(65536)
    return head


async def test_keep_alive_reuse_and_retry_after_an_idle_close() -> None:
    connections: list[int] = []
    heads: list[bytes] = []

    async def backend(stream: trio.SocketStream) -> None:
        connections.append(1)
        head = await read_request(stream)
        assert head is not None
        heads.append(head)
        await stream.send_all(ANSWER + b"2\r\nok\r\n0\r\n\r\n")
        if len(connections) == 1:
            head = await read_request(stream)  # the second request, on the same connection
            assert head is not None
            heads.append(head)
            await stream.send_all(ANSWER + b"3\r\nyes\r\n0\r\n\r\n")
        # Then this connection is closed while the client holds it idle.

    async with serving(backend) as port:
        pool = H1Pool(
            f"http://u:p%40ss@127.0.0.1:{port}/base", connect_timeout=5, max_connections=4
        )
        request = UpstreamRequest("POST", "/v1/x?q=1", [("x-a", "b")], b"{}")
        with trio.fail_after(10):
            first = await pool.send(request)
            assert await first.aread() == b"ok"
            second = await pool.send(request)
            assert (second.status_code, await second.aread()) == (200, b"yes")
            await trio.sleep(0.05)  # the server closes the idle connection meanwhile
            third = await pool.send(request)
            assert await third.aread() == b"ok"
        assert len(connections) == 2
        assert heads[0].startswith(b"POST /base/v1/x?q=1 HTTP/1.1\r\n")
        assert b"authorization: Basic dTpwQHNz" in heads[0]  # "u:p@ss", as httpx sends it
        assert b"content-length: 2" in heads[0]
        assert b"x-a: b" in heads[0]
        pool.close()


async def test_an_answer_closed_half_way_closes_its_connection() -> None:
    seen_end = trio.Event()

    async def backend(stream: trio.SocketStream) -> None:
        await read_request(stream)
        await stream.send_all(ANSWER + b"2\r\nok\r\n")
        with trio.fail_after(5):
            while await stream.receive_some(65536):
                pass
        seen_end.set()  # the backend learns the client left: it would abort the request

    async with serving(backend) as port:
        pool = H1Pool(f"http://127.0.0.1:{port}", connect_timeout=5, max_connections=1)
        with trio.fail_after(10):
            response = await pool.send(UpstreamRequest("POST", "/v1/x", [], b"{}"))
            async with aclosing(response.aiter_raw()) as chunks:
                assert await chunks.__anext__() == b"ok"
                await response.aclose()
            await seen_end.wait()
            assert not pool._idle


async def test_refused_and_malformed_answers_are_backend_errors() -> None:
    async def garbage(stream: trio.SocketStream) -> None:
        await read_request(stream)
        await stream.send_all(b"SPDY/9 200\r\n\r\n")

    async with serving(garbage) as port:
        pool = H1Pool(f"http://127.0.0.1:{port}", connect_timeout=5, max_connections=1)
        with pytest.raises(BackendProtocolError, match="malformed"):
            await pool.send(UpstreamRequest("POST", "/v1/x", [], b"{}"))
        # The slot of the failed request was given back.
        with pytest.raises(BackendProtocolError):
            await pool.send(UpstreamRequest("POST", "/v1/x", [], b"{}"))
    refused = H1Pool(f"http://127.0.0.1:{port}", connect_timeout=5, max_connections=1)
    with pytest.raises(BackendUnavailable, match="refused"):
        await refused.send(UpstreamRequest("POST", "/v1/x", [], b"{}"))


async def test_each_piece_must_come_within_the_read_timeout_of_being_asked_for() -> None:
    # Pieces 0.15 s apart under a 0.3 s read timeout: 0.6 s in all, never a timeout, since the
    # deadline runs from each piece asked for, not from the answer's start. Then a stall.
    stalled = trio.Event()

    async def backend(stream: trio.SocketStream) -> None:
        await read_request(stream)
        await stream.send_all(ANSWER + b"2\r\nok\r\n2\r\nok\r\n")  # two pieces already there
        for _ in range(4):
            await trio.sleep(0.15)
            await stream.send_all(b"2\r\nok\r\n")
        await stalled.wait()

    async with serving(backend) as port:
        pool = H1Pool(f"http://127.0.0.1:{port}", connect_timeout=5, max_connections=1)
        with trio.fail_after(10):
            response = await pool.send(UpstreamRequest("POST", "/v1/x", [], b"{}"))
            received = b""
            async with aclosing(response.aiter_raw(0.3)) as chunks:
                while len(received) < 12:
                    received += await chunks.__anext__()
                asked_at = trio.current_time()
                with pytest.raises(trio.TooSlowError):
                    await chunks.__anext__()
                # The stall was cut at the deadline of the last piece asked for.
                # (the backend stalls until told, so anything short of that proves the cut)
                assert 0.3 <= trio.current_time() - asked_at < 5.0
            assert received == b"ok" * 6
            await response.aclose()
            stalled.set()
        pool.close()


async def test_a_large_body_reaches_the_backend_whole_after_its_head() -> None:
    # Several megabytes: the kernel takes the head and the body in many partial writes.
    content = bytes(range(256)) * 16_384
    received: list[bytes] = []

    async def backend(stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        await trio.sleep(0.05)  # the client's writes fill the socket's buffers meanwhile
        while len(body) < len(content):
            body += await stream.receive_some(1 << 20)
        received.append(body)
        await stream.send_all(ANSWER + b"2\r\nok\r\n0\r\n\r\n")

    async with serving(backend) as port:
        pool = H1Pool(f"http://127.0.0.1:{port}", connect_timeout=5, max_connections=1)
        with trio.fail_after(10):
            response = await pool.send(UpstreamRequest("POST", "/v1/x", [], content))
            assert await response.aread() == b"ok"
        assert received == [content]
        pool.close()


async def test_a_request_with_a_free_slot_and_an_idle_connection_goes_out_without_yielding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every trip through trio's scheduler before the request's write puts the call behind each
    # task ready at that moment: at 32 streams, about half a millisecond of other streams'
    # chunks per trip (docs/BENCHMARKS.md). Counted: the sending task's steps until the write.
    async def backend(stream: trio.SocketStream) -> None:
        while await read_request(stream) is not None:
            await stream.send_all(ANSWER + b"2\r\nok\r\n0\r\n\r\n")

    me = trio.lowlevel.current_task()
    steps = StepCounter(me)
    steps_at_write: list[int] = []
    send_all = Connection.send_all

    async def watched_send_all(self: Connection, *parts: bytes) -> None:
        steps_at_write.append(steps.steps)
        await send_all(self, *parts)

    monkeypatch.setattr(Connection, "send_all", watched_send_all)
    async with serving(backend) as port:
        pool = H1Pool(f"http://127.0.0.1:{port}", connect_timeout=5, max_connections=1)
        request = UpstreamRequest("POST", "/v1/x", [], b"{}")
        with trio.fail_after(10):
            first = await pool.send(request)  # opens the connection: that waits, as it must
            assert await first.aread() == b"ok"
            trio.lowlevel.add_instrument(steps)
            try:
                second = await pool.send(request)
            finally:
                trio.lowlevel.remove_instrument(steps)
            assert await second.aread() == b"ok"
        assert steps_at_write[1:] == [0]
        pool.close()


class StepCounter(trio.abc.Instrument):
    """Counts one task's steps: each is a return from trio's scheduler."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


def test_a_backend_with_credentials_gets_one_authorization_header_its_own() -> None:
    # An SDK always sends its key; with the backend's Basic credentials as well, nginx answered
    # 400 to every call. The backend's credentials win and the client's header is not sent.
    pool = H1Pool("http://user:pw@127.0.0.1:9/v1", connect_timeout=5, max_connections=1)
    sent = [("Authorization", "Bearer sk-client"), ("x-other", "1")]
    head = pool.head(UpstreamRequest("POST", "/chat", sent, b"{}")).decode("latin-1")
    lines = [line.lower() for line in head.split("\r\n")]
    assert [line for line in lines if line.startswith("authorization:")] == [
        "authorization: basic dxnlcjpwdw=="
    ]
    assert "x-other: 1" in lines
    # Without credentials of its own, the backend gets the client's header as before.
    plain = H1Pool("http://127.0.0.1:9/v1", connect_timeout=5, max_connections=1)
    head = plain.head(UpstreamRequest("POST", "/chat", sent, b"{}")).decode("latin-1")
    assert "Authorization: Bearer sk-client" in head.split("\r\n")
