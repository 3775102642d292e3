"""The proxy end to end: real Hypercorn on loopback, a real backend server, real SQLite."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import query, running_proxy, wait_for
from tests.fakebackend import FakeBackend, serve_fake_backend
from thunderproxy.runtime import RunningProxy

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture
async def backend(nursery: trio.Nursery) -> FakeBackend:
    state = FakeBackend()
    await nursery.start(serve_fake_backend, state)
    return state


@pytest.fixture
async def proxy(backend: FakeBackend, tmp_path: Path) -> AsyncIterator[RunningProxy]:
    async with running_proxy(tmp_path / "audit.db", backends=backend.url) as running:
        yield running


@pytest.fixture
async def client(proxy: RunningProxy) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as c:
        yield c


def sse_payloads(text: str) -> list[Any]:
    out = []
    for event in text.split("\n\n"):
        if event.startswith("data: ") and event != "data: [DONE]":
            out.append(json.loads(event[6:]))
    return out


async def test_non_streaming_chat_strips_program_id_and_tracks_the_program(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    r = await client.post("/v1/chat/completions", json={**CHAT, "program_id": "agent-1"})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 5
    assert "program_id" not in backend.received[-1]
    assert backend.headers[-1]["X-Request-Id"] == "agent-1-1"

    programs = (await client.get("/programs")).json()
    agent = programs["agent-1"]
    assert agent["status"] == "acting"
    assert agent["state"] == "active"
    assert agent["step_count"] == 1
    assert agent["total_tokens"] == 15
    assert agent["context_len"] == len("hello there")
    assert agent["backend"] == backend.url
    assert agent["profile"]["step_count"] == 1
    assert agent["profile"]["avg_kv_hit_rate"] == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("extra", "headers", "expected"),
    [
        pytest.param({"program_id": "from-body"}, {}, "from-body", id="body"),
        pytest.param(
            {"extra_body": {"program_id": "from-extra"}}, {}, "from-extra", id="extra_body"
        ),
        pytest.param({}, {"X-Program-Id": "from-header"}, "from-header", id="header"),
        pytest.param({}, {}, "default", id="default"),
    ],
)
async def test_program_id_sources(
    client: httpx.AsyncClient,
    backend: FakeBackend,
    extra: dict[str, Any],
    headers: dict[str, str],
    expected: str,
) -> None:
    r = await client.post("/v1/chat/completions", json={**CHAT, **extra}, headers=headers)
    assert r.status_code == 200
    forwarded = backend.received[-1]
    assert "program_id" not in forwarded
    assert "extra_body" not in forwarded
    assert "X-Program-Id" not in backend.headers[-1]
    assert expected in (await client.get("/programs")).json()


async def test_streaming_hides_the_usage_chunk_it_asked_for(
    client: httpx.AsyncClient, backend: FakeBackend, proxy: RunningProxy
) -> None:
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True, "program_id": "s"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(r.text)
    assert len(payloads) == 5
    assert all(p["choices"] for p in payloads)
    assert r.text.endswith("data: [DONE]\n\n")
    assert backend.received[-1]["stream_options"] == {"include_usage": True}
    program = proxy.services.scheduler.registry.get("s")
    assert program.total_tokens == 15
    assert program.status.value == "acting"


async def test_streaming_keeps_the_usage_chunk_the_client_asked_for(
    client: httpx.AsyncClient,
) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    r = await client.post("/v1/chat/completions", json=body)
    payloads = sse_payloads(r.text)
    assert payloads[-1]["choices"] == []
    assert payloads[-1]["usage"]["total_tokens"] == 15


async def test_stream_is_relayed_as_it_arrives(client: httpx.AsyncClient) -> None:
    body = {**CHAT, "stream": True}
    arrivals = []
    start = trio.current_time()
    async with client.stream(
        "POST",
        "/v1/chat/completions",
        json=body,
        headers={"x-fake-delay": "0.2", "x-fake-words": "4"},
    ) as r:
        async for _ in r.aiter_raw():
            arrivals.append(trio.current_time() - start)
    # The first chunk arrives after one delay, not after the whole stream (4 delays).
    assert arrivals[0] < 0.6
    assert arrivals[-1] >= 0.75


async def test_unknown_path_passes_through_unchanged(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/echo/some/path?x=1&y=2", content=b"raw bytes", headers={"X-Program-Id": "p"}
    )
    assert r.status_code == 201
    assert r.headers["x-fake"] == "yes"
    echoed = r.json()
    assert echoed == {
        "method": "POST",
        "path": "/echo/some/path",
        "query": "x=1&y=2",
        "body": "raw bytes",
        "x_program_id": "p",
    }
    models = await client.get("/v1/models")
    assert models.json()["data"][0]["id"] == "fake"


async def test_health_and_metrics(client: httpx.AsyncClient, backend: FakeBackend) -> None:
    await client.post("/v1/chat/completions", json={**CHAT, "program_id": "h"})
    health = (await client.get("/health")).json()
    assert health["status"] == "ok"
    assert health["router_mode"] == "default"
    assert health["scheduling_enabled"] is False
    assert health["backends"] == [backend.url]
    assert health["programs_count"] == 1
    assert health["acting_count"] == 1
    assert health["per_backend"][backend.url]["acting"] == 1
    assert health["profile_enabled"] is True

    metrics = (await client.get("/metrics")).json()
    entry = metrics["backends"][backend.url]
    assert metrics["metrics_enabled"] is True
    assert entry["healthy"] is True
    assert entry["cache_config"] == {
        "block_size": 16,
        "num_gpu_blocks": 1000,
        "total_tokens_capacity": 16000,
    }
    assert entry["metrics"]["kv_cache_usage_perc"] == 0.25
    assert entry["active_program_tokens"] == 15
    assert entry["active_program_tokens_ratio"] == pytest.approx(15 / 16000)


async def test_profiles(client: httpx.AsyncClient) -> None:
    await client.post("/v1/chat/completions", json={**CHAT, "program_id": "prof"})
    profiles = (await client.get("/profiles")).json()
    assert set(profiles["prof"]) == {
        "step_count",
        "avg_prefill_s",
        "avg_decode_s",
        "avg_pause_s",
        "avg_tool_call_s",
        "avg_kv_hit_rate",
    }
    assert (await client.get("/profiles/prof")).json()["step_count"] == 1
    missing = await client.get("/profiles/nobody")
    assert missing.status_code == 404
    assert "nobody" in missing.json()["error"]["message"]


async def test_profiles_disabled_answers_400(backend: FakeBackend, tmp_path: Path) -> None:
    async with (
        running_proxy(tmp_path / "a.db", backends=backend.url, profile=False) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        r = await client.get("/profiles")
    assert r.status_code == 400
    assert "--profile" in r.json()["error"]["message"]


async def test_release(client: httpx.AsyncClient) -> None:
    await client.post("/v1/chat/completions", json={**CHAT, "program_id": "rel"})
    r = await client.post("/programs/release", json={"program_id": "rel"})
    assert r.json() == {"program_id": "rel", "released": True}
    assert "rel" not in (await client.get("/programs")).json()
    again = await client.post("/programs/release", json={"program_id": "rel"})
    assert again.status_code == 404
    assert again.json()["error"]["type"] == "not_found_error"


async def test_tool_time_is_measured_between_steps(
    client: httpx.AsyncClient, proxy: RunningProxy
) -> None:
    await client.post("/v1/chat/completions", json={**CHAT, "program_id": "tool"})
    await trio.sleep(0.2)
    await client.post("/v1/chat/completions", json={**CHAT, "program_id": "tool"})
    program = proxy.services.scheduler.registry.get("tool")
    assert program.step_count == 2
    assert program.last_tool_s is not None
    assert 0.2 <= program.last_tool_s < 1.0


async def test_backend_error_ends_the_step(client: httpx.AsyncClient, proxy: RunningProxy) -> None:
    r = await client.post(
        "/v1/chat/completions", json={**CHAT, "program_id": "err"}, headers={"x-fake-status": "500"}
    )
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "fake failure"
    program = proxy.services.scheduler.registry.get("err")
    assert program.status.value == "acting"
    assert program.in_flight == 0


async def test_unreachable_backend_gives_openai_json_error(tmp_path: Path) -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = f"http://127.0.0.1:{port}"
    async with (
        running_proxy(tmp_path / "a.db", backends=dead, metrics_interval=60) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        health = (await client.get("/health")).json()
        r = await client.post("/v1/chat/completions", json={**CHAT, "program_id": "x"})
    assert health["healthy_backends"] == []
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["type"] == "service_unavailable"
    assert dead in error["message"]


async def test_invalid_json_is_a_400(client: httpx.AsyncClient, backend: FakeBackend) -> None:
    r = await client.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = await client.post("/v1/chat/completions", json={**CHAT, "program_id": 7})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "program_id"
    assert backend.received == []


async def test_client_disconnect_mid_stream_cancels_upstream_and_records_499(
    backend: FakeBackend, tmp_path: Path
) -> None:
    db = tmp_path / "audit.db"
    async with running_proxy(db, backends=backend.url) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as client:
            body = {**CHAT, "stream": True, "program_id": "gone"}
            headers = {"x-fake-delay": "0.1", "x-fake-words": "50"}
            async with (
                client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r,
                aclosing(r.aiter_raw()) as chunks,
            ):
                async for _ in chunks:
                    break
        await wait_for(lambda: backend.aborted == ["gone-1"])
        program = proxy.services.scheduler.registry.get("gone")
        await wait_for(lambda: program.in_flight == 0)
        assert program.status.value == "acting"
    assert backend.completed == []
    rows = query(db, "select status, error, stream from steps where program_id = 'gone'")
    assert rows == [
        {
            "status": 499,
            "error": "client closed the connection before the response ended",
            "stream": 1,
        }
    ]


async def test_client_disconnect_before_first_byte_cancels_upstream(
    backend: FakeBackend, tmp_path: Path
) -> None:
    db = tmp_path / "audit.db"
    async with running_proxy(db, backends=backend.url) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as client:
            with trio.move_on_after(0.3):
                await client.post(
                    "/v1/chat/completions",
                    json={**CHAT, "program_id": "early"},
                    headers={"x-fake-delay": "1", "x-fake-words": "5"},
                )
        await wait_for(lambda: proxy.services.scheduler.registry.get("early").in_flight == 0)
    assert query(db, "select status from steps where program_id = 'early'") == [{"status": 499}]


async def test_clean_shutdown_writes_every_audit_row(backend: FakeBackend, tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    n_programs, n_steps = 20, 3
    async with (
        running_proxy(db, backends=backend.url) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):

        async def agent(i: int) -> None:
            for _ in range(n_steps):
                body = {**CHAT, "program_id": f"p{i}", "stream": i % 2 == 0}
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200

        async with trio.open_nursery() as nursery:
            for i in range(n_programs):
                nursery.start_soon(agent, i)
        await client.post("/programs/release", json={"program_id": "p0"})
    steps = query(db, "select count(*) as n, count(prompt_tokens) as with_usage from steps")
    assert steps == [{"n": n_programs * n_steps, "with_usage": n_programs * n_steps}]
    # first request, then per step: reasoning->acting, and acting->reasoning before steps 2..n
    per_program = 1 + n_steps + (n_steps - 1)
    transitions = query(db, "select count(*) as n from transitions")
    assert transitions == [{"n": n_programs * per_program + 1}]
    stopped = query(db, "select reason from transitions where to_status = 'stopped'")
    assert stopped == [{"reason": "released by client"}]
    runs = query(db, "select stopped_at is not null as stopped, router from runs")
    assert runs == [{"stopped": 1, "router": "default"}]
