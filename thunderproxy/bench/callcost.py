"""The proxy's own CPU per call, without the server or the sockets around it.

``thunderproxy bench --overhead`` measures a whole proxy process, whose CPU is mostly the HTTP
server's, trio's and the kernel's, and whose wall-clock figures move with the machine's load.
This runs one call after another through the edge itself, in process: ``Edges.handle`` (body
read and checked, program recognised), the gateway (route, admission, the scheduler's lease),
a backend that answers at once from memory with the fast backend's 32 chunks and usage, the
relay with its usage tap, and the call's close (lease, audit record, statistics). It reports
the main thread's CPU per call, and up to the first chunk, as the median of ``--rounds``:

    python -m thunderproxy.bench.callcost --router default --programs 32 --history 200

``--history N`` sends an agent's body: N messages of about a kilobyte each and 20 tool
definitions (about 222 KB at 200), instead of one 4 KB message.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import trio

from ..audit import AuditLog
from ..audit.records import AuditRecord, TransitionRecord
from ..backends import EngineSnapshot, UpstreamRequest, open_backend_pool
from ..gateway import Gateway
from ..http.edges import Edges
from ..http.proxy import run_cleanups
from ..programs import ProgramRegistry
from ..programs.profile import Profiles
from ..programs.recognition import ProgramRecognizer
from ..protocols import Protocol
from ..scheduling import Scheduler, policy_named
from ..scheduling.policy import PolicyConfig
from ..statistics import Counters
from .fastbackend import chunk_payloads

CHAT = "/v1/chat/completions"
HEADERS = [
    ("host", "127.0.0.1"),
    ("content-type", "application/json"),
    ("accept", "*/*"),
    ("user-agent", "python-httpx/0.28.1"),
    ("accept-encoding", "gzip, deflate"),
]


class _Answer:
    """A streamed answer already in memory: the relay's work without the socket's."""

    status_code = 200
    headers: Sequence[tuple[str, str]] = [("content-type", "text/event-stream")]

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk

    async def aread(self) -> bytes:
        return b"".join(self._chunks)

    async def aclose(self) -> None:
        return None


class _Backend:
    def __init__(self, chunks: int) -> None:
        token, usage, done = chunk_payloads(chunks)
        self.chunks = [token] * chunks + [usage, done]

    async def send(self, request: UpstreamRequest) -> _Answer:
        return _Answer(self.chunks)


def body(program: int, history: int) -> bytes:
    if history:
        messages = [
            {
                "role": "user" if k % 2 == 0 else "assistant",
                "content": "word " * 200 + f'step {k}: r\u00e9sum\u00e9 "quoted"\n',
            }
            for k in range(history)
        ]
        tools = [
            {
                "type": "function",
                "function": {
                    "name": f"tool_{k}",
                    "description": "a tool " * 20,
                    "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
                },
            }
            for k in range(20)
        ]
    else:
        messages, tools = [{"role": "user", "content": "word " * 800}], []
    payload: dict[str, Any] = {"model": "fast", "messages": messages, "stream": True}
    if tools:
        payload["tools"] = tools
    payload["max_tokens"] = 32
    payload["extra_body"] = {"program_id": f"callcost-{program}"}
    return json.dumps(payload).encode()


async def measure(router: str, programs: int, rounds: int, history: int) -> dict[str, float]:
    send, receive = trio.open_memory_channel[AuditRecord](1_000_000)
    audit = AuditLog(send, run_id=1)
    counters = Counters()
    audit.observers.append(counters.observe)
    async with open_backend_pool() as pool:
        node = pool.attach("http://in-process", _Backend(32), models=["fast"])
        node.snapshot = EngineSnapshot(
            flavour="vllm",
            engines=1,
            capacity_tokens=16_000_000,
            block_size=16,
            num_gpu_blocks=1_000_000,
            kv_usage=0.0,
            running=0,
            waiting=0,
            prefix_queries_total=0,
            prefix_hits_total=0,
            preemptions_total=0.0,
        )
        scheduler = Scheduler(
            policy=policy_named(router, PolicyConfig()),
            registry=ProgramRegistry(lambda t: audit.record(TransitionRecord(t))),
            pool=pool,
            audit=audit,
        )
        gateway = Gateway(pool=pool, scheduler=scheduler, audit=audit, profiles=Profiles())
        edges = Edges(gateway=gateway, recognizer=ProgramRecognizer())
        bodies = [body(i, history) for i in range(programs)]
        first: list[float] = []

        async def call(raw: bytes) -> None:
            scope: dict[str, Any] = {}
            started = time.thread_time()
            try:
                reply = await edges.handle(
                    Protocol.CHAT, CHAT, raw, list(HEADERS), scope, trio.current_time()
                )
                assert not isinstance(reply.body, bytes), reply.body
                waiting = True
                async for _ in reply.body:
                    if waiting:
                        first.append(time.thread_time() - started)
                        waiting = False
                await reply.body.aclose()
            finally:
                await run_cleanups(scope)

        def drain() -> None:
            while True:
                try:
                    receive.receive_nowait()
                except trio.WouldBlock:
                    return

        for raw in bodies:  # every program's first call: created, sized, placed
            await call(raw)
        drain()
        first.clear()
        per_call = []
        for _ in range(rounds):
            started = time.thread_time()
            for raw in bodies:
                await call(raw)
            per_call.append((time.thread_time() - started) / programs)
            drain()
    return {
        "body_bytes": float(len(bodies[0])),
        "cpu_per_call_us": 1e6 * statistics.median(per_call),
        "cpu_to_first_chunk_us": 1e6 * statistics.median(first),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", default="default", help="default or tr")
    parser.add_argument("--programs", type=int, default=32, help="programs called in turn")
    parser.add_argument("--rounds", type=int, default=20, help="rounds over every program")
    parser.add_argument("--history", type=int, default=0, help="messages of an agent's body")
    args = parser.parse_args(argv)
    result = trio.run(measure, args.router, args.programs, args.rounds, args.history)
    print(
        f"{args.router}, {args.programs} programs, {result['body_bytes']:.0f}-byte bodies: "
        f"{result['cpu_per_call_us']:.0f} us of CPU per call, "
        f"{result['cpu_to_first_chunk_us']:.0f} us to the first chunk "
        f"(medians of {args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
