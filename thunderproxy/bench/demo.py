"""``thunderproxy demo``: a short replay through ``tr`` against an embedded simulator.

One process holds everything: a simulated vLLM (faster than real time), the proxy itself
(``runtime.run``, router ``tr``, audit db and Datasette included) and a handful of ThunderAgent
SWE-agent programs replayed through it, on a KV cache small enough that ``tr`` has to pause
programs. It prints the figures and where to look at what happened, then keeps serving until
Ctrl-C so the audit db can be explored at ``<proxy url>/datasette/``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import trio

from ..config import load_settings
from ..runtime import RunningProxy, open_demo
from ..sim import SimConfig
from . import figures
from .agent import Agents
from .config import DEFAULT_PROFILE, TIME_SETTINGS, BenchConfig
from .harness import SUMMARY_KEYS, workload_for
from .progress import ProgressBar
from .realtime import proxy_run_figures
from .transport import HttpTransport
from .virtual import TargetResult
from .workload import Workload

#: KV capacity as a fraction of what the concurrent programs would hold: about 2x oversubscribed.
OVERSUBSCRIPTION = 2.0


@dataclass(frozen=True)
class DemoConfig:
    programs: int = 12
    max_steps: int = 10
    concurrency: int = 6
    time_scale: float = 0.1
    host: str = "127.0.0.1"
    port: int = 8300
    db: str = "thunderproxy-demo.db"
    seed: int = 0
    #: Keep serving after the replay, until Ctrl-C (False: stop at once, for scripts and tests).
    wait: bool = True


def demo_kv_tokens(workload: Workload, concurrency: int) -> int:
    """A KV cache that holds about half of what ``concurrency`` programs need, and always at
    least the largest single prompt (a smaller one could never run it)."""
    wanted = int(concurrency * workload.mean_context_tokens() / OVERSUBSCRIPTION)
    return max(wanted, workload.max_context_tokens + 8_192)


def demo_bench_config(config: DemoConfig) -> BenchConfig:
    """The demo's workload and backend as a bench configuration (KV size included), so that
    ``thunderproxy bench`` and the scheduling suite replay exactly what the demo does."""
    bench = BenchConfig(
        trace="thunderagent",
        targets=("default", "tr"),
        concurrency=config.concurrency,
        programs=config.programs,
        max_steps=config.max_steps,
        time_scale=config.time_scale,
        profile=DEFAULT_PROFILE,
        seed=config.seed,
    )
    workload = workload_for(bench)
    return dataclasses.replace(bench, kv_tokens=demo_kv_tokens(workload, config.concurrency))


@dataclass
class DemoOutcome:
    url: str
    datasette_url: str
    result: TargetResult


async def run_demo(
    config: DemoConfig,
    *,
    echo: Callable[[str], None] = print,
    progress: bool | None = None,
    task_status: trio.TaskStatus[DemoOutcome] = trio.TASK_STATUS_IGNORED,
) -> DemoOutcome:
    bench = BenchConfig(
        trace="thunderagent",
        targets=("tr",),
        concurrency=config.concurrency,
        programs=config.programs,
        max_steps=config.max_steps,
        time_scale=config.time_scale,
        profile=DEFAULT_PROFILE,
        seed=config.seed,
    )
    workload = workload_for(bench)
    bar = ProgressBar("tr", programs=len(workload.programs), steps=workload.steps, enabled=progress)
    kv = demo_kv_tokens(workload, config.concurrency)
    bench = dataclasses.replace(bench, kv_tokens=kv)
    sim_config: SimConfig = bench.sim_config(workload, "tr", time_scale=config.time_scale)
    base = load_settings()
    scaled = {name: base.value(name) * config.time_scale for name in TIME_SETTINGS}
    values = {
        **scaled,
        "host": config.host,
        "port": config.port,
        "router": "tr",
        "db": config.db,
        "restore": False,
    }
    async with open_demo(sim_config, values, wait=config.wait, echo=echo) as (proxy, sim_url):
        echo(
            f"thunderproxy demo: {len(workload.programs)} SWE-agent programs, "
            f"{config.concurrency} at a time, through tr at {proxy.url} against a "
            f"simulated vLLM with {kv:,} KV tokens (about {OVERSUBSCRIPTION:.0f}x "
            f"oversubscribed), {1 / config.time_scale:.0f}x faster than real time"
        )
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0)) as client:
            transport = HttpTransport(
                client, base_for=lambda _p: proxy.url, model=bench.model, proxy_url=proxy.url
            )
            agents = Agents(
                workload,
                transport,
                bench.schedule(workload),
                time_scale=config.time_scale,
                progress=bar,
            )
            log = await agents.run()
            states = [(await client.get(sim_url + "/_sim/state")).json()]
        bar.close(log)
        _run, pause, pauses = await _proxy_figures(proxy, config.db)
        totals = figures.sum_truth(states)
        result = TargetResult(
            target="tr",
            concurrency=config.concurrency,
            kv_tokens=kv,
            figures=figures.compute(log, totals, pause_time_s=pause, pauses=pauses),
            log=log,
            truth=totals,
            clock="real",
            proxy_run_id=proxy.audit.run_id,
        )
        datasette = proxy.url.rstrip("/") + "/datasette/"
        echo("")
        echo(figures.table([result.summary()], keys=SUMMARY_KEYS))
        echo("")
        echo(f"audit db: {config.db}, run {proxy.audit.run_id} (every transition, step "
             "and scheduling decision)")  # fmt: skip
        echo(f"explore it: {datasette}")
        outcome = DemoOutcome(proxy.url, datasette, result)
        task_status.started(outcome)
    return outcome


async def _proxy_figures(
    proxy: RunningProxy, db: str
) -> tuple[int | None, float | None, int | None]:
    """The run's pause figures, read from the audit db once the writer has caught up."""
    audit = proxy.audit
    with trio.move_on_after(10):
        # The writer signals nothing when it has caught up; poll its counters briefly.
        while audit.statistics().queued or audit.written + audit.dropped < audit.accepted:  # noqa: ASYNC110
            await trio.sleep(0.05)
    return await trio.to_thread.run_sync(proxy_run_figures, db, audit.run_id - 1, "tr")
