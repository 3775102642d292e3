"""What an operator reads when a backend dies under load and comes back: exactly two lines
from backend health, a WARNING with the cause when it is taken out and an INFO when it is
back, however many calls failed and polls went unanswered between. A real simulator on
loopback, stopped and started again on the same port, behind a real proxy."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import running_proxy, wait_for
from thunderproxy.sim import SimConfig, Simulator, open_simulator

MODEL = "m"
CONFIG = SimConfig(served_model_name=MODEL, time_scale=0.01)


async def simulator(
    port: int, stop: trio.Event, *, task_status: trio.TaskStatus[Simulator]
) -> None:
    """The simulator on ``port`` until ``stop`` is set."""
    async with open_simulator(CONFIG, port=port) as sim:
        task_status.started(sim)
        await stop.wait()


async def test_a_backend_killed_under_load_and_restarted_logs_two_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="thunderproxy.backends")
    statuses: list[int] = []
    stop_load = trio.Event()

    async def caller(client: httpx.AsyncClient, n: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        while not stop_load.is_set():
            answer = await client.post("/v1/chat/completions", json={**body, "program_id": f"p{n}"})
            statuses.append(answer.status_code)
            await trio.sleep(0.01)

    with trio.fail_after(60):
        async with trio.open_nursery() as sims:
            kill = trio.Event()
            first: Simulator = await sims.start(simulator, 0, kill)
            port = int(first.url.rsplit(":", 1)[1])
            async with (
                running_proxy(
                    tmp_path / "audit.db",
                    backends=first.url,
                    metrics_interval=0.2,
                    router="default",
                ) as proxy,
                httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
                trio.open_nursery() as load,
            ):
                node = next(iter(proxy.services.gateway.pool))
                for n in range(4):
                    load.start_soon(caller, client, n)
                await wait_for(lambda: statuses.count(200) >= 8, timeout=20)
                kill.set()  # the backend dies with calls in flight
                await wait_for(lambda: not node.healthy, timeout=10)
                failed = len(statuses)
                # Calls keep failing, polls keep going unanswered: nothing more is logged.
                await wait_for(lambda: len(statuses) >= failed + 20, timeout=10)
                await trio.sleep(0.5)
                await sims.start(simulator, port, trio.Event())
                await wait_for(lambda: node.healthy, timeout=10)
                back = statuses.count(200)
                await wait_for(lambda: statuses.count(200) >= back + 4, timeout=10)
                stop_load.set()
            sims.cancel_scope.cancel()
    lines = [
        (r.levelno, r.getMessage()) for r in caplog.records if r.name == "thunderproxy.backends"
    ]
    url = f"http://127.0.0.1:{port}"
    assert len(lines) == 2, lines
    (down_level, down), (up_level, up) = lines
    assert down_level == logging.WARNING
    # The cause, as the kill fell: /health answered 503 (the simulator stopping), or the
    # connection refused or dropped.
    head = f"backend {url} is unhealthy; no call is placed on it until it answers again: "
    assert down.startswith(head), down
    cause = down.removeprefix(head)
    assert cause.startswith(("/health answered 503", f"Backend {url} is unreachable or ")), cause
    assert up_level == logging.INFO
    assert up == f"backend {url} is healthy again; it had been taken out by: {cause}"
    assert any(s >= 500 for s in statuses)  # the outage was seen by the callers
