"""A restarted proxy restores the programs it knew from its audit db (scheduler defect 10)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.conftest import query, running_proxy
from thunderproxy.sim import SimConfig, open_simulator

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}


async def test_restart_restores_the_registry(tmp_path: Path) -> None:
    config = SimConfig(enable_request_id_headers=True, output_len_dist="fixed:4")
    async with open_simulator(config) as sim:
        await restart_and_check(sim.url, tmp_path / "audit.db")


async def restart_and_check(backend: str, db: Path) -> None:
    async with (
        running_proxy(db, backends=backend, router="tr") as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        for program, steps in (("a", 2), ("b", 1), ("gone", 1)):
            for _ in range(steps):
                body = {**CHAT, "program_id": program}
                assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        await client.post("/programs/release", json={"program_id": "gone"})
        before = (await client.get("/programs")).json()

    async with (
        running_proxy(db, backends=backend, router="tr") as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        after = (await client.get("/programs")).json()
        assert set(after) == {"a", "b"}
        for name in ("a", "b"):
            for key in ("backend", "step_count", "total_tokens", "status", "state"):
                assert after[name][key] == before[name][key], (name, key)
        r = await client.post("/v1/chat/completions", json={**CHAT, "program_id": "a"})
        assert r.headers["x-request-id"] == "a-3"

    restored = query(
        db,
        "select program_id, from_status, to_status from transitions"
        " where reason = 'restored after restart' order by program_id",
    )
    assert restored == [
        {"program_id": "a", "from_status": "acting", "to_status": "acting"},
        {"program_id": "b", "from_status": "acting", "to_status": "acting"},
    ]
