"""The floor of thunderproxy's stack: a bare ASGI relay on Hypercorn's trio worker, sending
upstream through thunderproxy's own HTTP/1.1 client (``backends/h1.py``), for ``thunderproxy
bench --overhead`` (target ``floor``).

Each ``POST`` is sent to the backend as it came and its body relayed as each socket read
brings it: no gateway, no parsing, no scheduling, no audit, no watcher for the client leaving.
Whatever CPU this spends per request and per chunk is what the server (Hypercorn, h11), trio and
the upstream client cost on their own; thunderproxy's figures beside it show how much of its
overhead is its own work and how much this stack's.

    python -m thunderproxy.bench.relay_floor --backend http://127.0.0.1:8001 --port 0
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from ..backends.base import UpstreamRequest
from ..backends.h1 import H1Pool

#: Request headers not passed on (the client writes its own).
_DROP = frozenset({b"host", b"content-length", b"connection", b"transfer-encoding", b"keep-alive"})


def create_floor(backend: str, *, max_connections: int = 1024) -> Any:
    pool = H1Pool(backend, connect_timeout=10.0, max_connections=max_connections)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
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
        headers = [
            (n.decode("latin-1"), v.decode("latin-1"))
            for n, v in scope["headers"]
            if n.lower() not in _DROP
        ]
        request = UpstreamRequest(scope["method"], scope["path"], headers, b"".join(parts))
        response = await pool.send(request)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--backend", required=True, help="the backend's base URL")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    # Bound here, so that port 0 works and the line below names the port actually used.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(2048)
    host, port = sock.getsockname()
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.backlog = 2048
    print(f"floor relay (hypercorn, trio) listening on http://{host}:{port}", file=sys.stderr)
    sys.stderr.flush()
    trio.run(serve, create_floor(args.backend), config)


if __name__ == "__main__":
    main()
