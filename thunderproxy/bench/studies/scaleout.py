"""Scale-out: several proxy processes in front of the same backends, sharing tr's state through
Redis, against one process and against processes that share nothing.

    python -m thunderproxy.bench.studies.scaleout [--streams 256] [--steps 3] [--backends 2]
        [--kv-tokens 32768] [--arrangements one,shared,apart] [--json FILE]

Per arrangement, a fresh set of simulated vLLM backends (``thunderproxy sim`` processes) and of
proxies (``tr`` router):

- ``one``: one ``thunderproxy serve`` process takes every stream;
- ``shared``: ``thunderproxy serve --workers 2 --redis``: two processes on one port (the kernel
  spreads the connections), each subtracting the other's KV claims from every backend;
- ``apart``: two ``thunderproxy serve`` processes without Redis, half the programs each: each
  schedules as if it were alone in front of the backends.

``--streams`` coding agents run at once; each sends ``--steps`` streamed chat calls (the whole
conversation so far, a fixed-length answer), with a tool pause between them, then releases its
program. Each agent has an HTTP client of its own (one kept-alive connection, so with
``--workers`` one serve process), as an agent process would; with ``--pooled`` the agents of a proxy
share one client, whose connections carry any agent's next call (a program's calls then reach
either process, and the affinity record sends them to the same backend).

Reported per arrangement: calls, failed calls (any status but 200, or a stream that ended
without ``[DONE]``), wall seconds, and what the backends themselves said in their
``/metrics``, sampled every 0.1 s: the peak of ``vllm:kv_cache_usage_perc`` (1.0: full), the
peak of ``vllm:num_requests_waiting``, and ``vllm:num_preemptions_total`` at the end (a request
preempted because the running batch outgrew the KV), summed over backends. For ``shared``, also
how many calls each serve process served (from its audit db: ``calls_per_worker``).

Needs ``redis-server`` on the PATH (``apt-get install redis-server``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sqlite3
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from ...scaleout import process_db
from ...sim import SimConfig
from ..agents.agent import BenchError
from ..runs.realtime import (
    PROXY_LISTENING,
    SIM_LISTENING,
    Child,
    sim_argv,
    start_child,
    stop_child,
    thunderproxy_argv,
)
from .redisserver import RedisServer, free_port

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SYSTEM = " ".join(f"rule {i}: keep the repository tidy and answer briefly." for i in range(40))
ARRANGEMENTS = ("one", "shared", "apart")


@dataclass(frozen=True)
class ScaleoutConfig:
    streams: int = 256
    steps: int = 3
    backends: int = 2
    #: KV capacity of each simulated backend, in tokens: about a quarter of what the programs
    #: of every stream would claim at once.
    kv_tokens: int = 32_768
    output_tokens: int = 48
    #: Characters of each program's task and of each tool observation (about 4 per token).
    task_chars: int = 1_600
    observation_chars: int = 600
    tool_s: float = 0.5
    time_scale: float = 0.02
    workers: int = 2
    arrangements: tuple[str, ...] = ARRANGEMENTS
    #: One client per proxy for all its agents, instead of one per agent.
    pooled: bool = False
    #: Bound on one arrangement's run.
    limit_s: float = 900.0
    #: More ``serve`` flags for every proxy (the same in every arrangement).
    serve_flags: tuple[str, ...] = ()


@dataclass
class Outcome:
    arrangement: str
    processes: int
    streams: int
    calls: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    kv_usage_peak: float = 0.0
    waiting_peak: int = 0
    preemptions: int = 0
    prefix_hit_rate: float | None = None
    calls_per_worker: list[int] = field(default_factory=list)


def metric(text: str, name: str) -> float | None:
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return None if found is None else float(found.group(1))


def start_redis(directory: Path) -> RedisServer:
    binary = shutil.which("redis-server")
    if binary is None:
        raise BenchError(
            "redis-server is not on the PATH; install it (apt-get install redis-server)"
        )
    server = RedisServer(binary, free_port(), directory)
    try:
        server.start()
    except RuntimeError as exc:
        raise BenchError(str(exc)) from None
    return server


async def stream_call(
    client: httpx.AsyncClient, body: dict[str, Any], output_tokens: int
) -> tuple[str | None, str]:
    """One streamed chat call: (the failure, or None; the answer's text)."""
    reply: list[str] = []
    done = False
    headers = {"X-Sim-Output-Tokens": str(output_tokens)}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return f"status {r.status_code}", ""
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return "error event", ""
                    for choice in event.get("choices", ()):
                        reply.append(choice["delta"].get("content") or "")
    except httpx.HTTPError as exc:
        return type(exc).__name__, ""
    return (None if done else "no [DONE]"), "".join(reply)


async def coding_agent(
    client: httpx.AsyncClient, program_id: str, config: ScaleoutConfig, outcome: Outcome
) -> None:
    messages: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"task {program_id}: " + "fix the failing test " * 80},
    ]
    messages[1]["content"] = messages[1]["content"][: config.task_chars]
    observation = ("ok line " * (config.observation_chars // 8 + 1))[: config.observation_chars]
    for step in range(config.steps):
        body = {
            "model": MODEL,
            "messages": messages,
            "program_id": program_id,
            "max_tokens": config.output_tokens,
            "stream": True,
        }
        failure, answer = await stream_call(client, body, config.output_tokens)
        outcome.calls += 1
        if failure is not None:
            outcome.failed += 1
            outcome.failures[failure] = outcome.failures.get(failure, 0) + 1
        messages.append({"role": "assistant", "content": answer or "(no answer)"})
        messages.append({"role": "user", "content": f"observation {step}: {observation}"})
        await trio.sleep(config.tool_s)
    try:
        await client.post("/programs/release", json={"program_id": program_id})
    except httpx.HTTPError:
        pass  # the release only frees the program's claim sooner; the idle lease does it too


async def sample(backends: list[str], outcome: Outcome, stop: trio.Event) -> None:
    """The backends' own KV use, waiting queue and preemptions, every 0.1 s until ``stop``."""
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            preemptions = 0
            hits = queries = 0.0
            for url in backends:
                try:
                    text = (await client.get(url + "/metrics")).text
                except httpx.HTTPError:
                    continue
                outcome.kv_usage_peak = max(
                    outcome.kv_usage_peak, metric(text, "vllm:kv_cache_usage_perc") or 0.0
                )
                waiting = int(metric(text, "vllm:num_requests_waiting") or 0)
                outcome.waiting_peak = max(outcome.waiting_peak, waiting)
                preemptions += int(metric(text, "vllm:num_preemptions_total") or 0)
                hits += metric(text, "vllm:prefix_cache_hits_total") or 0.0
                queries += metric(text, "vllm:prefix_cache_queries_total") or 0.0
            outcome.preemptions = max(outcome.preemptions, preemptions)
            if queries:
                outcome.prefix_hit_rate = round(hits / queries, 3)
            if stop.is_set():
                return
            with trio.move_on_after(0.1):
                await stop.wait()


def serve_args(backends: list[str], db: Path, flags: tuple[str, ...] = ()) -> list[str]:
    return [
        *thunderproxy_argv("serve"),
        *("--port", "0", "--backends", ",".join(backends), "--router", "tr"),
        *("--db", str(db), "--no-datasette", "--metrics-interval", "0.2"),
        *("--max-connections", "1024"),
        *flags,
    ]


def calls_in(db: Path) -> int:
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    except sqlite3.Error:
        return 0
    try:
        return int(conn.execute("select count(*) from steps").fetchone()[0])
    except sqlite3.Error:
        return 0
    finally:
        conn.close()


async def run_arrangement(config: ScaleoutConfig, arrangement: str, tmp: Path) -> Outcome:
    processes = 1 if arrangement == "one" else config.workers
    outcome = Outcome(arrangement, processes, config.streams)
    sim = SimConfig(
        kv_capacity_tokens=config.kv_tokens,
        enable_prompt_tokens_details=True,
        time_scale=config.time_scale,
    )
    directory = tmp / arrangement
    directory.mkdir()
    redis = start_redis(directory) if arrangement == "shared" else None
    children: list[Child] = []
    try:
        async with trio.open_nursery() as nursery:
            for b in range(config.backends):
                children.append(
                    await start_child(nursery, f"sim{b}", sim_argv(sim, port=0), SIM_LISTENING)
                )
            backends = [c.url for c in children]
            proxies: list[str] = []
            db = directory / "proxy.db"
            if arrangement == "shared":
                assert redis is not None
                argv = serve_args(backends, db, config.serve_flags)
                argv += ["--workers", str(processes), "--redis", redis.url]
                proxy = await start_child(nursery, "proxy", argv, PROXY_LISTENING)
                children.append(proxy)
                proxies.append(proxy.url)
            else:
                for k in range(processes):
                    argv = serve_args(backends, directory / f"proxy{k}.db", config.serve_flags)
                    proxy = await start_child(nursery, f"proxy{k}", argv, PROXY_LISTENING)
                    children.append(proxy)
                    proxies.append(proxy.url)
            # One client, so one kept-alive connection, per agent, as an agent process has:
            # with --workers the kernel sends each agent's connection to one serve process.
            pooled = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            per_proxy = [
                httpx.AsyncClient(base_url=url, timeout=600, limits=pooled) for url in proxies
            ]
            clients = [
                per_proxy[a % len(proxies)]
                if config.pooled
                else httpx.AsyncClient(base_url=proxies[a % len(proxies)], timeout=600)
                for a in range(config.streams)
            ]
            stop = trio.Event()
            nursery.start_soon(sample, backends, outcome, stop)
            started = trio.current_time()
            with trio.fail_after(config.limit_s):
                async with trio.open_nursery() as agents:
                    for a, client in enumerate(clients):
                        agents.start_soon(coding_agent, client, f"agent-{a}", config, outcome)
            outcome.wall_s = round(trio.current_time() - started, 1)
            stop.set()
            for client in {*clients, *per_proxy}:
                await client.aclose()
            await trio.sleep(0.3)  # the sampler's last round
            for child in reversed(children):
                await stop_child(child)
            nursery.cancel_scope.cancel()
    finally:
        if redis is not None:
            redis.kill()
    if arrangement == "shared":
        outcome.calls_per_worker = [
            calls_in(Path(process_db(str(db), k))) for k in range(1, processes + 1)
        ]
    return outcome


async def run_scaleout(config: ScaleoutConfig) -> list[Outcome]:
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="tp-scaleout-") as tmp:
        for arrangement in config.arrangements:
            outcome = await run_arrangement(config, arrangement, Path(tmp))
            print(json.dumps(asdict(outcome)), flush=True)
            outcomes.append(outcome)
    return outcomes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = ScaleoutConfig()
    parser.add_argument("--streams", type=int, default=default.streams)
    parser.add_argument("--steps", type=int, default=default.steps)
    parser.add_argument("--backends", type=int, default=default.backends)
    parser.add_argument("--kv-tokens", type=int, default=default.kv_tokens)
    parser.add_argument("--workers", type=int, default=default.workers)
    parser.add_argument("--time-scale", type=float, default=default.time_scale)
    parser.add_argument("--tool-s", type=float, default=default.tool_s)
    parser.add_argument("--arrangements", default=",".join(default.arrangements))
    parser.add_argument(
        "--pooled", action="store_true", help="one client per proxy for all its agents"
    )
    parser.add_argument("--json", type=Path, help="also write the outcomes to this file")
    args = parser.parse_args(argv)
    arrangements = tuple(a for a in args.arrangements.split(",") if a)
    unknown = set(arrangements) - set(ARRANGEMENTS)
    if unknown:
        parser.error(f"unknown arrangements {sorted(unknown)}; known: {', '.join(ARRANGEMENTS)}")
    config = ScaleoutConfig(
        streams=args.streams,
        steps=args.steps,
        backends=args.backends,
        kv_tokens=args.kv_tokens,
        workers=args.workers,
        time_scale=args.time_scale,
        tool_s=args.tool_s,
        arrangements=arrangements,
        pooled=args.pooled,
    )
    try:
        outcomes = trio.run(run_scaleout, config)
    except BenchError as exc:
        print(f"Error: {exc.message}", file=sys.stderr)
        raise SystemExit(1) from None
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=1) + "\n")


if __name__ == "__main__":
    main()
