"""What exactly reaches the backend. A recording test double stands in for vLLM here because
only it can show the forwarded bodies and headers byte for byte; behaviour is tested against
the simulator in test_proxy.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from quart import Response

from tests.conftest import running_proxy
from tests.fakebackend import (
    FakeBackend,
    LoopbackBackend,
    create_backend_app,
    serve_backend,
)
from thunderproxy.runtime import RunningProxy

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture
async def client(backend: FakeBackend, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    proxy: RunningProxy
    async with (
        # /echo is the double's own path: relayed only because it is listed.
        running_proxy(
            tmp_path / "audit.db", backends=backend.url, passthrough="/v1/models,/echo"
        ) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=10) as c,
    ):
        yield c


@pytest.mark.parametrize(
    ("extra", "headers"),
    [
        pytest.param({"program_id": "p"}, {}, id="body"),
        pytest.param({"extra_body": {"program_id": "p"}}, {}, id="extra_body"),
        pytest.param({}, {"X-Program-Id": "p"}, id="header"),
    ],
)
async def test_program_id_never_reaches_the_backend(
    client: httpx.AsyncClient,
    backend: FakeBackend,
    extra: dict[str, Any],
    headers: dict[str, str],
) -> None:
    r = await client.post("/v1/chat/completions", json={**CHAT, **extra}, headers=headers)
    assert r.status_code == 200
    assert backend.received[-1] == CHAT
    assert "X-Program-Id" not in backend.headers[-1]
    assert backend.headers[-1]["X-Request-Id"] == "p-1"


async def test_other_extra_body_fields_are_kept(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    body = {**CHAT, "extra_body": {"program_id": "p", "top_k": 5}}
    await client.post("/v1/chat/completions", json=body)
    assert backend.received[-1] == {**CHAT, "extra_body": {"top_k": 5}}


async def test_streaming_asks_the_backend_for_usage(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    await client.post("/v1/chat/completions", json=body)
    assert backend.received[-1]["stream_options"] == {
        "continuous_usage_stats": True,
        "include_usage": True,
    }


async def test_client_headers_pass_unchanged_and_hop_by_hop_ones_do_not(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    headers = {
        "Authorization": "Bearer secret-key",
        "X-Custom": "kept",
        "Connection": "keep-alive, X-Drop-Me",
        "X-Drop-Me": "hop-by-hop",
        "X-Request-Id": "client-chosen",
    }
    await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    seen = backend.headers[-1]
    assert seen["Authorization"] == "Bearer secret-key"
    assert seen["X-Custom"] == "kept"
    assert seen["X-Request-Id"] == "client-chosen"
    assert "X-Drop-Me" not in seen
    assert seen["Accept-Encoding"] == "identity"


async def test_passthrough_keeps_method_path_query_body_and_headers(
    client: httpx.AsyncClient,
) -> None:
    headers = {"X-Program-Id": "p"}
    r = await client.post("/echo/some/path?x=1&y=2", content=b"raw bytes", headers=headers)
    assert r.status_code == 201
    assert r.headers["x-fake"] == "yes"
    assert r.json() == {
        "method": "POST",
        "path": "/echo/some/path",
        "query": "x=1&y=2",
        "body": "raw bytes",
        "x_program_id": "p",
    }


@pytest.mark.parametrize("program_id", ["naïve-agent", "tab\there", "emoji-🚀", "\x80"])
async def test_any_program_id_gives_a_valid_request_id_header(
    client: httpx.AsyncClient, backend: FakeBackend, program_id: str
) -> None:
    r = await client.post("/v1/chat/completions", json={**CHAT, "program_id": program_id})
    assert r.status_code == 200
    assert backend.headers[-1]["X-Request-Id"].isascii()
    assert program_id in (await client.get("/programs")).json()


async def test_a_plain_passthrough_answer_is_relayed_as_it_arrives(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Before: a plain (not streamed) answer was read whole before the client saw a byte, so
    each one cost its size in memory (10 answers of 60 MB: 93 -> 685 MB resident). Here the
    backend sends half, then waits until the client has had it."""
    half = b'"' + b"x" * 999_998 + b'"'  # a JSON string: a plain answer, not a stream
    client_has_half = trio.Event()
    app = create_backend_app("plainbackend")

    @app.get("/blob")
    async def blob() -> Response:
        async def body() -> AsyncIterator[bytes]:
            yield b"["
            yield half
            with trio.fail_after(10):
                await client_has_half.wait()
            yield b"," + half + b"]"

        response = Response(body(), content_type="application/json")
        response.headers["content-length"] = str(2 * len(half) + 3)
        return response

    state = LoopbackBackend()
    await nursery.start(serve_backend, app, state)
    async with (
        running_proxy(tmp_path / "audit.db", backends=state.url, passthrough="/blob") as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=10) as client,
    ):
        with trio.fail_after(10):
            async with client.stream("GET", "/blob") as r:
                assert r.status_code == 200
                assert r.headers["content-length"] == str(2 * len(half) + 3)
                assert "transfer-encoding" not in r.headers
                received = b""
                async for chunk in r.aiter_raw():
                    received += chunk
                    if len(received) > len(half):
                        client_has_half.set()
        assert received == b"[" + half + b"," + half + b"]"


async def test_a_stream_is_relayed_as_it_arrives(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    """The backend sends its first event, then waits until the client has had it: a proxy that
    buffered the stream would never deliver it, and the test fails after 10 s instead of
    hanging. No clock is read, so a busy machine cannot fail it."""
    backend.rest_of_stream = trio.Event()
    body = {**CHAT, "stream": True}
    events: list[bytes] = []
    with trio.fail_after(10):
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"x-fake-words": "30"}
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line.encode())
                    backend.rest_of_stream.set()
    assert b"w0 " in events[0]
    assert len(events) == 31  # 30 words and [DONE]
    assert events[-1] == b"data: [DONE]"


async def test_an_empty_tools_list_never_reaches_the_backend(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    """vLLM answers ``tools: []`` with a 400 ("must not be an empty array"), which Claude Code
    sends on its small background calls: the proxy drops it, and the tool_choice among none;
    a list with tools goes as it came."""
    empty = await client.post(
        "/v1/chat/completions", json={**CHAT, "tools": [], "tool_choice": "auto"}
    )
    assert empty.status_code == 200, empty.text
    tool = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}
    some = await client.post(
        "/v1/chat/completions", json={**CHAT, "tools": [tool], "tool_choice": "auto"}
    )
    assert some.status_code == 200, some.text
    first, second = backend.received[-2:]
    assert "tools" not in first
    assert "tool_choice" not in first
    assert (second["tools"], second["tool_choice"]) == ([tool], "auto")
