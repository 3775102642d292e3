"""What reading one streamed chunk costs, in CPU, through httpx and on a plain trio socket.

Starts the fast backend (``fastbackend.py``) and reads its streams ``--rounds`` times per
stream, ``--streams`` at a time, in this process: first through one ``httpx.AsyncClient``
(``aiter_raw``), then as raw HTTP/1.1 on trio sockets (one request written, reads until the
chunked body's end), alternating ``--repeat`` times. Prints this process's CPU per read.

    python -m thunderproxy.bench.relay.readcost --streams 32 --rounds 4 --repeat 2
"""

from __future__ import annotations

import argparse
import resource
import sys
from collections.abc import Awaitable, Callable

import httpx
import trio

from ..runs.realtime import SIM_LISTENING, start_child, stop_child

BODY = b'{"model":"fast","messages":[{"role":"user","content":"hi"}],"stream":true}'
PATH = "/v1/chat/completions"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def through_httpx(url: str, streams: int, rounds: int) -> tuple[float, int]:
    reads = 0
    limits = httpx.Limits(max_connections=2 * streams, max_keepalive_connections=2 * streams)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:

        async def one() -> None:
            nonlocal reads
            for _ in range(rounds):
                headers = {"content-type": "application/json"}
                async with client.stream("POST", PATH, content=BODY, headers=headers) as r:
                    async for _ in r.aiter_raw():
                        reads += 1

        start = _cpu()
        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(one)
        return _cpu() - start, reads


async def on_a_socket(url: str, streams: int, rounds: int) -> tuple[float, int]:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    reads = 0
    head = b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n" % (
        PATH.encode(),
        host.encode(),
    )
    request = head + b"content-length: %d\r\n\r\n" % len(BODY) + BODY

    async def one() -> None:
        nonlocal reads
        stream = await trio.open_tcp_stream(host, int(port))
        for _ in range(rounds):
            await stream.send_all(request)
            tail = b""
            while not tail.endswith(b"0\r\n\r\n"):
                data = await stream.receive_some(65536)
                if not data:
                    raise RuntimeError("the backend closed the connection mid-answer")
                reads += 1
                tail = (tail + data)[-16:]
        await stream.aclose()

    start = _cpu()
    async with trio.open_nursery() as nursery:
        for _ in range(streams):
            nursery.start_soon(one)
    return _cpu() - start, reads


async def main(streams: int, rounds: int, repeat: int) -> None:
    readers: list[tuple[str, Callable[[str, int, int], Awaitable[tuple[float, int]]]]] = [
        ("httpx", through_httpx),
        ("trio socket", on_a_socket),
    ]
    async with trio.open_nursery() as nursery:
        argv = [sys.executable, "-m", "thunderproxy.bench.relay.fastbackend"]
        backend = await start_child(nursery, "fast backend", argv, SIM_LISTENING)
        try:
            for _ in range(repeat):
                for name, read in readers:
                    cpu, reads = await read(backend.url, streams, rounds)
                    print(
                        f"{name:12s} streams={streams} reads={reads} "
                        f"cpu per read {1e6 * cpu / max(1, reads):.0f} us",
                        flush=True,
                    )
        finally:
            await stop_child(backend)
            nursery.cancel_scope.cancel()


def cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4, help="calls per stream")
    parser.add_argument("--repeat", type=int, default=2, help="alternations of the two readers")
    args = parser.parse_args(argv)
    trio.run(main, args.streams, args.rounds, args.repeat)


if __name__ == "__main__":
    cli()
