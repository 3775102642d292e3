"""The floor of thunderproxy's stack: a bare ASGI relay on Hypercorn's trio worker, sending
upstream through thunderproxy's own HTTP/1.1 client (``backends/h1.py``), for ``thunderproxy
bench --overhead`` (target ``floor``); and, with ``--server trio`` (target ``floor-trio``), the
same relay behind a minimal HTTP/1.1 server written on trio's sockets, without Hypercorn and h11,
to tell the ASGI server's share of the floor from trio's.

Each ``POST`` is sent to the backend as it came and its body relayed as each socket read
brings it: no gateway, no parsing, no scheduling, no audit, no watcher for the client leaving.
Whatever CPU this spends per request and per chunk is what the server (Hypercorn, h11), trio and
the upstream client cost on their own; thunderproxy's figures beside it show how much of its
overhead is its own work and how much this stack's.

    python -m thunderproxy.bench.relay.relay_floor --backend http://127.0.0.1:8001 --port 0
    python -m thunderproxy.bench.relay.relay_floor --backend http://127.0.0.1:8001 --server trio

The trio server reads a request head and a ``Content-Length`` body and answers chunked, on
keep-alive connections: what the bench's client sends, nothing more. It is a measurement, not
a server to put in front of anything.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from ...backends.base import UpstreamRequest
from ...backends.h1 import H1Pool

#: Request headers not passed on (the client writes its own).
_DROP = frozenset({b"host", b"content-length", b"connection", b"transfer-encoding", b"keep-alive"})


def create_floor(backend: str, *, pool: H1Pool | None = None) -> Any:
    """The ASGI relay, sending through ``pool`` (a new one by default); closed at lifespan
    shutdown, and closing it again is harmless."""
    if pool is None:
        pool = H1Pool(backend, connect_timeout=10.0, max_connections=1024)
    upstream = pool

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    upstream.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        parts = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        headers = _forwarded(scope["headers"])
        request = UpstreamRequest(scope["method"], scope["path"], headers, b"".join(parts))
        response = await upstream.send(request)
        try:
            answer = [
                (n.lower().encode("latin-1"), v.encode("latin-1"))
                for n, v in response.headers
                if n.lower().encode("latin-1") not in _DROP
            ]
            await send(
                {"type": "http.response.start", "status": response.status_code, "headers": answer}
            )
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    return app


def _forwarded(headers: Any) -> list[tuple[str, str]]:
    return [
        (n.decode("latin-1"), v.decode("latin-1")) for n, v in headers if n.lower() not in _DROP
    ]


@dataclass
class PlainRequest:
    """One HTTP/1.1 request as ``read_request`` reads it: lower-cased header names."""

    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


async def read_request(
    stream: trio.SocketStream, buffer: bytes
) -> tuple[PlainRequest, bytes] | None:
    """The next request on ``stream`` after what ``buffer`` holds already, and the bytes read
    past it; None once the peer closes. Only a head and a ``Content-Length`` body: enough for
    a measurement's clients, not a parser to face the world."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buffer += data
    head, _, buffer = buffer.partition(b"\r\n\r\n")
    request_line, *lines = head.split(b"\r\n")
    method, target, _version = request_line.split(b" ", 2)
    fields = [line.partition(b":") for line in lines]
    headers = [(name.strip().lower(), value.strip()) for name, _, value in fields]
    length = int(dict(headers).get(b"content-length", b"0"))
    while len(buffer) < length:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buffer += data
    return PlainRequest(method, target, headers, buffer[:length]), buffer[length:]


async def requests(stream: trio.SocketStream) -> AsyncIterator[PlainRequest]:
    """The requests on ``stream`` in turn (``read_request``), until the peer closes."""
    buffer = b""
    while (read := await read_request(stream, buffer)) is not None:
        plain, buffer = read
        yield plain


async def _serve_trio_connection(pool: H1Pool, stream: trio.SocketStream) -> None:
    async with stream:
        async for plain in requests(stream):
            request = UpstreamRequest(
                plain.method.decode("latin-1"),
                plain.target.decode("latin-1"),
                _forwarded(plain.headers),
                plain.body,
            )
            response = await pool.send(request)
            try:
                out = [f"HTTP/1.1 {response.status_code} OK\r\n".encode()]
                for n, v in response.headers:
                    if n.lower().encode("latin-1") not in _DROP:
                        out.append(f"{n}: {v}\r\n".encode("latin-1"))
                out.append(b"transfer-encoding: chunked\r\n\r\n")
                await stream.send_all(b"".join(out))
                async for chunk in response.aiter_raw():
                    if chunk:
                        await stream.send_all(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                await stream.send_all(b"0\r\n\r\n")
            finally:
                await response.aclose()


async def serve_trio(backend: str, sock: socket.socket) -> None:
    pool = H1Pool(backend, connect_timeout=10.0, max_connections=1024)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))

    async def handle(stream: trio.SocketStream) -> None:
        try:
            await _serve_trio_connection(pool, stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ValueError):
            pass  # a client gone or a request this measurement does not read: drop it

    try:
        await trio.serve_listeners(handle, [listener])
    finally:
        pool.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--backend", required=True, help="the backend's base URL")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--server",
        choices=("hypercorn", "trio"),
        default="hypercorn",
        help="hypercorn: the ASGI relay on Hypercorn (floor); trio: on bare trio sockets",
    )
    args = parser.parse_args(argv)
    # Bound here, so that port 0 works and the line below names the port actually used.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(2048)
    host, port = sock.getsockname()
    if args.server == "trio":
        print(f"floor relay (trio) listening on http://{host}:{port}", file=sys.stderr)
        sys.stderr.flush()
        trio.run(serve_trio, args.backend, sock)
        return
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.backlog = 2048
    print(f"floor relay (hypercorn, trio) listening on http://{host}:{port}", file=sys.stderr)
    sys.stderr.flush()
    trio.run(serve, create_floor(args.backend), config)


if __name__ == "__main__":
    main()
