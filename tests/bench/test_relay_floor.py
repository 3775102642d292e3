"""The overhead bench's two floors relay a stream byte for byte: the bare ASGI relay on
Hypercorn and the same relay on trio's own sockets, each against the fast backend on loopback."""

from __future__ import annotations

import re
import socket

import httpx
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from thunderproxy.backends.h1 import H1Pool
from thunderproxy.bench.relay.fastbackend import UNSTAMPED, FastBackend
from thunderproxy.bench.relay.relay_floor import create_floor, serve_trio

BODY = {"model": "fast", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def listening_socket() -> tuple[socket.socket, str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    host, port = sock.getsockname()
    return sock, f"http://{host}:{port}"


async def serve_asgi(app: object, sock: socket.socket) -> None:
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    await serve(app, config)  # type: ignore[arg-type]


async def stream(client: httpx.AsyncClient, url: str) -> tuple[int, bytes]:
    """The status and body, the backend's two clock stamps in the first chunk's id (which
    differ on every call) left out and checked apart."""
    async with client.stream("POST", f"{url}/v1/chat/completions", json=BODY) as response:
        body = await response.aread()
    stamped, count = re.subn(rb'"chatcmpl-fast-\d+-\d+"', UNSTAMPED, body, count=1)
    assert count == 1, "the first chunk's stamps did not come through"
    return response.status_code, stamped


@pytest.mark.parametrize("server", ["hypercorn", "trio"])
async def test_each_floor_relays_the_backends_stream_unchanged(server: str) -> None:
    backend_sock, backend = listening_socket()
    relay_sock, relay = listening_socket()
    pool = H1Pool(backend, connect_timeout=10.0, max_connections=8)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_asgi, FastBackend(chunks=8, interval_ms=1.0), backend_sock)
            if server == "trio":
                nursery.start_soon(serve_trio, backend, relay_sock)
            else:
                nursery.start_soon(serve_asgi, create_floor(backend, pool=pool), relay_sock)
            async with httpx.AsyncClient(timeout=10.0) as client:
                direct = await stream(client, backend)
                # Twice: the second request reuses the relay's keep-alive connection.
                relayed = [await stream(client, relay) for _ in range(2)]
            nursery.cancel_scope.cancel()
    finally:
        pool.close()
    assert direct[0] == 200
    assert direct[1].endswith(b"data: [DONE]\n\n")
    assert relayed == [direct, direct]
