"""Disconnects, injected faults, kill/revive and the /_sim control endpoints over HTTP."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from thunderproxy.sim import SimConfig, Simulator, open_simulator

from .helpers import SMALL

REAL_TIME = {"time_scale": 1.0}
LONG = {"prompt": list(range(100, 400)), "max_tokens": 1000, "ignore_eos": True}


async def wait_idle(client: httpx.AsyncClient) -> dict[str, Any]:
    with trio.fail_after(5):
        while True:
            state = (await client.get("/_sim/state")).json()
            if not state["running"] and not state["waiting"]:
                return state  # type: ignore[no-any-return]
            await trio.sleep(0.01)


@pytest.mark.parametrize("sim", [REAL_TIME], indirect=True)
async def test_client_disconnect_aborts_and_keeps_full_blocks(
    client: httpx.AsyncClient, sim: Simulator
) -> None:
    async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break  # first token seen: hang up mid-stream
    state = await wait_idle(client)
    assert state["blocks"]["used"] == 0
    assert state["blocks"]["cached_free"] == 300 // 32
    assert state["counters"]["generation_tokens"] < 100


# Ten times slower than real time: the prefill takes about 0.6 s of wall time.
@pytest.mark.parametrize("sim", [{"time_scale": 10.0}], indirect=True)
async def test_disconnect_before_the_first_token_aborts_too(client: httpx.AsyncClient) -> None:
    body = {"prompt": list(range(1, 1900)), "max_tokens": 10, "stream": True}
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/v1/completions", json=body, timeout=0.1)
    state = await wait_idle(client)
    assert state["counters"]["generation_tokens"] == 0
    assert state["blocks"]["used"] == 0


@pytest.mark.parametrize(
    ("fault", "status", "kind"),
    [("500", 500, "InternalServerError"), ("503", 503, "ServiceUnavailableError")],
)
async def test_forced_error_faults(
    client: httpx.AsyncClient, fault: str, status: int, kind: str
) -> None:
    r = await client.post("/v1/completions", json=LONG, headers={"X-Sim-Fault": fault})
    assert r.status_code == status
    assert r.json()["error"]["type"] == kind


async def test_mid_stream_error_fault(client: httpx.AsyncClient) -> None:
    body = {**LONG, "max_tokens": 20, "stream": True}
    lines = []
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"X-Sim-Fault": "stream"}) as r:  # fmt: skip
        assert r.status_code == 200
        lines = [line for line in [x async for x in r.aiter_lines()] if line]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: ") :])
    assert error["error"]["code"] == 500
    assert len(lines) - 2 == 9  # tokens before the failure at half of max_tokens
    r = await client.post("/v1/completions", json={**LONG, "max_tokens": 4},
                          headers={"X-Sim-Fault": "stream"})  # fmt: skip
    assert r.status_code == 500


async def test_hang_fault_never_answers_until_the_client_gives_up(
    client: httpx.AsyncClient,
) -> None:
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/v1/completions", json=LONG, headers={"X-Sim-Fault": "hang"},
                          timeout=0.2)  # fmt: skip
    assert (await client.get("/_sim/state")).json()["counters"]["steps"] == 0


@pytest.mark.parametrize("sim", [{"time_scale": 0.05, "slow_seconds": 4.0}], indirect=True)
async def test_slow_fault_delays_the_start(client: httpx.AsyncClient) -> None:
    start = trio.current_time()
    r = await client.post("/v1/completions", json={**LONG, "max_tokens": 1},
                          headers={"X-Sim-Fault": "slow"})  # fmt: skip
    assert r.status_code == 200
    assert trio.current_time() - start >= 0.2  # 4 simulated seconds at 0.05


@pytest.mark.parametrize("sim", [{"fail_rate": 1.0, "fail_types": "503"}], indirect=True)
async def test_fail_rate_applies_to_every_request(client: httpx.AsyncClient) -> None:
    statuses = [(await client.post("/v1/completions", json=LONG)).status_code for _ in range(3)]
    assert statuses == [503, 503, 503]


@pytest.mark.parametrize("sim", [{"fail_rate": 0.5, "fail_types": "500", "seed": 3}], indirect=True)
async def test_fail_rate_is_a_seeded_fraction(client: httpx.AsyncClient) -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": 1}
    statuses = [(await client.post("/v1/completions", json=body)).status_code for _ in range(40)]
    assert 8 <= statuses.count(500) <= 32
    assert set(statuses) == {200, 500}


@pytest.mark.parametrize("sim", [REAL_TIME], indirect=True)
async def test_kill_fails_in_flight_and_health_goes_503(client: httpx.AsyncClient) -> None:
    events: list[str] = []

    async def stream() -> None:
        async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line:
                    events.append(line)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream)
        with trio.fail_after(5):
            while not events:
                await trio.sleep(0.01)
        assert (await client.post("/_sim/kill")).json() == {"success": True}
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: ") :])["error"]["type"] == "InternalServerError"
    assert (await client.get("/health")).status_code == 503
    assert (await client.post("/v1/completions", json=LONG)).status_code == 500
    await client.post("/_sim/revive")
    assert (await client.get("/health")).status_code == 200
    r = await client.post("/v1/completions", json={**LONG, "max_tokens": 2})
    assert r.status_code == 200


async def test_sim_config_reset_and_trace(client: httpx.AsyncClient, sim: Simulator) -> None:
    config = (
        await client.post("/_sim/config", json={"fail_rate": 1.0, "fail_types": "503"})
    ).json()
    assert config["fail_rate"] == 1.0
    assert (await client.post("/v1/completions", json=LONG)).status_code == 503
    await client.post("/_sim/config", json={"fail_rate": 0.0})
    r = await client.post("/v1/completions", json={**LONG, "max_tokens": 3})
    assert r.status_code == 200
    steps = (await client.get("/_sim/trace", params={"last": 2})).json()["steps"]
    assert [s["num_tokens"] for s in steps] == [1, 1]
    assert steps[-1]["batch"][0]["decode"] is True
    assert (await client.post("/_sim/config", json={"nope": 1})).status_code == 400
    # Structural knobs rebuild the engine (cache and counters included).
    await client.post("/_sim/config", json={"num_gpu_blocks": 50})
    state = (await client.get("/_sim/state")).json()
    assert (state["blocks"]["total"], state["counters"]["steps"]) == (50, 0)
    await client.post("/v1/completions", json={**LONG, "max_tokens": 1})
    assert (await client.post("/_sim/reset")).json() == {"success": True}
    assert (await client.get("/_sim/state")).json()["counters"]["prompt_tokens"] == 0


async def test_open_simulator_exits_promptly_with_streams_in_flight() -> None:
    config = SimConfig(**{**SMALL, "time_scale": 1.0})  # type: ignore[arg-type]
    lines: list[str] = []

    async def stream(client: httpx.AsyncClient, url: str) -> None:
        body = {**LONG, "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)

    async with httpx.AsyncClient() as client, trio.open_nursery() as nursery:
        async with open_simulator(config) as sim:
            nursery.start_soon(stream, client, sim.url)
            with trio.fail_after(5):
                while not lines:
                    await trio.sleep(0.01)
            start = trio.current_time()
        assert trio.current_time() - start < 2.0
    # The in-flight stream was failed like a dead engine, then closed properly.
    assert lines[-1] == "data: [DONE]"
    assert '"InternalServerError"' in lines[-2]
