"""Backend faults, driven by the simulator's fault knobs: the client gets a clean error (or the
stream ends with an error event) within the configured timeout, the program stays consistent,
and a failing backend is taken out of placement with its programs re-placed."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import query, running_proxy, wait_for
from thunderproxy.config import load_settings
from thunderproxy.runtime import RunningProxy, run
from thunderproxy.sim import SimConfig, Simulator, open_simulator

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "look at the failing test " * 4}]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def stack(
    tmp_path: Path, sim_config: SimConfig | None = None, **settings: Any
) -> AsyncIterator[tuple[Simulator, RunningProxy, httpx.AsyncClient]]:
    config = sim_config or SimConfig(enable_prompt_tokens_details=True, output_len_dist="fixed:8")
    async with (
        open_simulator(config) as sim,
        running_proxy(tmp_path / "audit.db", backends=sim.url, **settings) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        yield sim, proxy, client


def sse(text: str) -> list[Any]:
    return [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]


@pytest.mark.parametrize("status", [500, 503])
async def test_backend_error_status_reaches_the_client_and_ends_the_step(
    tmp_path: Path, status: int
) -> None:
    async with stack(tmp_path) as (_, proxy, client):
        headers = {"X-Sim-Fault": str(status), "X-Program-Id": "p"}
        r = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert r.status_code == status
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        program = proxy.services.scheduler.registry.get("p")
        assert (program.status.value, program.in_flight) == ("acting", 0)
    rows = query(tmp_path / "audit.db", "select status, error is not null as e from steps")
    assert rows == [{"status": status, "e": 1}]


async def test_a_hanging_backend_times_out_and_is_taken_out_after_repeated_hangs(
    tmp_path: Path,
) -> None:
    async with stack(tmp_path, first_byte_timeout=0.3, metrics_interval=60) as (_, proxy, client):
        backend = proxy.services.pool.healthy()[0]
        for attempt in range(3):
            start = trio.current_time()
            r = await client.post(
                "/v1/chat/completions", json=CHAT, headers={"X-Sim-Fault": "hang"}
            )
            assert r.status_code == 504
            assert 0.3 <= trio.current_time() - start < 5.0  # a hang never ends by itself
            assert r.json()["error"]["type"] == "timeout_error"
            assert backend.healthy is (attempt < 2)
        # Out of placement now: a clear 503 until the poller sees it answer again.
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503


async def test_a_stream_cut_midway_ends_with_an_error_event(tmp_path: Path) -> None:
    async with stack(tmp_path) as (_, proxy, client):
        body = {**CHAT, "stream": True, "max_tokens": 40, "program_id": "cut"}
        headers = {"X-Sim-Fault": "stream", "X-Sim-Output-Tokens": "40"}
        r = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200
        events = sse(r.text)
        assert "error" in events[-1]
        assert r.text.endswith("data: [DONE]\n\n")
        program = proxy.services.scheduler.registry.get("cut")
        assert (program.status.value, program.in_flight) == ("acting", 0)
    rows = query(tmp_path / "audit.db", "select status, error from steps")
    assert rows[0]["status"] == 200
    assert rows[0]["error"]


async def test_a_slow_trickle_is_cut_by_the_read_timeout(tmp_path: Path) -> None:
    # time_scale 40: each ~7 ms engine step takes ~0.3 s, far beyond a 0.1 s read timeout.
    slow = SimConfig(time_scale=40.0, output_len_dist="fixed:50")
    async with stack(tmp_path, slow, read_timeout=0.1) as (_, _proxy, client):
        body = {**CHAT, "stream": True, "program_id": "trickle"}
        start = trio.current_time()
        r = await client.post("/v1/chat/completions", json=body)
        assert trio.current_time() - start < 2.0
        assert r.status_code == 200
        error = sse(r.text)[-1]["error"]
        assert error["code"] == 504
        assert "--read-timeout" in error["message"]
    rows = query(tmp_path / "audit.db", "select status from steps")
    assert rows == [{"status": 504}]


async def test_connection_refused_marks_the_backend_down(tmp_path: Path) -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:

        async def serve_sim(*, task_status: trio.TaskStatus[str]) -> None:
            async with open_simulator(SimConfig(output_len_dist="fixed:4")) as sim:
                task_status.started(sim.url)
                await stop.wait()

        url = await nursery.start(serve_sim)
        async with (
            running_proxy(tmp_path / "a.db", backends=url, metrics_interval=60) as proxy,
            httpx.AsyncClient(base_url=proxy.url) as client,
        ):
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            stop.set()
            await wait_for(lambda: not nursery.child_tasks)
            r = await client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 502
            assert url in r.json()["error"]["message"]
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 503
            # No call is left counted as in flight, whichever program it was recognised as.
            assert all(p.in_flight == 0 for p in proxy.services.scheduler.registry)


async def test_programs_of_a_dead_backend_move_to_a_live_one(tmp_path: Path) -> None:
    config = SimConfig(output_len_dist="fixed:4")
    async with (
        open_simulator(config) as a,
        open_simulator(config) as b,
        running_proxy(
            tmp_path / "a.db", backends=f"{a.url},{b.url}", metrics_interval=0.1, router="tr"
        ) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        body = {**CHAT, "program_id": "mover"}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        registry = proxy.services.scheduler.registry
        first = registry.get("mover").backend
        dead, alive = (a, b) if first == a.url else (b, a)
        await client.post(f"{dead.url}/_sim/kill")
        await wait_for(lambda: not proxy.services.pool.get(dead.url).healthy)  # type: ignore[union-attr]
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        assert registry.get("mover").backend == alive.url
    decisions = query(
        tmp_path / "a.db", "select action, rule, backend, target_backend from decisions"
    )
    assert {
        "action": "migrate",
        "rule": "backend_unhealthy",
        "backend": dead.url,
        "target_backend": alive.url,
    } in decisions


async def test_start_waits_for_backends_to_be_ready(tmp_path: Path) -> None:
    port = free_port()
    settings = load_settings(
        host="127.0.0.1",
        port=0,
        db=str(tmp_path / "a.db"),
        backends=f"http://127.0.0.1:{port}",
        ready_timeout=10,
    )

    async def late_simulator() -> None:
        await trio.sleep(1.0)
        async with open_simulator(SimConfig(output_len_dist="fixed:4"), port=port):
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(late_simulator)
        started = trio.current_time()
        proxy: RunningProxy = await nursery.start(partial(run, settings))
        # run() reports started, and serves, only once the backend answered.
        assert trio.current_time() - started >= 1.0
        async with httpx.AsyncClient(base_url=proxy.url) as client:
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        proxy.shutdown.set()
        await wait_for(lambda: len(nursery.child_tasks) == 1)
        nursery.cancel_scope.cancel()


async def test_start_is_bounded_when_backends_never_come(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    start = trio.current_time()
    async with (
        running_proxy(tmp_path / "a.db", backends=url, ready_timeout=0.5) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        # Bounded by --ready-timeout, not by the default of 30 s; the margin is for a start-up
        # that takes seconds on a busy machine.
        assert trio.current_time() - start < 15.0
        assert (await client.get("/health")).json()["status"] == "degraded"
