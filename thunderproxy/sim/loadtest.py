"""Multi-turn agent load against a simulator (or any vLLM): the figures of docs/BENCHMARKS.md.

Each program is an agent: a shared system prompt plus its own task, then turns that append
the model's reply and a tool observation to the history and wait out a tool gap. Every
request carries `X-Request-Id: <program>-<turn>`, as the proxy sends it.

    python -m thunderproxy.sim.loadtest --programs 4,8,16,32,64 -- --time-scale 0.1
    python -m thunderproxy.sim.loadtest --url http://127.0.0.1:8000 --programs 16

Arguments after `--` go to the `thunderproxy sim` started for each row (one fresh
simulator per row, in its own process, so the load generator does not share its core).
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import click
import httpx
import trio

SYSTEM_WORDS = 700  # ~1.2K tokens of shared system prompt and tool schemas


@dataclass
class Workload:
    programs: int
    turns: int
    task_words: int
    observation_words: int
    reply_tokens: int
    gap_seconds: float  # simulated tool time between turns
    stream: bool
    time_scale: float
    seed: int
    duration: float | None = None  # wall seconds after which no program starts a new turn


@dataclass
class Totals:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0
    errors: int = 0
    max_prompt: int = 0
    ttft: list[float] = field(default_factory=list)  # simulated seconds, client side


def words(rng: random.Random, n: int) -> str:
    syllables = ("ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "zu", "an", "el")
    return " ".join("".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(n))


async def run_program(
    client: httpx.AsyncClient, load: Workload, index: int, model: str, totals: Totals
) -> None:
    """One agent; with a duration it starts a fresh episode whenever one ends."""
    rng = random.Random(f"{load.seed}:{index}")
    # Programs do not start in lockstep: spread the first turns over one gap.
    await trio.sleep(rng.random() * load.gap_seconds * load.time_scale)
    stop_at = trio.current_time() + load.duration if load.duration else float("inf")
    episode = 0
    while True:
        await run_episode(client, load, f"agent{index}.{episode}", rng, model, totals, stop_at)
        episode += 1
        if not load.duration or trio.current_time() >= stop_at:
            return


async def run_episode(
    client: httpx.AsyncClient,
    load: Workload,
    program: str,
    rng: random.Random,
    model: str,
    totals: Totals,
    stop_at: float,
) -> None:
    system = words(random.Random(load.seed), SYSTEM_WORDS)
    messages: list[dict[str, str]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Task {program}: " + words(rng, load.task_words)},
    ]
    for turn in range(1, load.turns + 1):
        if trio.current_time() >= stop_at:
            return
        n_out = max(1, int(rng.lognormvariate(0, 0.5) * load.reply_tokens))
        body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 4 * n_out + 16}
        headers = {"X-Request-Id": f"{program}-{turn}", "X-Sim-Output-Tokens": str(n_out)}
        start = trio.current_time()
        reply, usage, first = await _call(client, body, headers, load.stream)
        if usage is None:
            totals.errors += 1
            return
        totals.requests += 1
        totals.prompt_tokens += usage["prompt_tokens"]
        totals.max_prompt = max(totals.max_prompt, usage["prompt_tokens"])
        totals.completion_tokens += usage["completion_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        totals.cached_tokens += details.get("cached_tokens", 0)
        totals.ttft.append(((first or trio.current_time()) - start) / load.time_scale)
        messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": words(rng, load.observation_words)})
        await trio.sleep(load.gap_seconds * rng.uniform(0.5, 1.5) * load.time_scale)


async def _call(
    client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str], stream: bool
) -> tuple[str, dict[str, Any] | None, float | None]:
    if not stream:
        r = await client.post("/v1/chat/completions", json=body, headers=headers)
        if r.status_code != 200:
            return "", None, None
        data = r.json()
        return data["choices"][0]["message"]["content"], data["usage"], None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    parts: list[str] = []
    usage = None
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            return "", None, None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage") and not chunk["choices"]:
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    first = first or trio.current_time()
                    parts.append(content)
    return "".join(parts), usage, first


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


async def run_row(url: str, load: Workload) -> dict[str, Any]:
    limits = httpx.Limits(
        max_connections=load.programs + 8, max_keepalive_connections=load.programs
    )
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        before_m = (await client.get("/metrics")).text
        before = (await client.get("/_sim/state")).json()
        totals = Totals()
        wall0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for index in range(load.programs):
                nursery.start_soon(run_program, client, load, index, model, totals)
        wall = trio.current_time() - wall0
        after_m = (await client.get("/metrics")).text
        after = (await client.get("/_sim/state")).json()
    clock0, clock1 = before["clock"], after["clock"]
    capacity = after["blocks"]["total"] * after["blocks"]["block_size"]
    nominal = clock1["busy_nominal_wall_seconds"] - clock0["busy_nominal_wall_seconds"]
    actual = clock1["busy_wall_seconds"] - clock0["busy_wall_seconds"]
    ttft = sorted(totals.ttft) or [0.0]
    served = {
        key: metric(after_m, f"vllm:time_to_first_token_seconds_{key}")
        - metric(before_m, f"vllm:time_to_first_token_seconds_{key}")
        for key in ("sum", "count")
    }
    return {
        "programs": load.programs,
        "requests": totals.requests,
        "errors": totals.errors,
        "kv_demand": load.programs * totals.max_prompt / capacity if capacity else 0.0,
        "hit_rate": totals.cached_tokens / totals.prompt_tokens if totals.prompt_tokens else 0.0,
        "evictions": after["counters"]["evictions"] - before["counters"]["evictions"],
        "preemptions": metric(after_m, "vllm:num_preemptions_total")
        - metric(before_m, "vllm:num_preemptions_total"),
        "recomputed": after["counters"]["recomputed_prefill_tokens"]
        - before["counters"]["recomputed_prefill_tokens"],
        "ttft_mean": served["sum"] / served["count"] if served["count"] else 0.0,
        "client_ttft_p50": statistics.median(ttft),
        "client_ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
        "sim_seconds": wall / load.time_scale,
        "gen_tok_per_sim_s": totals.completion_tokens / (wall / load.time_scale),
        "wall_seconds": wall,
        "behind_pct": 100 * (actual - nominal) / nominal if nominal else 0.0,
        "max_lag_ms": 1000 * clock1["max_lag_seconds"],
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def spawned_row(sim_args: list[str], load: Workload) -> dict[str, Any]:
    port = free_port()
    args = [
        sys.executable, "-m", "thunderproxy.sim", "--port", str(port),
        "--enable-prompt-tokens-details", "--time-scale", str(load.time_scale), *sim_args,
    ]  # fmt: skip
    # Started before any await and stopped after the last, so blocking calls are harmless.
    process = subprocess.Popen(args, stderr=subprocess.DEVNULL)  # noqa: ASYNC220
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as probe:
            with trio.fail_after(30):
                while True:
                    try:
                        if (await probe.get(url + "/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        await trio.sleep(0.1)
        return await run_row(url, load)
    finally:
        process.terminate()
        process.wait(timeout=10)


COLUMNS = [
    ("programs", "programs", "{}"),
    ("requests", "requests", "{}"),
    ("kv_demand", "peak KV demand / capacity", "{:.2f}"),
    ("hit_rate", "prefix-hit rate", "{:.1%}"),
    ("evictions", "evicted blocks", "{}"),
    ("preemptions", "preemptions", "{:.0f}"),
    ("recomputed", "recomputed prefill tok", "{}"),
    ("ttft_mean", "TTFT mean (s)", "{:.3f}"),
    ("client_ttft_p90", "client TTFT p90 (s)", "{:.3f}"),
    ("gen_tok_per_sim_s", "gen tok/s", "{:.0f}"),
    ("wall_seconds", "wall (s)", "{:.1f}"),
    ("behind_pct", "clock behind", "{:.2f}%"),
    ("max_lag_ms", "max lag (ms)", "{:.1f}"),
]


@click.command(context_settings={"ignore_unknown_options": True})
@click.option(
    "--programs",
    default="4,8,16,32,64",
    show_default=True,
    help="Comma list: one table row per number of concurrent programs.",
)
@click.option("--turns", default=8, show_default=True, help="LLM calls per program.")
@click.option("--task-words", default=300, show_default=True)
@click.option(
    "--observation-words",
    default=250,
    show_default=True,
    help="Words of tool output appended after each turn.",
)
@click.option("--reply-tokens", default=120, show_default=True, help="Median reply length.")
@click.option(
    "--gap",
    "gap_seconds",
    default=2.0,
    show_default=True,
    help="Median simulated tool time between turns (s).",
)
@click.option("--stream/--no-stream", default=True, show_default=True)
@click.option("--time-scale", default=0.1, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--duration",
    type=float,
    default=None,
    help="Wall seconds after which programs start no new turn.",
)
@click.option("--url", default=None, help="Use a running server instead of spawning one per row.")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
@click.argument("sim_args", nargs=-1, type=click.UNPROCESSED)
def main(programs: str, turns: int, task_words: int, observation_words: int, reply_tokens: int,
         gap_seconds: float, stream: bool, time_scale: float, seed: int, duration: float | None,
         url: str | None,
         json_out: str | None, sim_args: tuple[str, ...]) -> None:  # fmt: skip
    """Replay multi-turn agents and print one markdown table row per program count."""
    rows = []
    print("| " + " | ".join(title for _, title, _ in COLUMNS) + " |")
    print("|" + "---:|" * len(COLUMNS))
    for count in (int(p) for p in programs.split(",")):
        load = Workload(count, turns, task_words, observation_words, reply_tokens, gap_seconds,
                        stream, time_scale, seed, duration)  # fmt: skip
        row = trio.run(run_row, url, load) if url else trio.run(spawned_row, list(sim_args), load)
        rows.append(row)
        cells = [fmt.format(row[key]) for key, _, fmt in COLUMNS]
        print("| " + " | ".join(cells) + " |", flush=True)
    if json_out:
        with open(json_out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
