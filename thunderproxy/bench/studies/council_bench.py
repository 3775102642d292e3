"""Councils through ``tr`` against ``default``: wall time per council and prefix-cache hit rate.

For each router, one process holds a simulated vLLM serving three model names on one KV cache,
the proxy with a council of those three, and ``--councils`` conversations asking at once, each
``--turns`` questions one after the other (a later turn's members see their earlier answers, so
their prompts extend what they sent before). Reported per router: the councils' wall time
(median and slowest, real seconds at the chosen time scale), the prefix-cache hit rate of the
member programs' calls (cached ÷ prompt tokens, from the audit db) and the engine's preemptions.

    python -m thunderproxy.bench.studies.council_bench --councils 8 --turns 2 --kv-tokens 12000
"""

from __future__ import annotations

import json
import sqlite3
import statistics
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import click
import httpx
import trio

from ...config import load_settings
from ...runtime import RunningProxy, run
from ...sim import SimConfig
from ...sim.server import open_simulator

MODELS = ("council-alpha", "council-bravo", "council-charlie")
QUESTIONS = (
    "Why is the sky blue, and why are sunsets red?",
    "How would you explain that to a ten-year-old?",
    "What experiment at home would show it?",
)


@dataclass
class RouterResult:
    router: str
    council_s: list[float]
    hit_rate: float | None
    prompt_tokens: int
    preemptions: float | None
    failed: int


async def one_council(client: httpx.AsyncClient, turns: int) -> tuple[float, bool]:
    """Ask ``turns`` questions in one conversation; (wall seconds, every turn answered)."""
    conversation = (await client.post("/council/api/conversations")).json()["id"]
    began = trio.current_time()
    ok = True
    for turn in range(turns):
        url = f"/council/api/conversations/{conversation}/message"
        response = await client.post(url, json={"content": QUESTIONS[turn % len(QUESTIONS)]})
        ok = ok and response.status_code == 200
    return trio.current_time() - began, ok


def hit_rate(db: Path) -> tuple[float | None, int]:
    conn = sqlite3.connect(db)
    try:
        prompt, cached = conn.execute(
            "SELECT SUM(prompt_tokens), SUM(COALESCE(cached_tokens, 0)) FROM steps"
            " WHERE program_id LIKE 'council:%' AND status = 200"
        ).fetchone()
    finally:
        conn.close()
    if not prompt:
        return None, 0
    return cached / prompt, int(prompt)


async def measure(
    router: str, councils: int, turns: int, kv_tokens: int, time_scale: float
) -> RouterResult:
    sim_config = SimConfig(
        served_model_name=MODELS[0],
        extra_served_model_names=",".join(MODELS[1:]),
        time_scale=time_scale,
        output_len_dist="lognormal:160:0.3",
        enable_prompt_tokens_details=True,
        kv_capacity_tokens=kv_tokens,
    )
    with tempfile.TemporaryDirectory(prefix="thunderproxy-council-") as tmp:
        db = Path(tmp) / "audit.db"
        async with open_simulator(sim_config) as sim, trio.open_nursery() as nursery:
            settings = load_settings(
                {
                    "host": "127.0.0.1",
                    "port": 0,
                    "backends": sim.url,
                    "db": str(db),
                    "router": router,
                    "datasette": False,
                    "log_level": "warning",
                    "council_models": ",".join(MODELS),
                    "council_chairman": MODELS[0],
                    "metrics_interval": 0.5,
                    # Every conversation is asked from this one client: the per-client cap on
                    # council jobs would answer the ones past it 429, not measure them.
                    "council_max_jobs": max(councils, 16),
                    "council_max_jobs_per_client": councils,
                }
            )
            proxy: RunningProxy = await nursery.start(partial(run, settings))
            times: list[float] = []
            failed = 0
            timeout = httpx.Timeout(None, connect=10.0)
            async with httpx.AsyncClient(base_url=proxy.url, timeout=timeout) as client:

                async def council() -> None:
                    nonlocal failed
                    seconds, ok = await one_council(client, turns)
                    if ok:
                        times.append(seconds)  # a refused turn is no council's time
                    failed += not ok

                async with trio.open_nursery() as councils_nursery:
                    for _ in range(councils):
                        councils_nursery.start_soon(council)
                metrics = (await client.get("/metrics")).json()
            proxy.shutdown.set()
        preemptions = next(iter(metrics["backends"].values()))["metrics"]["num_preemptions"]
        rate, prompt = hit_rate(db)
    return RouterResult(router, times, rate, prompt, preemptions, failed)


@click.command()
@click.option("--councils", default=6, show_default=True, help="Conversations asking at once.")
@click.option("--turns", default=2, show_default=True, help="Questions per conversation.")
@click.option("--kv-tokens", default=48_000, show_default=True, help="The simulated KV cache.")
@click.option("--time-scale", default=1.0, show_default=True,
              help="Wall seconds per simulated second. tr's cooldowns and waits are real "
                   "seconds, so below 1 the comparison favours default.")  # fmt: skip
@click.option("--json", "json_path", default=None, help="Write the figures as JSON here.")
def main(
    councils: int, turns: int, kv_tokens: int, time_scale: float, json_path: str | None
) -> None:
    rows: list[dict[str, Any]] = []
    for router in ("default", "tr"):
        result = trio.run(measure, router, councils, turns, kv_tokens, time_scale)
        if not result.council_s:
            raise click.ClickException(
                f"no council was answered under {router}: see the proxy's log above"
            )
        rows.append(
            {
                "router": router,
                "council_wall_p50_s": round(statistics.median(result.council_s), 2),
                "council_wall_max_s": round(max(result.council_s), 2),
                "prefix_hit_rate": None if result.hit_rate is None else round(result.hit_rate, 3),
                "member_prompt_tokens": result.prompt_tokens,
                "preemptions": result.preemptions,
                "failed_councils": result.failed,
            }
        )
    columns = list(rows[0])
    click.echo("  ".join(f"{c:>20}" for c in columns))
    for row in rows:
        click.echo("  ".join(f"{'' if row[c] is None else row[c]:>20}" for c in columns))
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
