"""``thunderproxy demo``: the same replay through ``default`` and then ``tr`` against an
embedded simulator, side by side.

One process holds everything: a simulated vLLM (faster than real time), the proxy itself
(``runtime.run``, audit db and Datasette included) and a handful of ThunderAgent SWE-agent
programs replayed through it on a KV cache far too small for them: the regime ``tr`` is for.
The programs are replayed twice, each time on a fresh simulator with the same seed: first
through ``default`` (a proxy that only forwards), then through ``tr``. It prints both runs'
figures, labelled with their clock, how ``tr`` compares, and where to look at each run, then
keeps serving (``tr``) until Ctrl-C so the audit db can be explored at ``<proxy
url>/datasette/``.

Times are simulated seconds unless labelled wall: the simulator runs ``1 / time_scale`` times
faster than real time, and the audit db (and so Datasette) holds wall seconds, its ``runs`` rows
saying so (``clock``, ``time_scale``).
"""

from __future__ import annotations

import dataclasses
import math
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import trio

from ..clock import WallClock
from ..config import load_settings
from ..runtime import RunningProxy, open_demo
from . import figures, store
from .agent import Agents
from .config import DEFAULT_PROFILE, TIME_SETTINGS, BenchConfig, DemoConfig
from .harness import workload_for
from .progress import ProgressBar
from .realtime import proxy_run_figures
from .transport import HttpTransport
from .virtual import TargetResult
from .workload import Workload

#: KV capacity as a fraction of what the concurrent programs would hold: 2.5x oversubscribed,
#: the regime tr is for (on this workload ``bench --virtual`` has tr ahead of default on both
#: steps/min and p99 program time; at 2x on 12 programs of 10 calls it was behind on both).
OVERSUBSCRIPTION = 2.5
#: The routers the demo compares, in the order it runs them; the last keeps serving.
ROUTERS = ("default", "tr")

__all__ = [
    "DemoConfig",
    "DemoOutcome",
    "RouterRun",
    "dashboard_url",
    "demo_bench_config",
    "run_demo",
]
#: Rows of a time series the dashboard link asks for over one run's window.
DASHBOARD_BUCKETS = 40


def demo_kv_tokens(workload: Workload, concurrency: int) -> int:
    """A KV cache that holds 1/OVERSUBSCRIPTION of what ``concurrency`` programs need, and
    always at least the largest single prompt (a smaller one could never run it)."""
    wanted = int(concurrency * workload.mean_context_tokens() / OVERSUBSCRIPTION)
    return max(wanted, workload.max_context_tokens + 8_192)


def demo_bench_config(config: DemoConfig) -> BenchConfig:
    """The demo's workload and backend as a bench configuration (KV size included), so that
    ``thunderproxy bench`` and the scheduling suite replay exactly what the demo does."""
    bench = BenchConfig(
        trace="thunderagent",
        targets=ROUTERS,
        concurrency=config.concurrency,
        programs=config.programs,
        max_steps=config.max_steps,
        time_scale=config.time_scale,
        profile=DEFAULT_PROFILE,
        seed=config.seed,
    )
    workload = workload_for(bench)
    return dataclasses.replace(bench, kv_tokens=demo_kv_tokens(workload, config.concurrency))


def dashboard_url(datasette: str, since: float, until: float) -> str:
    """The scheduling dashboard over ``since``..``until`` (Unix seconds), with a bucket that
    gives about :data:`DASHBOARD_BUCKETS` points over the window (the dashboard's filters take
    the canned queries' parameters: docs/EXPLORE.md)."""
    start, end = math.floor(since), math.ceil(until)
    bucket = max(1, round((end - start) / DASHBOARD_BUCKETS))
    query = urllib.parse.urlencode({"since": start, "until": end, "bucket": bucket})
    return f"{datasette.rstrip('/')}/-/dashboards/scheduling?{query}"


@dataclass
class RouterRun:
    """One router's replay: its figures (simulated seconds), its audit run and wall window."""

    router: str
    result: TargetResult
    run_id: int
    #: Unix seconds (wall) of the replay's start and end.
    since: float
    until: float

    @property
    def wall_s(self) -> float:
        return self.until - self.since


@dataclass
class DemoOutcome:
    url: str
    datasette_url: str
    runs: list[RouterRun] = field(default_factory=list)

    @property
    def result(self) -> TargetResult:
        """tr's figures (the router the demo is about)."""
        return self.run("tr").result

    def run(self, router: str) -> RouterRun:
        return next(r for r in self.runs if r.router == router)

    def dashboard(self, router: str) -> str:
        run = self.run(router)
        return dashboard_url(self.datasette_url, run.since, run.until)


#: The demo's table: label (with its unit and clock), how to read it from a run, its format.
ROWS: tuple[tuple[str, Callable[[RouterRun], Any], str], ...] = (
    ("calls per simulated minute", lambda r: r.result.figures["steps_per_min"], "{:.1f}"),
    (
        "program time, mean (simulated s)",
        lambda r: r.result.figures["program_time_mean_s"],
        "{:,.0f}",
    ),
    (
        "program time, p99 (simulated s)",
        lambda r: r.result.figures["program_time_p99_s"],
        "{:,.0f}",
    ),
    (
        "later calls' TTFT, p99 (simulated s)",
        lambda r: r.result.figures["ttft_later_p99_s"],
        "{:.1f}",
    ),
    (
        "waited in the proxy, all calls (simulated s)",
        lambda r: r.result.figures["pause_time_total_s"],
        "{:,.0f}",
    ),
    ("prefix-cache hit rate", lambda r: r.result.figures["prefix_hit_rate"], "{:.3f}"),
    ("engine preemptions", lambda r: r.result.figures["preemptions"], "{:,d}"),
    ("programs paused by the proxy", lambda r: r.result.figures["pauses"], "{:,d}"),
    ("replay took (wall s)", lambda r: r.wall_s, "{:.0f}"),
    ("audit run (runs.id)", lambda r: r.run_id, "{:d}"),
)


def side_by_side(runs: list[RouterRun]) -> str:
    """The demo's table: one column per router, every time labelled with its clock."""
    table = [["", *(r.router for r in runs)]]
    for label, get, spec in ROWS:
        cells = []
        for run in runs:
            value = get(run)
            cells.append("-" if value is None else spec.format(value))
        table.append([label, *cells])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = []
    for row in table:
        cells = [
            row[0].ljust(widths[0]),
            *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)),
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def comparison(runs: list[RouterRun]) -> str:
    """``tr vs default: N.NNx steps/min, p99 program time A s vs B s`` (simulated seconds)."""
    base = next(r for r in runs if r.router == "default").result.figures
    mine = next(r for r in runs if r.router == "tr").result.figures
    ratio = mine["steps_per_min"] / base["steps_per_min"] if base["steps_per_min"] else 0.0
    return (
        f"tr vs default: {ratio:.2f}x steps/min, p99 program time "
        f"{mine['program_time_p99_s']:,.0f} s vs {base['program_time_p99_s']:,.0f} s "
        "(simulated seconds)"
    )


async def run_demo(
    config: DemoConfig,
    *,
    echo: Callable[[str], None] = print,
    progress: bool | None = None,
    task_status: trio.TaskStatus[DemoOutcome] = trio.TASK_STATUS_IGNORED,
) -> DemoOutcome:
    bench = demo_bench_config(config)
    workload = workload_for(bench)
    kv = bench.kv_tokens
    assert kv is not None
    speed = 1 / config.time_scale
    echo(
        f"thunderproxy demo: {len(workload.programs)} SWE-agent programs of up to "
        f"{config.max_steps} calls, {config.concurrency} at a time, against a simulated vLLM "
        f"with {kv:,} KV tokens (about {OVERSUBSCRIPTION:g}x oversubscribed) running "
        f"{speed:g}x faster than real time; the same replay through default, then tr"
    )
    outcome = DemoOutcome(url="", datasette_url="")
    clock = WallClock()
    for router in ROUTERS:
        last = router == ROUTERS[-1]
        values = _proxy_values(config, router)
        sim_config = bench.sim_config(workload, router, time_scale=config.time_scale)
        async with open_demo(sim_config, values, wait=config.wait and last, echo=echo) as (
            proxy,
            sim_url,
        ):
            outcome.url = proxy.url
            outcome.datasette_url = proxy.url.rstrip("/") + "/datasette/"
            echo(f"{router}: replaying through {proxy.url} ...")
            since = clock.unix(trio.current_time())
            result = await _replay(config, bench, workload, router, proxy, sim_url, progress)
            until = clock.unix(trio.current_time())
            run_id = proxy.audit.run_id
            await trio.to_thread.run_sync(
                partial(store.mark_clock, config.db, run_id, time_scale=config.time_scale)
            )
            outcome.runs.append(RouterRun(router, result, run_id, since, until))
            if last:
                _report(outcome, config, echo)
                task_status.started(outcome)
    return outcome


def _proxy_values(config: DemoConfig, router: str) -> Mapping[str, Any]:
    base = load_settings()
    # The proxy's own seconds shrink with the simulator's, so that its cooldowns and bounds
    # stay what they are in simulated seconds.
    scaled = {name: base.value(name) * config.time_scale for name in TIME_SETTINGS}
    return {
        **scaled,
        "host": config.host,
        "port": config.port,
        "router": router,
        "db": config.db,
        "restore": False,
    }


async def _replay(
    config: DemoConfig,
    bench: BenchConfig,
    workload: Workload,
    router: str,
    proxy: RunningProxy,
    sim_url: str,
    progress: bool | None,
) -> TargetResult:
    bar = ProgressBar(
        router, programs=len(workload.programs), steps=workload.steps, enabled=progress
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
    _run, pause, pauses = await _proxy_figures(proxy, config.db, router)
    totals = figures.sum_truth(states)
    return TargetResult(
        target=router,
        concurrency=config.concurrency,
        kv_tokens=bench.kv_tokens or 0,
        figures=figures.compute(log, totals, pause_time_s=pause, pauses=pauses),
        log=log,
        truth=totals,
        clock="real",
        proxy_run_id=proxy.audit.run_id,
    )


def _report(outcome: DemoOutcome, config: DemoConfig, echo: Callable[[str], None]) -> None:
    speed = 1 / config.time_scale
    echo("")
    echo(side_by_side(outcome.runs))
    echo("")
    echo(comparison(outcome.runs))
    echo("")
    echo(
        f"Times are simulated seconds (the simulated vLLM runs {speed:g}x faster than real "
        "time) unless marked wall. The audit db, and so Datasette, holds wall seconds: a "
        f"time there is 1/{speed:g} of the same time here (runs.clock = 'wall', "
        f"runs.time_scale = {config.time_scale:g})."
    )
    lag = max(r.result.figures.get("sim_max_lag_s") or 0.0 for r in outcome.runs)
    if lag > 0.5 * config.time_scale:
        echo(
            f"warning: the simulator fell {lag:.2f} wall s behind its clock (a busy machine): "
            "its latencies are less trustworthy than its counts"
        )
    echo(f"audit db: {config.db} (every transition, step and scheduling decision)")
    echo(f"explore it: {outcome.datasette_url}")
    for run in outcome.runs:
        echo(f"  {run.router} (run {run.run_id}) on the dashboard: {outcome.dashboard(run.router)}")


async def _proxy_figures(
    proxy: RunningProxy, db: str, router: str
) -> tuple[int | None, float | None, int | None]:
    """The run's pause figures, read from the audit db once the writer has caught up."""
    audit = proxy.audit
    with trio.move_on_after(10):
        # The writer signals nothing when it has caught up; poll its counters briefly.
        while audit.statistics().queued or audit.written + audit.dropped < audit.accepted:  # noqa: ASYNC110
            await trio.sleep(0.05)
    return await trio.to_thread.run_sync(proxy_run_figures, db, audit.run_id - 1, router)
