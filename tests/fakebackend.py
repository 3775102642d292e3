"""A minimal OpenAI-compatible backend for end-to-end tests of the proxy core.

It answers like vLLM in shape (SSE framing, usage chunk with ``choices: []``, cached-token
details, ``vllm:`` metrics) and records what it received, so tests can see exactly what the
proxy forwarded and when an upstream request was abandoned.

``create_backend_app`` and ``serve_backend`` are what every test backend shares (the fuzzing
one in fuzzbackend.py too): the health and metrics routes, and a server on a free port;
``proxy_in_thread`` puts either behind a proxy for the hypothesis tests.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from quart import Response, request
from quart_trio import QuartTrio

from tests.conftest import running_proxy
from thunderproxy.runtime import RunningProxy

METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="fake"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="fake"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
"""


@dataclass
class LoopbackBackend:
    """What every test backend knows of itself: where it listens, once it does."""

    url: str = ""


@dataclass
class FakeBackend(LoopbackBackend):
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    # Set by a test: a stream stops after its first event until this is set.
    rest_of_stream: trio.Event | None = None


def create_backend_app(name: str) -> QuartTrio:
    """An app that answers like a healthy vLLM on ``/health`` and ``/metrics``, the routes the
    proxy's poller reads before it sends anything; each test backend adds its own."""
    app = QuartTrio(name)
    # Streams are as slow as a test makes them; Quart's 60 s default would cut them.
    app.config["RESPONSE_TIMEOUT"] = None

    @app.get("/health")
    async def health() -> Response:
        return Response(b"", status=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(METRICS, content_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def serve_backend(
    app: QuartTrio,
    state: LoopbackBackend,
    *,
    log_errors: bool = True,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on 127.0.0.1, port 0; ready once it listens, with ``state.url`` set."""
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    if not log_errors:
        config.errorlog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, config))
        state.url = binds[0]
        task_status.started(binds[0])


@contextmanager
def proxy_in_thread(
    serve_backend: Callable[..., Awaitable[None]],
    backend: LoopbackBackend,
    db: Path,
    **overrides: Any,
) -> Iterator[RunningProxy]:
    """``backend``, served by ``serve_backend``, and a proxy in front of it, on their own trio
    loop in a thread, so that hypothesis can drive them from plain synchronous examples."""
    ready: queue.Queue[RunningProxy] = queue.Queue()
    stop = threading.Event()

    async def serve_both() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_backend, backend)
            async with running_proxy(db, backends=backend.url, **overrides) as proxy:
                ready.put(proxy)
                await trio.to_thread.run_sync(stop.wait)
            nursery.cancel_scope.cancel()

    thread = threading.Thread(target=trio.run, args=(serve_both,), daemon=True)
    thread.start()
    try:
        yield ready.get(timeout=30)
    finally:
        stop.set()
        thread.join(30)


def create_fake_app(state: FakeBackend) -> QuartTrio:
    app = create_backend_app("fakebackend")

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(
            json.dumps({"object": "list", "data": [{"id": "fake"}]}),
            content_type="application/json",
        )

    @app.route("/echo/<path:rest>", methods=["GET", "POST", "PUT"])
    async def echo(rest: str) -> Response:
        body = await request.get_data(False, False, False)
        payload = {
            "method": request.method,
            "path": "/echo/" + rest,
            "query": request.query_string.decode(),
            "body": body.decode(),
            "x_program_id": request.headers.get("x-program-id"),
        }
        return Response(
            json.dumps(payload),
            status=201,
            content_type="application/json",
            headers={"x-fake": "yes"},
        )

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        body = await request.get_json()
        state.received.append(body)
        state.headers.append(dict(request.headers))
        request_id = request.headers.get("x-request-id", "none")
        words = int(request.headers.get("x-fake-words", "5"))
        delay = float(request.headers.get("x-fake-delay", "0"))
        status = int(request.headers.get("x-fake-status", "200"))
        if status != 200:
            error = {
                "error": {
                    "message": "fake failure",
                    "type": "InternalServerError",
                    "param": None,
                    "code": status,
                }
            }
            return Response(json.dumps(error), status=status, content_type="application/json")
        prompt_tokens = 10 * len(body["messages"])
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": words,
            "total_tokens": prompt_tokens + words,
            "prompt_tokens_details": {"cached_tokens": 8},
        }
        if not body.get("stream"):
            await trio.sleep(delay * words)
            state.completed.append(request_id)
            reply = {
                "id": f"chatcmpl-{request_id}",
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "w " * words},
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage,
            }
            return Response(json.dumps(reply), content_type="application/json")

        async def events() -> Any:
            try:
                for i in range(words):
                    await trio.sleep(delay)
                    if i == 1 and state.rest_of_stream is not None:
                        await state.rest_of_stream.wait()
                    chunk = {
                        "id": f"chatcmpl-{request_id}",
                        "object": "chat.completion.chunk",
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"content": f"w{i} "},
                                "finish_reason": "stop" if i == words - 1 else None,
                            }
                        ],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                if (body.get("stream_options") or {}).get("include_usage"):
                    final = {
                        "id": f"chatcmpl-{request_id}",
                        "object": "chat.completion.chunk",
                        "choices": [],
                        "usage": usage,
                    }
                    yield f"data: {json.dumps(final)}\n\n".encode()
                yield b"data: [DONE]\n\n"
                state.completed.append(request_id)
            except BaseException:
                state.aborted.append(request_id)
                raise

        return Response(events(), content_type="text/event-stream; charset=utf-8")

    return app


async def serve_fake_backend(
    state: FakeBackend, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    await serve_backend(create_fake_app(state), state, task_status=task_status)
