"""Two tr instances in front of one simulated vLLM under KV pressure share, through a real
redis-server, the KV tokens their programs claim: each leaves room for the other's programs, so
the engine preempts about as rarely as behind one instance taking the whole load, and far more
rarely than behind the same two instances without Redis (each then fills the KV as if it were
alone, and the running calls outgrow it).

The measure is the engine's own preemption counter (``vllm:num_preemptions_total`` in the
simulator's /metrics). The load is sized so that preemptions tell the arrangements apart:
answers long enough (192 tokens) that running calls grow by a dozen KV blocks each, on a KV
that holds the programs of one instance's worth of agents but not two. Every arrangement runs
with several seeds (the agents' task and tool-time lengths, and the engine's text), and the
comparison is made on the sums."""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.admission.conftest import RedisServer
from tests.admission.test_shared import drain, killed_at_exit
from tests.conftest import spawn_serving
from thunderproxy.sim import SimConfig, open_simulator

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SYSTEM = " ".join(f"rule{i} keep the repository tidy and answer briefly." for i in range(40))
HEARTBEAT = 0.1


@dataclass(frozen=True)
class Load:
    agents: int = 16
    steps: int = 3
    #: Tokens of every answer; tr keeps this much room per running call (--decode-buffer).
    output_tokens: int = 192
    kv_tokens: int = 8192
    #: The engine's token budget per step: prompts are prefilled in chunks this long, so a call
    #: admitted into a KV that is nearly full grows after its admission, as answers do.
    batched_tokens: int = 256
    time_scale: float = 0.02


def counter(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    assert found is not None, f"the simulator's /metrics has no {name}"
    return float(found.group(1))


async def serve(
    tmp_path: Path, name: str, backend: str, redis: str | None, load: Load
) -> tuple[Any, str]:
    argv = [sys.executable, "-m", "thunderproxy", "serve", "--port", "0", "--backends", backend]
    argv += ["--db", str(tmp_path / f"{name}.db"), "--no-datasette", "--router", "tr"]
    argv += ["--metrics-interval", "0.1", "--monitor-interval", "0.05"]
    argv += ["--pause-cooldown", "0.05", "--resume-cooldown", "0.05"]
    argv += ["--decode-buffer", str(load.output_tokens + 16)]
    # A long bound on waiting: a program resumed at the bound goes out whether it fits or not,
    # which would blur what the shared capacity does.
    argv += ["--acting-half-life", "1.0", "--max-wait", "30"]
    if redis is not None:
        argv += ["--redis", redis, "--redis-heartbeat", str(HEARTBEAT)]
    return await spawn_serving(argv)


async def engine(sim_url: str) -> dict[str, float]:
    """The engine's preemptions and prefix-cache hit rate over the whole run."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{sim_url}/metrics")).text
    hits = counter(text, "vllm:prefix_cache_hits_total")
    queries = counter(text, "vllm:prefix_cache_queries_total")
    return {
        "preemptions": counter(text, "vllm:num_preemptions_total"),
        "hit_rate": round(hits / queries, 3),
    }


async def coding_agent(
    client: httpx.AsyncClient, program_id: str, load: Load, rng: random.Random
) -> None:
    """``load.steps`` streamed calls of one program (the whole conversation each time), a
    tool pause between them, then its release."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"task {program_id}: " + "fix the test " * rng.randint(40, 90)},
    ]
    headers = {"X-Sim-Output-Tokens": str(load.output_tokens)}
    for step in range(load.steps):
        body = {
            "model": MODEL,
            "messages": messages,
            "program_id": program_id,
            "max_tokens": load.output_tokens,
            "stream": True,
        }
        reply = []
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        reply.append(choice["delta"].get("content") or "")
        messages.append({"role": "assistant", "content": "".join(reply)})
        observation = "ok line " * rng.randint(40, 80)
        messages.append({"role": "user", "content": f"observation {step}: {observation}"})
        await trio.sleep(rng.uniform(0.05, 0.2))  # the tool runs
    await client.post("/programs/release", json={"program_id": program_id})


async def drive(
    tmp_path: Path, instances: int, redis: str | None, load: Load, seed: int
) -> dict[str, float]:
    """Coding agents spread over ``instances`` serve processes in front of one small simulated
    KV; what the engine saw."""
    await trio.Path(tmp_path).mkdir(parents=True)
    sim_config = SimConfig(
        kv_capacity_tokens=load.kv_tokens,
        enable_prompt_tokens_details=True,
        time_scale=load.time_scale,
        max_num_batched_tokens=load.batched_tokens,
        seed=seed,
    )
    rng = random.Random(seed)
    async with (
        open_simulator(sim_config) as sim,
        killed_at_exit() as procs,
        trio.open_nursery() as logs,
    ):
        for i in range(instances):
            process, url = await serve(tmp_path, f"i{i}", sim.url, redis, load)
            procs.append((process, url))
            logs.start_soon(drain, process, tmp_path / f"i{i}.log")
        clients = [httpx.AsyncClient(base_url=url, timeout=60) for _, url in procs]
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for a in range(load.agents):
                    agent_rng = random.Random(rng.random())
                    client = clients[a % instances]
                    nursery.start_soon(coding_agent, client, f"agent-{a}", load, agent_rng)
        for c in clients:
            await c.aclose()
        seen = await engine(sim.url)
        for process, _ in procs:
            process.terminate()
    return seen


async def compare(tmp_path: Path, redis: str, load: Load, seeds: range) -> dict[str, list[float]]:
    """Preemptions per seed behind one instance, two apart, two sharing through Redis."""
    seen: dict[str, list[float]] = {"one": [], "apart": [], "shared": []}
    for seed in seeds:
        for name, instances, url in (("one", 1, None), ("apart", 2, None), ("shared", 2, redis)):
            outcome = await drive(tmp_path / f"{name}-{seed}", instances, url, load, seed)
            seen[name].append(outcome["preemptions"])
    print(json.dumps({"load": load.__dict__, "preemptions": seen}))
    return seen


# Behind the slow marker: nine runs of a fresh simulator and one or two serve processes take
# about 90 s on two busy cores.
@pytest.mark.slow
async def test_two_tr_instances_sharing_kv_preempt_as_rarely_as_one(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    seen = await compare(tmp_path, redis_server.url, Load(), range(3))
    one, apart, shared = (sum(seen[k]) for k in ("one", "apart", "shared"))
    assert apart >= 3 * max(one, 1), "the load does not overfill the KV behind two instances"
    assert shared <= 2 * one + 3, "two instances sharing KV preempt much more than one"
    assert shared * 2.5 <= apart, (
        "sharing KV through Redis does not keep the engine from preempting"
    )
