"""A trivial, fast OpenAI-compatible streaming backend for measuring proxy overhead.

Every chat or completion call streams ``chunks`` pre-built vLLM-shaped chunks ``interval_ms``
apart (the usage chunk too, when asked), then ``[DONE]``; no model, no KV, almost no CPU, so
what a proxy adds stands out. The first chunk's ``id`` carries two stamps of the system's
monotonic clock, ``chatcmpl-fast-<in>-<out>`` in nanoseconds: when the request's body was read
and when the first chunk was sent. A client on the same machine subtracts them from its own
times to get the two hops without the backend's own wait (``stamps``). It answers /health,
/metrics (a vLLM ``cache_config_info`` with a large capacity, so ``tr`` never pauses) and
/v1/models.

    python -m thunderproxy.bench.relay.fastbackend --port 0 --chunks 32 --interval-ms 20
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from ...sim.api.asgi import lifespan, read_whole

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

MODEL = "fast"
UNSTAMPED = b'"chatcmpl-fast"'
STAMPED = '"chatcmpl-fast-'
STAMP = re.compile(r'"id": ?"chatcmpl-fast-(\d+)-(\d+)"')
METRICS = (
    b"# TYPE vllm:num_requests_running gauge\n"
    b'vllm:num_requests_running{engine="0",model_name="fast"} 0.0\n'
    b"# TYPE vllm:kv_cache_usage_perc gauge\n"
    b'vllm:kv_cache_usage_perc{engine="0",model_name="fast"} 0.0\n'
    b"# TYPE vllm:cache_config_info gauge\n"
    b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000000"} 1.0\n'
)


def chunk_payloads(chunks: int, *, prompt_tokens: int = 1000) -> tuple[bytes, bytes, bytes]:
    """The SSE bytes of one token chunk, of the usage chunk and of the end."""
    token = {
        "id": "chatcmpl-fast",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}],
    }
    usage = {
        "id": "chatcmpl-fast",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": chunks,
            "total_tokens": prompt_tokens + chunks,
        },
    }
    return (
        b"data: " + json.dumps(token).encode() + b"\n\n",
        b"data: " + json.dumps(usage).encode() + b"\n\n",
        b"data: [DONE]\n\n",
    )


class FastBackend:
    def __init__(self, *, chunks: int, interval_ms: float) -> None:
        self.chunks = chunks
        self.interval = interval_ms / 1000.0
        self.token, self.usage, self.done = chunk_payloads(chunks)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path in ("/v1/chat/completions", "/v1/completions"):
            await self._stream(receive, send)
        elif path == "/metrics":
            await _respond(send, 200, METRICS, b"text/plain; version=0.0.4")
        elif path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode()
            await _respond(send, 200, body, b"application/json")
        elif path == "/health":
            await _respond(send, 200, b"", b"text/plain")
        else:
            await _respond(send, 404, b'{"detail":"Not Found"}', b"application/json")

    async def _stream(self, receive: Receive, send: Send) -> None:
        raw = await read_whole(receive)
        # The system's monotonic clock, not trio's: the client in another process reads the same
        # clock, and trio's has an offset of its own per run.
        read_at = time.monotonic_ns()
        body = json.loads(raw or b"{}")
        want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
            }
        )
        for i in range(self.chunks):
            if self.interval > 0:
                await trio.sleep(self.interval)
            token = self.token
            if i == 0:
                stamp = f'{STAMPED}{read_at}-{time.monotonic_ns()}"'.encode()
                token = token.replace(UNSTAMPED, stamp, 1)
            await send({"type": "http.response.body", "body": token, "more_body": True})
        tail = (self.usage if want_usage else b"") + self.done
        await send({"type": "http.response.body", "body": tail, "more_body": False})


def stamps(line: str) -> tuple[int, int] | None:
    """The backend's two stamps (ns: body read, first chunk sent) in a first chunk's line, if
    the relay passed its ``id`` through."""
    match = STAMP.search(line)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


async def _respond(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    headers = [(b"content-type", content_type)]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _main(port: int, chunks: int, interval_ms: float) -> None:
    config = HypercornConfig()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.keep_alive_timeout = 120.0
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(
            partial(serve, FastBackend(chunks=chunks, interval_ms=interval_ms), config)  # type: ignore[arg-type]
        )
        print(f"fastbackend serving on {urls[0]};", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    args = parser.parse_args(argv)
    try:
        trio.run(_main, args.port, args.chunks, args.interval_ms)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
