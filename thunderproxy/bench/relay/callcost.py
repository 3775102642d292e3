"""The proxy's own CPU per call, without the server or the sockets around it.

``thunderproxy bench --overhead`` measures a whole proxy process, whose CPU is mostly the HTTP
server's, trio's and the kernel's, and whose wall-clock figures move with the machine's load.
This runs one call after another through the edge itself, in process: ``Edges.handle`` (body
read and checked, program recognised), the gateway (route, admission, the scheduler's lease),
a backend that answers at once from memory with the fast backend's 32 chunks and usage, the
relay with its usage tap, and the call's close (lease, audit record, statistics). It reports
the main thread's CPU per call, and up to the first chunk, as the median of ``--rounds``:

    python -m thunderproxy.bench.relay.callcost --router default --programs 32 --history 200

``--history N`` sends an agent's body: N messages of about a kilobyte each and 20 tool
definitions (about 222 KB at 200), instead of one 4 KB message.

``--per-chunk`` measures the relay of one chunk instead: the answer comes through the relay's
own HTTP/1.1 client (``H1Response``, chunked framing decoded as from a socket, one read per
chunk, as a stream 20 ms apart arrives) and each round calls every program twice, once with
``--chunks`` token chunks and once with one; the difference, divided by the chunks between
them, is what one more chunk costs (the tap, ``Exchange.stream``, the client's read), free of
everything a call costs once. What the server's write adds is not in it (no socket here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio

from ...audit import AuditLog
from ...audit.records import AuditRecord
from ...backends import EngineSnapshot, UpstreamRequest, UpstreamResponse, open_backend_pool
from ...backends.h1 import H1Pool, H1Response
from ...backends.mock import MockBackend, MockResponse
from ...config import Settings
from ...core import build_core
from ...http.edges import Edges
from ...http.proxy import run_cleanups
from ...protocols import Protocol
from ...protocols.recognition import ProgramRecognizer
from ...statistics import Counters
from .fastbackend import chunk_payloads

CHAT = "/v1/chat/completions"
HEADERS = [
    ("host", "127.0.0.1"),
    ("content-type", "application/json"),
    ("accept", "*/*"),
    ("user-agent", "python-httpx/0.28.1"),
    ("accept-encoding", "gzip, deflate"),
]


class _Reads:
    """A connection whose reads return one chunked-framed piece each, as a socket delivers a
    stream whose chunks come apart: what ``H1Response`` reads in place of a socket."""

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = iter(pieces)

    def receive_ready(self, size: int) -> bytes | None:
        return next(self._pieces, b"")

    async def receive_after_wait(self, size: int, deadline: float | None) -> bytes:
        raise AssertionError("every piece is ready")

    def close(self) -> None:
        return None


class _Answers:
    """What the in-process backend (a ``MockBackend`` that keeps nothing) answers: ``tokens``
    chunks and the usage and done events, already in memory (the relay's work without the
    socket's), or with ``framed`` as chunked HTTP/1.1 read through ``H1Response`` (the H1
    client's de-chunking counted too)."""

    def __init__(self, chunks: int, *, framed: bool = False) -> None:
        self.framed = framed
        self.pool = H1Pool("http://in-process", connect_timeout=1.0, max_connections=1 << 30)
        self.tokens = chunks

    @property
    def tokens(self) -> int:
        return len(self.chunks) - 2

    @tokens.setter
    def tokens(self, chunks: int) -> None:
        token, usage, done = chunk_payloads(chunks)
        self.chunks = [token] * chunks + [usage, done]
        self.pieces = [b"%x\r\n%b\r\n" % (len(c), c) for c in self.chunks] + [b"0\r\n\r\n"]

    async def __call__(self, request: UpstreamRequest) -> UpstreamResponse:
        if not self.framed:
            return MockResponse(200, [("content-type", "text/event-stream")], self.chunks)
        await self.pool._slots.acquire()  # as H1Pool.send takes a slot; the release frees it
        headers = [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")]
        return H1Response(
            self.pool,
            _Reads(self.pieces),  # type: ignore[arg-type]
            200,
            headers,
            b"",
            reusable=False,
            length=None,
            chunked=True,
        )


def body(program: int | None, history: int) -> bytes:
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
    if program is not None:
        payload["extra_body"] = {"program_id": f"callcost-{program}"}
    return json.dumps(payload).encode()


@asynccontextmanager
async def in_process_edges(router: str, backend: Any, audit: AuditLog) -> AsyncIterator[Edges]:
    """The protocol edges over a real gateway and scheduler (``router``) with ``backend`` as
    the one backend of model ``fast``: a call's whole path in the proxy, with no sockets."""
    async with open_backend_pool() as pool:
        node = pool.attach("http://in-process", backend, models=["fast"])
        node.snapshot = _snapshot()
        gateway = build_core(Settings(router=router), pool, audit).gateway
        yield Edges(gateway=gateway, recognizer=ProgramRecognizer())


async def _call(edges: Edges, raw: bytes, first: list[float] | None = None) -> None:
    """One call through the edges, its answer read to the end; with ``first``, the CPU time
    to its first chunk is appended there."""
    scope: dict[str, Any] = {}
    started = time.thread_time() if first is not None else 0.0
    try:
        reply = await edges.handle(
            Protocol.CHAT, CHAT, raw, list(HEADERS), scope, trio.current_time()
        )
        assert not isinstance(reply.body, bytes), reply.body
        waiting = first is not None
        async for _ in reply.body:
            if waiting:
                assert first is not None
                first.append(time.thread_time() - started)
                waiting = False
        await reply.body.aclose()
    finally:
        await run_cleanups(scope)


def drain(receive: trio.MemoryReceiveChannel[AuditRecord]) -> None:
    """Drop the audit records so far (nobody writes them here)."""
    while True:
        try:
            receive.receive_nowait()
        except trio.WouldBlock:
            return


async def measure_one_shot(router: str, before: int, batches: int, batch: int) -> list[float]:
    """CPU per call of one-shot calls without a program id (plain SDK traffic: each call is a
    new ``auto-...`` program that never calls again), in ``batches`` of ``batch`` calls after
    ``before`` such calls: whether what a call costs grows with the programs seen."""
    send, receive = trio.open_memory_channel[AuditRecord](1_000_000)
    audit = AuditLog(send, run_id=1)
    async with in_process_edges(router, MockBackend(_Answers(32), keep=False), audit) as edges:
        raw = body(None, 0)  # the same prompt each time: never a continuation, always new

        for k in range(before):
            await _call(edges, raw)
            if k % 1_000 == 999:
                drain(receive)
        drain(receive)
        out = []
        for _ in range(batches):
            started = time.thread_time()
            for _ in range(batch):
                await _call(edges, raw)
            out.append((time.thread_time() - started) / batch)
            drain(receive)
        registry = edges.gateway.scheduler.registry
        assert len(registry) >= before + batches * batch, "calls were not one-shot"
        return out


def _snapshot() -> EngineSnapshot:
    return EngineSnapshot(
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


async def measure(
    router: str,
    programs: int,
    rounds: int,
    history: int,
    *,
    per_chunk: bool = False,
    chunks: int = 32,
) -> dict[str, float]:
    send, receive = trio.open_memory_channel[AuditRecord](1_000_000)
    audit = AuditLog(send, run_id=1)
    counters = Counters()
    audit.observers.append(counters.observe)
    answers = _Answers(chunks, framed=per_chunk)
    async with in_process_edges(router, MockBackend(answers, keep=False), audit) as edges:
        bodies = [body(i, history) for i in range(programs)]
        first: list[float] = []

        for raw in bodies:  # every program's first call: created, sized, placed
            await _call(edges, raw, first)
        drain(receive)
        first.clear()
        per_call = []
        chunk_cost = []
        for _ in range(rounds):
            answers.tokens = chunks
            started = time.thread_time()
            for raw in bodies:
                await _call(edges, raw, first)
            long = (time.thread_time() - started) / programs
            per_call.append(long)
            drain(receive)
            if per_chunk:
                answers.tokens = 1
                started = time.thread_time()
                for raw in bodies:
                    await _call(edges, raw, first)
                short = (time.thread_time() - started) / programs
                chunk_cost.append((long - short) / (chunks - 1))
                drain(receive)
    if per_chunk:
        return {
            "body_bytes": float(len(bodies[0])),
            "cpu_per_call_us": 1e6 * statistics.median(per_call),
            "cpu_per_chunk_us": 1e6 * statistics.median(chunk_cost),
        }
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
    parser.add_argument(
        "--per-chunk", action="store_true", help="CPU per relayed chunk, through the H1 client"
    )
    parser.add_argument("--chunks", type=int, default=32, help="token chunks of the answer")
    parser.add_argument(
        "--one-shot",
        type=int,
        metavar="N",
        help="one-shot calls without a program id: CPU per call in batches after N such calls",
    )
    parser.add_argument("--batch", type=int, default=400, help="calls per --one-shot batch")
    args = parser.parse_args(argv)
    if args.one_shot is not None:
        batches = trio.run(measure_one_shot, args.router, args.one_shot, args.rounds, args.batch)
        print(
            f"{args.router}, one-shot calls after {args.one_shot}: "
            + ", ".join(f"{1e6 * b:.0f}" for b in batches)
            + f" us of CPU per call ({args.batch} calls a batch)"
        )
        return
    if args.chunks < 2:
        parser.error("--chunks must be at least 2 (one chunk is the per-call baseline)")
    result = trio.run(
        partial(measure, per_chunk=args.per_chunk, chunks=args.chunks),
        args.router,
        args.programs,
        args.rounds,
        args.history,
    )
    if args.per_chunk:
        print(
            f"{args.router}, {args.programs} programs, {args.chunks}-chunk answers: "
            f"{result['cpu_per_chunk_us']:.2f} us of CPU per relayed chunk, "
            f"{result['cpu_per_call_us']:.0f} us per call (medians of {args.rounds} rounds)"
        )
        return
    print(
        f"{args.router}, {args.programs} programs, {result['body_bytes']:.0f}-byte bodies: "
        f"{result['cpu_per_call_us']:.0f} us of CPU per call, "
        f"{result['cpu_to_first_chunk_us']:.0f} us to the first chunk "
        f"(medians of {args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
