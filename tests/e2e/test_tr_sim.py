"""tr end to end against the simulated vLLM under KV pressure: programs are paused and
resumed, running programs keep their prefix cache, and no wait exceeds the bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio

from tests.conftest import query, running_proxy
from tests.e2e.agents import agent
from thunderproxy.sim import SimConfig, open_simulator

SYSTEM = " ".join(f"rule{i} keep the repository tidy and answer briefly." for i in range(60))
MAX_WAIT = 3.0
AGENTS, STEPS = 8, 4


async def coding_agent(client: httpx.AsyncClient, program_id: str) -> None:
    await agent(
        client,
        program_id,
        model="meta-llama/Llama-3.1-8B-Instruct",
        system=SYSTEM,
        task="fix the failing test " * 120,
        observation="ok line " * 150,
        steps=STEPS,
        tool_s=0.1,
    )


async def replay(db: Path, router: str) -> list[dict[str, Any]]:
    """Run the agents through a proxy with ``router`` against a fresh, small simulated KV."""
    sim_config = SimConfig(
        kv_capacity_tokens=6144,
        enable_prompt_tokens_details=True,
        time_scale=0.02,
    )
    async with (
        open_simulator(sim_config) as sim,
        running_proxy(
            db,
            backends=sim.url,
            router=router,
            metrics_interval=0.1,
            monitor_interval=0.05,
            pause_cooldown=0.05,
            resume_cooldown=0.05,
            decode_buffer=64,
            acting_half_life=1.0,
            # At this time scale the engine refills the 6K cache in milliseconds, so break-even
            # claims would let every idle program go; decayed claims keep them, as the
            # assertions on kept caches below need.
            idle_claims="decay",
            max_wait=MAX_WAIT,
            # Every call at MAX_WAIT, however long its program has run: the bound asserted below.
            max_wait_share=0.0,
            # The tail's times in the same proportions to these as their defaults.
            admission_half_life=6.0,
            mid_program_head_start=MAX_WAIT / 2,
        ) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(AGENTS):
                    nursery.start_soon(coding_agent, client, f"agent-{i}")
    return query(
        db, "select program_id, step, status, queue_s, prompt_tokens, cached_tokens from steps"
    )


def hit_rate(steps: list[dict[str, Any]]) -> float:
    return sum(s["cached_tokens"] for s in steps) / sum(s["prompt_tokens"] for s in steps)


async def test_tr_pauses_and_resumes_under_kv_pressure(tmp_path: Path) -> None:
    db = tmp_path / "tr.db"
    steps = await replay(db, "tr")
    assert len(steps) == AGENTS * STEPS
    assert {s["status"] for s in steps} == {200}
    assert max(s["queue_s"] for s in steps) <= MAX_WAIT + 1.0

    paused = query(db, "select count(*) as n from transitions where to_status = 'paused'")
    resumed = query(db, "select count(*) as n from transitions where reason like 'resumed:%'")
    assert paused[0]["n"] > 0
    released_paused = query(
        db,
        "select count(*) as n from transitions"
        " where from_status = 'paused' and to_status = 'stopped'",
    )
    # Every pause ends in a resume, or in a release of a program already done.
    assert resumed[0]["n"] + released_paused[0]["n"] == paused[0]["n"]
    actions = {r["action"] for r in query(db, "select distinct action from decisions")}
    assert {"admit", "resume"} <= actions
    assert actions & {"pause", "queue", "mark"}
    waits = query(db, "select max(waited_s) as w from decisions where waited_s is not null")
    assert waits[0]["w"] <= MAX_WAIT + 1.0

    # Programs that kept running (no pause before the step) keep their own prefix cached, and
    # tr's later steps hit the cache more than the same workload through the default router.
    later = [s for s in steps if s["step"] > 1]
    running = [s for s in later if s["queue_s"] < 0.01]
    assert running
    # A running step resends its whole history and adds some 600 tokens, so a kept prefix reads
    # 0.7 to 0.85 of its prompt from the cache. Which steps run unpaused depends on wall-clock
    # timing (often 2 to 6 of them), so the bound is wide: more than half, where a prefix
    # evicted under this pressure reads next to nothing.
    assert hit_rate(running) > 0.5
    baseline = await replay(tmp_path / "default.db", "default")
    assert hit_rate(later) > hit_rate([s for s in baseline if s["step"] > 1])
