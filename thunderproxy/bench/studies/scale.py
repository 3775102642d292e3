"""Per-call cost against the number of tracked programs: a fresh proxy beside proxies that track
10,000 and 50,000 idle programs, measured side by side in one run.

Each proxy is the real one (``runtime.run``, router ``tr`` unless told otherwise) in front of
its own simulator answering at once (time scale 0.001), all in this process. The idle programs
are put in each proxy's registry through the registry's own lifecycle calls (first call, its
end two minutes ago), exactly as programs that stopped calling look to the proxy; their audit
rows are flushed before anything is measured. Then, in interleaved rounds so the machine's noise
falls on every proxy alike, calls go out one at a time: calls of eight live programs (a
returning program's path) and calls of new programs (the admission path). Reported per proxy:
latency p50/p99 of each kind and its ratio to the fresh proxy, and the memory each idle program
costs (resident set growth while adding them, divided by their number).

    python -m thunderproxy.bench.studies.scale --programs 10000,50000 --rounds 5 --calls 60
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import click
import httpx
import trio

from ...audit import AuditLog
from ...audit.records import AuditRecord
from ...backends import BackendPool, EngineSnapshot
from ...backends.mock import MockBackend
from ...config import Settings, load_settings
from ...core import build_core
from ...programs import ProgramRegistry, StepUsage
from ...runtime import RunningProxy, run
from ...sim import SimConfig, serve_simulator
from ..relay.callcost import drain
from ..report import figures

#: How long ago the idle programs' last call ended (their KV claim has long decayed).
IDLE_FOR_S = 120.0
LIVE_PROGRAMS = 8
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def resident_bytes() -> int:
    """This process's resident set now (Linux /proc; 0 where it cannot be read)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Target:
    programs: int
    url: str = ""
    returning_ms: list[float] = field(default_factory=list)
    new_ms: list[float] = field(default_factory=list)
    bytes_per_program: float | None = None


def populate(proxy: RunningProxy, n: int) -> None:
    populate_registry(
        proxy.services.scheduler.registry, proxy.services.pool.urls[0], n, trio.current_time()
    )


def populate_registry(registry: ProgramRegistry, backend: str, n: int, now: float) -> None:
    """``n`` programs that made one call and have been idle for IDLE_FOR_S."""
    start = now - IDLE_FOR_S - 1.0
    usage = StepUsage(prompt_tokens=120, completion_tokens=8, cached_tokens=0)
    for i in range(n):
        program, _ = registry.get_or_create(f"idle-{i}", start)
        registry.assign(program, backend)
        registry.begin_step(program, start, context_chars=480)
        registry.end_step(program, start + 1.0, usage, reason="response complete")


async def one_call(client: httpx.AsyncClient, program_id: str) -> float:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{program_id}: list the files"}],
        "max_tokens": 1,
        "program_id": program_id,
    }
    began = trio.current_time()
    response = await client.post("/v1/chat/completions", json=body)
    elapsed = (trio.current_time() - began) * 1000
    if response.status_code != 200:
        raise click.ClickException(f"call failed: {response.status_code} {response.text[:200]}")
    return elapsed


async def measure(counts: list[int], rounds: int, calls: int, router: str) -> list[Target]:
    targets = [Target(n) for n in counts]
    with tempfile.TemporaryDirectory(prefix="thunderproxy-scale-") as tmp:
        async with trio.open_nursery() as nursery:
            proxies: list[RunningProxy] = []
            for target in targets:
                # A backend that answers at once, so the proxy's own cost is what is measured.
                sim = await nursery.start(
                    partial(serve_simulator, SimConfig(time_scale=0.001), port=0)
                )
                settings = load_settings(
                    {
                        "host": "127.0.0.1",
                        "port": 0,
                        "backends": sim,
                        "db": str(Path(tmp) / f"scale-{target.programs}.db"),
                        "router": router,
                        "datasette": False,
                        "restore": False,
                        "audit_queue": 2 * max(counts) + 10_000,
                    }
                )
                proxy: RunningProxy = await nursery.start(partial(run, settings))
                proxies.append(proxy)
                target.url = proxy.url
                gc.collect()
                before = resident_bytes()
                populate(proxy, target.programs)
                gc.collect()
                if target.programs:
                    grown = resident_bytes() - before
                    target.bytes_per_program = grown / target.programs if grown > 0 else None
                with trio.fail_after(600):
                    # The writer offers no flush event; its queue length is what it reports.
                    while proxy.audit.statistics().queued:  # noqa: ASYNC110
                        await trio.sleep(0.05)
            clients = [httpx.AsyncClient(base_url=p.url, timeout=60) for p in proxies]
            try:
                for round_ in range(rounds):
                    for target, client in zip(targets, clients, strict=True):
                        for i in range(calls):
                            live = f"live-{i % LIVE_PROGRAMS}"
                            elapsed = await one_call(client, live)
                            if round_ or i >= LIVE_PROGRAMS:  # first calls are admissions
                                target.returning_ms.append(elapsed)
                            elapsed = await one_call(client, f"new-{round_}-{i}")
                            target.new_ms.append(elapsed)
                        click.echo(
                            f"round {round_ + 1}/{rounds}: {target.programs:,} idle programs done",
                            err=True,
                        )
            finally:
                for client in clients:
                    await client.aclose()
                for proxy in proxies:
                    proxy.shutdown.set()
                nursery.cancel_scope.cancel()  # the simulators
    return targets


async def scheduler_cost(n: int, calls: int, router: str) -> float:
    """Microseconds of one lease and close by the real scheduler (no HTTP, no backend) with
    ``n`` idle programs tracked: the part of a call's cost that could grow with them."""
    send, receive = trio.open_memory_channel[AuditRecord](math.inf)
    audit = AuditLog(send, run_id=0)
    pool = BackendPool()
    node = pool.attach("http://capacity.invalid", MockBackend())  # sends nothing
    node.snapshot = EngineSnapshot("vllm", 1, 432_000, 16, 27_000, 0.0, 0, 0, 0, 0, 0)
    core = build_core(Settings(router=router), pool, audit)
    registry, scheduler = core.registry, core.scheduler
    populate_registry(registry, node.url, n, trio.current_time())
    drain(receive)
    gc.collect()
    route = pool.route(None)
    usage = StepUsage(prompt_tokens=100, completion_tokens=1, cached_tokens=0)
    # The best of several runs: on a shared machine the others only add what other work cost.
    best = math.inf
    for _ in range(5):
        began = time.perf_counter()
        for i in range(calls):
            lease = await scheduler.lease(
                f"live-{i % LIVE_PROGRAMS}",
                route,
                arrived_at=trio.current_time(),
                context_chars=400,
            )
            scheduler.close(lease, usage, reason="response complete")
            drain(receive)  # the records leave, as they do to the writer
        best = min(best, (time.perf_counter() - began) / calls * 1e6)
    return best


def ratio(values: list[float], base: list[float]) -> float | None:
    if not values or not base:
        return None
    return round(statistics.median(values) / statistics.median(base), 3)


def report(targets: list[Target]) -> dict[str, Any]:
    base = targets[0]

    def p(values: list[float], q: float) -> float:
        value = figures.percentile(values, q)
        return float("nan") if value is None else value

    rows = []
    for t in targets:
        row = {
            "idle_programs": t.programs,
            "returning_p50_ms": round(p(t.returning_ms, 50), 2),
            "returning_p99_ms": round(p(t.returning_ms, 99), 2),
            "new_p50_ms": round(p(t.new_ms, 50), 2),
            "new_p99_ms": round(p(t.new_ms, 99), 2),
            "returning_p50_ratio": ratio(t.returning_ms, base.returning_ms),
            "new_p50_ratio": ratio(t.new_ms, base.new_ms),
            "bytes_per_program": None
            if t.bytes_per_program is None
            else round(t.bytes_per_program),
        }
        rows.append(row)
    return {"rows": rows}


@click.command()
@click.option(
    "--programs",
    default="10000,50000",
    show_default=True,
    help="Comma list of idle-program counts to compare with a fresh proxy.",
)
@click.option("--rounds", default=5, show_default=True, help="Interleaved rounds.")
@click.option(
    "--calls", default=60, show_default=True, help="Calls of each kind per proxy per round."
)
@click.option("--router", default="tr", show_default=True, type=click.Choice(["tr", "default"]))
@click.option("--json", "json_path", default=None, help="Write the figures as JSON here.")
def main(programs: str, rounds: int, calls: int, router: str, json_path: str | None) -> None:
    counts = [0, *(int(n) for n in programs.split(",") if n.strip())]
    click.echo("scheduler alone (lease + close, in-process):")
    for n in counts:
        cost = trio.run(scheduler_cost, n, 1_000, router)
        click.echo(f"  {n:>7,} idle programs: {cost:8.1f} µs per call (best of 5)")
    targets = trio.run(measure, counts, rounds, calls, router)
    result = report(targets)
    columns = list(result["rows"][0])
    click.echo("  ".join(f"{c:>20}" for c in columns))
    for row in result["rows"]:
        click.echo("  ".join(f"{'' if row[c] is None else row[c]:>20}" for c in columns))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
