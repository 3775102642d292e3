"""SIGKILL: the proxy loses at most the audit rows of its last unwritten batch, and a restart
restores the program registry from what was written and carries on."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import httpx
import trio

from tests.conftest import query, running_proxy, spawn_serving, wait_for
from thunderproxy.audit.writer import MAX_BATCH
from thunderproxy.sim import SimConfig, open_simulator

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
AGENTS = 20


async def start_proxy(backend: str, db: Path) -> tuple[trio.Process, str]:
    argv = [sys.executable, "-m", "thunderproxy", "serve", "--port", "0"]
    return await spawn_serving([*argv, "--backends", backend, "--db", str(db)])


def count_steps(db: Path) -> int:
    if not db.exists():
        return 0
    return int(query(db, "select count(*) as n from steps")[0]["n"])


async def agents(client: httpx.AsyncClient, steps: int) -> None:
    async def one(i: int) -> None:
        for _ in range(steps):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}]}
            r = await client.post(
                "/v1/chat/completions", json=body, headers={"X-Program-Id": f"agent-{i}"}
            )
            assert r.status_code == 200

    async with trio.open_nursery() as nursery:
        for i in range(AGENTS):
            nursery.start_soon(one, i)


async def test_sigkill_loses_at_most_the_last_batch_and_restart_restores(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    async with open_simulator(SimConfig(output_len_dist="fixed:4")) as sim:
        process, url = await start_proxy(sim.url, db)
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                await agents(client, steps=5)
                # The writer flushes in batches: these rows are in the file before the kill.
                await wait_for(lambda: count_steps(db) == AGENTS * 5, timeout=10)
                await agents(client, steps=5)
            process.kill()  # SIGKILL right after the last response: no chance to flush
            await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
        assert process.returncode == -signal.SIGKILL

        written = query(db, "select count(*) as n from steps")[0]["n"]
        first_phase = query(db, "select count(*) as n from steps where step <= 5")[0]["n"]
        lost = 2 * 5 * AGENTS - written
        print(f"SIGKILL right after the last response: {lost} of {written + lost} step rows lost")
        assert first_phase == 5 * AGENTS  # everything older than the last batch survived
        assert 0 <= lost <= min(5 * AGENTS, MAX_BATCH)

        async with (
            running_proxy(db, backends=sim.url) as proxy,
            httpx.AsyncClient(base_url=proxy.url) as client,
        ):
            programs = (await client.get("/programs")).json()
            assert set(programs) == {f"agent-{i}" for i in range(AGENTS)}
            body = {"model": MODEL, "messages": [{"role": "user", "content": "again"}]}
            r = await client.post(
                "/v1/chat/completions", json=body, headers={"X-Program-Id": "agent-0"}
            )
            assert r.status_code == 200
            assert (await client.get("/programs")).json()["agent-0"]["step_count"] >= 6
