"""The proxy end to end: real Hypercorn on loopback in front of the simulated vLLM, real
SQLite. (What is forwarded byte for byte is checked in test_forwarding.py.)"""

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
from thunderproxy.runtime import RunningProxy
from thunderproxy.sim import SimConfig, Simulator, open_simulator

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT = "please list the files in the repository " * 8
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
FIVE = {"X-Sim-Output-Tokens": "5"}


@pytest.fixture
async def sim() -> AsyncIterator[Simulator]:
    config = SimConfig(
        kv_capacity_tokens=16_000,
        enable_prompt_tokens_details=True,
        enable_request_id_headers=True,
    )
    async with open_simulator(config) as simulator:
        yield simulator


@pytest.fixture
async def proxy(sim: Simulator, tmp_path: Path) -> AsyncIterator[RunningProxy]:
    async with running_proxy(tmp_path / "audit.db", backends=sim.url) as running:
        yield running


@pytest.fixture
async def client(proxy: RunningProxy) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as c:
        yield c


def sse_payloads(text: str) -> list[Any]:
    return [
        json.loads(event[6:])
        for event in text.split("\n\n")
        if event.startswith("data: ") and event != "data: [DONE]"
    ]


async def test_non_streaming_chat_tracks_the_program(
    client: httpx.AsyncClient, sim: Simulator
) -> None:
    body = {**CHAT, "program_id": "agent-1"}
    first = await client.post("/v1/chat/completions", json=body, headers=FIVE)
    assert first.status_code == 200
    assert first.headers["x-request-id"] == "agent-1-1"
    usage = first.json()["usage"]
    assert usage["completion_tokens"] == 5
    second = await client.post("/v1/chat/completions", json=body, headers=FIVE)
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    agent = (await client.get("/programs")).json()["agent-1"]
    assert agent["status"] == "acting"
    assert agent["state"] == "active"
    assert agent["step_count"] == 2
    assert agent["total_tokens"] == usage["prompt_tokens"] + 5
    # Tokens, as the backend counted the last prompt; its characters beside them.
    assert agent["context_len"] == usage["prompt_tokens"]
    assert agent["context_chars"] == len(PROMPT)
    assert agent["backend"] == sim.url
    assert agent["profile"]["step_count"] == 2
    assert agent["profile"]["avg_kv_hit_rate"] > 0


@pytest.mark.parametrize(
    ("extra", "headers", "expected", "source"),
    [
        pytest.param({"program_id": "from-body"}, {}, "from-body", "explicit", id="body"),
        pytest.param(
            {"extra_body": {"program_id": "extra"}}, {}, "extra", "explicit", id="extra_body"
        ),
        pytest.param({}, {"X-Program-Id": "from-header"}, "from-header", "explicit", id="header"),
        pytest.param({}, {"X-Session-ID": "s-1"}, "s-1", "session_header", id="session"),
        # Nothing names it: a new program, recognised by its prompt from now on.
        pytest.param({}, {}, "auto-", "new", id="new"),
    ],
)
async def test_program_id_sources(
    client: httpx.AsyncClient,
    extra: dict[str, Any],
    headers: dict[str, str],
    expected: str,
    source: str,
) -> None:
    r = await client.post("/v1/chat/completions", json={**CHAT, **extra}, headers=headers)
    assert r.status_code == 200
    request_id = r.headers["x-request-id"]
    assert request_id.startswith(expected)
    assert request_id.endswith("-1")
    program_id = request_id.removesuffix("-1")
    programs = (await client.get("/programs")).json()
    assert programs[program_id]["source"] == source


async def test_streaming_hides_the_usage_chunk_it_asked_for(
    client: httpx.AsyncClient, proxy: RunningProxy
) -> None:
    body = {**CHAT, "stream": True, "program_id": "s"}
    r = await client.post("/v1/chat/completions", json=body, headers=FIVE)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(r.text)
    assert all(p["choices"] for p in payloads)
    assert "usage" not in payloads[-1] or payloads[-1]["usage"] is None
    assert r.text.endswith("data: [DONE]\n\n")
    program = proxy.services.scheduler.registry.get("s")
    assert program.completion_tokens_total == 5
    assert program.status.value == "acting"


async def test_streaming_keeps_the_usage_chunk_the_client_asked_for(
    client: httpx.AsyncClient,
) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    r = await client.post("/v1/chat/completions", json=body, headers=FIVE)
    payloads = sse_payloads(r.text)
    assert payloads[-1]["choices"] == []
    assert payloads[-1]["usage"]["completion_tokens"] == 5


async def test_unknown_path_passes_through(client: httpx.AsyncClient) -> None:
    r = await client.post("/tokenize", json={"model": MODEL, "prompt": "hello world"})
    assert r.status_code == 200
    assert r.json()["count"] == len(r.json()["tokens"]) > 0
    assert (await client.get("/version")).json() == {"version": "0.33.0"}
    assert (await client.get("/v1/models")).json()["data"][0]["id"] == MODEL
    missing = await client.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert missing.status_code == 404


async def test_health_and_metrics(client: httpx.AsyncClient, sim: Simulator) -> None:
    await client.post("/v1/chat/completions", json={**CHAT, "program_id": "h"}, headers=FIVE)
    health = (await client.get("/health")).json()
    assert health["status"] == "ok"
    assert health["router_mode"] == "tr"
    assert health["scheduling_enabled"] is True
    assert health["backends"] == [sim.url]
    assert health["programs_count"] == 1
    assert health["acting_count"] == 1
    assert health["per_backend"][sim.url]["acting"] == 1
    assert health["profile_enabled"] is True

    metrics = (await client.get("/metrics")).json()
    entry = metrics["backends"][sim.url]
    assert metrics["metrics_enabled"] is True
    assert entry["healthy"] is True
    assert entry["cache_config"] == {
        "block_size": 16,
        "num_gpu_blocks": 1000,
        "total_tokens_capacity": 16_000,
    }
    program_tokens = (await client.get("/programs")).json()["h"]["total_tokens"]
    assert entry["active_program_tokens"] == program_tokens
    assert entry["active_program_tokens_ratio"] == pytest.approx(program_tokens / 16_000)


async def test_profiles(client: httpx.AsyncClient) -> None:
    await client.post("/v1/chat/completions", json={**CHAT, "program_id": "prof", "stream": True})
    profiles = (await client.get("/profiles")).json()
    assert set(profiles["prof"]) == {
        "step_count",
        "avg_prefill_s",
        "avg_decode_s",
        "avg_pause_s",
        "avg_tool_call_s",
        "avg_kv_hit_rate",
    }
    one = (await client.get("/profiles/prof")).json()
    assert one["step_count"] == 1
    assert one["avg_prefill_s"] > 0
    missing = await client.get("/profiles/nobody")
    assert missing.status_code == 404
    assert "nobody" in missing.json()["error"]["message"]


async def test_profiles_disabled_answers_400(sim: Simulator, tmp_path: Path) -> None:
    async with (
        running_proxy(tmp_path / "a.db", backends=sim.url, profile=False) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        r = await client.get("/profiles")
    assert r.status_code == 400
    assert "--profile" in r.json()["error"]["message"]


async def test_release(client: httpx.AsyncClient) -> None:
    await client.post("/v1/chat/completions", json={**CHAT, "program_id": "rel"}, headers=FIVE)
    r = await client.post("/programs/release", json={"program_id": "rel"})
    assert r.json() == {"program_id": "rel", "released": True}
    assert "rel" not in (await client.get("/programs")).json()
    again = await client.post("/programs/release", json={"program_id": "rel"})
    assert again.status_code == 404
    assert again.json()["error"]["type"] == "not_found_error"


async def test_tool_time_is_measured_between_steps(
    client: httpx.AsyncClient, proxy: RunningProxy
) -> None:
    body = {**CHAT, "program_id": "tool"}
    await client.post("/v1/chat/completions", json=body, headers=FIVE)
    await trio.sleep(0.2)
    await client.post("/v1/chat/completions", json=body, headers=FIVE)
    program = proxy.services.scheduler.registry.get("tool")
    assert program.step_count == 2
    assert program.last_tool_s is not None
    assert 0.2 <= program.last_tool_s < 1.0


async def test_backend_error_ends_the_step(client: httpx.AsyncClient, proxy: RunningProxy) -> None:
    headers = {"X-Sim-Fault": "500"}
    r = await client.post("/v1/chat/completions", json={**CHAT, "program_id": "e"}, headers=headers)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "InternalServerError"
    program = proxy.services.scheduler.registry.get("e")
    assert program.status.value == "acting"
    assert program.in_flight == 0


async def test_unreachable_backend_gives_openai_json_error(tmp_path: Path) -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = f"http://127.0.0.1:{port}"
    async with (
        running_proxy(
            tmp_path / "a.db", backends=dead, metrics_interval=60, ready_timeout=0.5
        ) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        health = (await client.get("/health")).json()
        r = await client.post("/v1/chat/completions", json={**CHAT, "program_id": "x"})
    assert health["healthy_backends"] == []
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["type"] == "service_unavailable"
    assert dead in error["message"]


async def test_invalid_json_is_a_400(client: httpx.AsyncClient, sim: Simulator) -> None:
    r = await client.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = await client.post("/v1/chat/completions", json={**CHAT, "program_id": 7})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "program_id"
    assert sim.engine.scheduler.stats.prompt_tokens == 0


async def test_client_disconnect_mid_stream_cancels_upstream_and_records_499(
    sim: Simulator, tmp_path: Path
) -> None:
    db = tmp_path / "audit.db"
    stats = sim.engine.scheduler.stats
    async with running_proxy(db, backends=sim.url) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as client:
            body = {**CHAT, "stream": True, "program_id": "gone", "max_tokens": 4000}
            headers = {"X-Sim-Output-Tokens": "4000"}
            async with (
                client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r,
                aclosing(r.aiter_raw()) as chunks,
            ):
                async for _ in chunks:
                    break
        # The simulator aborts the request as soon as the proxy closes the upstream connection.
        await wait_for(lambda: not sim.engine.scheduler.running)
        # Aborted, not merely paused: nothing of it is left to generate.
        assert not sim.engine.scheduler.waiting
        assert stats.generation_tokens < 200
        program = proxy.services.scheduler.registry.get("gone")
        await wait_for(lambda: program.in_flight == 0)
        assert program.status.value == "acting"
    rows = query(db, "select status, error, stream from steps where program_id = 'gone'")
    assert rows == [
        {
            "status": 499,
            "error": "client closed the connection before the response ended",
            "stream": 1,
        }
    ]


async def test_client_disconnect_before_first_byte_cancels_upstream(
    sim: Simulator, tmp_path: Path
) -> None:
    db = tmp_path / "audit.db"
    async with running_proxy(db, backends=sim.url) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as client:
            with trio.move_on_after(0.3):
                await client.post(
                    "/v1/chat/completions",
                    json={**CHAT, "program_id": "early"},
                    headers={"X-Sim-Fault": "slow"},  # 5 s before the engine sees it
                )
        await wait_for(lambda: proxy.services.scheduler.registry.get("early").in_flight == 0)
    assert sim.engine.scheduler.stats.prompt_tokens == 0
    assert query(db, "select status from steps where program_id = 'early'") == [{"status": 499}]


async def test_clean_shutdown_writes_every_audit_row(sim: Simulator, tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    n_programs, n_steps = 20, 3
    async with (
        running_proxy(db, backends=sim.url) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):

        async def agent(i: int) -> None:
            for _ in range(n_steps):
                body = {**CHAT, "program_id": f"p{i}", "stream": i % 2 == 0}
                r = await client.post("/v1/chat/completions", json=body, headers=FIVE)
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
    assert runs == [{"stopped": 1, "router": "tr"}]
