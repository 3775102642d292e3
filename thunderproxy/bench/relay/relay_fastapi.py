"""A FastAPI + uvicorn + httpx streaming relay: the common shape of a Python LLM proxy, as a
baseline for ``thunderproxy bench --overhead`` (target ``fastapi``).

Each ``POST /v1/...`` is sent to the backend with one shared ``httpx.AsyncClient`` and its body
relayed as it arrives through a ``StreamingResponse``; nothing is parsed, scheduled or recorded.
It is what a relay costs with the least work a proxy can do on this stack, so thunderproxy's
figures beside it show what its own work (usage, scheduling, audit) and its stack add.

    python -m thunderproxy.bench.relay.relay_fastapi --backend http://127.0.0.1:8001 --port 0

Needs the ``bench`` extra (``pip install 'thunderproxy[bench]'``).
"""

import argparse
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

# No ``from __future__ import annotations`` here: FastAPI reads the route's parameter types at
# definition, and ``Request`` is imported inside ``create_relay`` (the extra is optional).

#: Request headers not passed on: hop-by-hop, or recomputed by httpx for the backend.
_DROP = frozenset({"host", "content-length", "connection", "transfer-encoding", "keep-alive"})


def create_relay(backend: str, *, max_connections: int = 1024) -> Any:
    """The relay's ASGI app (FastAPI), sending every POST under /v1/ to ``backend``."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse

    client = httpx.AsyncClient(
        base_url=backend,
        timeout=httpx.Timeout(None, connect=10.0),
        limits=httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        ),
    )
    app = FastAPI()

    @app.post("/v1/{path:path}")
    async def relay(path: str, request: Request) -> Response:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP]
        upstream = client.build_request(
            "POST", "/v1/" + path, content=await request.body(), headers=headers
        )
        response = await client.send(upstream, stream=True)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return StreamingResponse(
            body(),
            status_code=response.status_code,
            media_type=response.headers.get("content-type"),
        )

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def _event_loop() -> str:
    """The loop uvicorn's "auto" picks: uvloop when installed."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True, help="the backend's base URL")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        sys.exit("the FastAPI relay needs the bench extra: pip install 'thunderproxy[bench]'")
    # Bound here, so that port 0 works and the line below names the port actually used.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(2048)  # connections made once the line below is out wait in the backlog
    host, port = sock.getsockname()
    config = uvicorn.Config(
        create_relay(args.backend), log_level="warning", access_log=False, backlog=2048
    )
    server = uvicorn.Server(config)
    print(
        f"fastapi relay (uvicorn {uvicorn.__version__}, {_event_loop()} loop) listening on "
        f"http://{host}:{port}",
        file=sys.stderr,
        flush=True,
    )
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
