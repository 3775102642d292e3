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

    python -m thunderproxy.bench.scale --programs 10000,50000 --rounds 5 --calls 60
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import click
import httpx
import trio

from ..config import load_settings
from ..programs import StepUsage
from ..runtime import RunningProxy, run
from ..sim import SimConfig, serve_simulator
from . import figures

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
    """``n`` programs that made one call and have been idle for IDLE_FOR_S."""
    scheduler = proxy.services.scheduler
    registry = scheduler.registry
    backend = proxy.services.pool.urls[0]
    now = trio.current_time()
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
            "returning_p50_ratio": round(
                statistics.median(t.returning_ms) / statistics.median(base.returning_ms), 3
            ),
            "new_p50_ratio": round(statistics.median(t.new_ms) / statistics.median(base.new_ms), 3),
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
