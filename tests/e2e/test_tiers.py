"""A proxy in front of a simulated vLLM with a CPU KV tier, over loopback: the poller records
the tier in backend_samples, and once a copy has been measured tr's decisions say which tier
they assumed (real HTTP, a real SQLite file)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import trio

from tests.conftest import query, running_proxy
from thunderproxy.sim import SimConfig, open_simulator

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT = "please list the files in the repository " * 40


def chat(program_id: str) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{program_id}: {PROMPT}"}],
        "program_id": program_id,
        "max_tokens": 4,
    }


async def test_the_tier_reaches_the_samples_and_the_decision_log(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    config = SimConfig(kv_capacity_tokens=16_000, kv_offloading_tokens=64_000)
    async with (
        open_simulator(config) as sim,
        running_proxy(
            db, backends=sim.url, router="tr", metrics_interval=0.05, monitor_interval=0.05
        ) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=10) as client,
    ):
        tiered: list[dict[str, object]] = []
        with trio.fail_after(20):
            n = 0
            while not tiered:
                # Each new program's admission is logged; the first ones come before the
                # tier's link was measured (the gate is the GPU's then).
                n += 1
                answer = await client.post("/v1/chat/completions", json=chat(f"p{n}"))
                assert answer.status_code == 200
                await trio.sleep(0.05)
                tiered = [
                    row
                    for row in query(db, "select detail from decisions where action = 'admit'")
                    if row["detail"] is not None and "tier" in json.loads(row["detail"])
                ]
    detail = json.loads(str(tiered[0]["detail"]))
    # (Beside the hold ledger's figures, where tr admits without holding: few_returns.)
    assert (detail["tier"], detail["gpu_tokens"]) == ("gpu", 16_000)  # a small prompt fits
    samples = query(
        db,
        "select cpu_capacity_tokens, offload_load_bytes_total from backend_samples "
        "where cpu_capacity_tokens is not null",
    )
    assert samples
    assert {s["cpu_capacity_tokens"] for s in samples} == {64_000}
    assert all(s["offload_load_bytes_total"] is not None for s in samples)
