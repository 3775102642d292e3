"""``thunderproxy demo``: the same replay through ``default`` and then ``tr`` against a
simulated vLLM, side by side, then a proxy serving its history.

32 ThunderAgent SWE-agent programs are replayed on a KV cache far too small for them,
the regime ``tr`` is for: first through ``default`` (a proxy that only forwards), then, on a
fresh simulator with the same random seed, through ``tr``. Both replays run in virtual time:
the real gateway, scheduler and audit log in this process, the simulated vLLM's engine on trio's
mock clock, exactly as ``thunderproxy bench --virtual`` runs them. So the comparison is the same
on every run and on any machine, busy or not, and takes seconds, not the hour the programs
would take. Each replay's audit rows go into the audit db as a run of their own, in simulated
seconds (``runs.clock = 'simulated'``), so the printout and Datasette agree.

Then a ``tr`` proxy with an embedded simulator serves that db, with Datasette, until Ctrl-C: the
dashboard link printed for each run opens it on that run's window.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from ...config import load_settings
from ...explore.links import dashboard_url
from ...runtime import open_demo
from ..config import DEFAULT_PROFILE, TIME_SETTINGS, BenchConfig, DemoConfig
from ..workloads.workload import Workload
from .harness import run_bench, workload_for
from .progress import ProgressBar
from .virtual import TargetResult

#: KV capacity as a fraction of what the concurrent programs would hold: 2x oversubscribed, the
#: regime tr is for, as in the scheduling suite's SWE-agent cell at 32 agents (there tr makes
#: 1.3x default's steps/min; on this workload 1.26x, where on 8 programs it barely moved).
OVERSUBSCRIPTION = 2.0
#: The routers the demo compares, in the order it runs them.
ROUTERS = ("default", "tr")

__all__ = [
    "DemoConfig",
    "DemoOutcome",
    "RouterRun",
    "compare",
    "demo_bench_config",
    "serve_demo",
]


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


@dataclass
class RouterRun:
    """One router's replay: its figures (simulated seconds) and its run in the audit db."""

    router: str
    result: TargetResult
    run_id: int
    #: The run's window in the audit db (Unix seconds; its span is the replay's simulated one).
    since: float
    until: float

    @property
    def wall_s(self) -> float:
        """How long the replay took this machine (it ran faster than real time)."""
        return self.result.wall_s or 0.0


@dataclass
class DemoOutcome:
    url: str = ""
    datasette_url: str = ""
    runs: list[RouterRun] = field(default_factory=list)

    @property
    def result(self) -> TargetResult:
        """tr's figures (the router the demo is about)."""
        return self.run("tr").result

    def run(self, router: str) -> RouterRun:
        return next(r for r in self.runs if r.router == router)

    def dashboard(self, router: str) -> str:
        run = self.run(router)
        return dashboard_url(self.datasette_url, run.run_id, run.since, run.until)


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


def compare(
    config: DemoConfig, *, echo: Callable[[str], None] = print, progress: bool | None = None
) -> list[RouterRun]:
    """Replay the demo's programs through each router in virtual time, each into the audit db
    as a run of its own. Runs trio loops of its own: call it outside any trio run."""
    bench = dataclasses.replace(demo_bench_config(config), virtual=True)
    workload = workload_for(bench)
    kv = bench.kv_tokens
    assert kv is not None
    echo(
        f"thunderproxy demo: {len(workload.programs)} SWE-agent programs of up to "
        f"{config.max_steps} calls, {config.concurrency} at a time, against a simulated vLLM "
        f"with {kv:,} KV tokens (about {OVERSUBSCRIPTION:g}x oversubscribed); the same replay "
        "through default, then tr, in virtual time (the proxy's gateway and scheduler in this "
        "process, the simulator on a mock clock: the same figures on every run)"
    )

    def bar(target: str, shown: Workload) -> ProgressBar:
        return ProgressBar(
            target, programs=len(shown.programs), steps=shown.steps, enabled=progress
        )

    report = run_bench(bench, db=config.db, progress=bar, workload=workload)
    runs = []
    for result in report.results:
        assert result.proxy_run_id is not None
        since, until = _window(config.db, result.proxy_run_id)
        runs.append(RouterRun(result.target, result, result.proxy_run_id, since, until))
    return runs


async def serve_demo(
    config: DemoConfig,
    runs: list[RouterRun],
    *,
    echo: Callable[[str], None] = print,
    task_status: trio.TaskStatus[DemoOutcome] = trio.TASK_STATUS_IGNORED,
) -> DemoOutcome:
    """Print the comparison, then serve the audit db (a ``tr`` proxy in front of an embedded
    simulator, Datasette included) until Ctrl-C, or not at all without ``config.wait``."""
    bench = demo_bench_config(config)
    workload = workload_for(bench)
    sim_config = bench.sim_config(workload, "tr", time_scale=config.time_scale)
    outcome = DemoOutcome(runs=list(runs))
    async with open_demo(sim_config, _proxy_values(config), wait=config.wait, echo=echo) as (
        proxy,
        _sim_url,
    ):
        outcome.url = proxy.url
        outcome.datasette_url = proxy.url.rstrip("/") + "/datasette/"
        _report(outcome, config, echo)
        task_status.started(outcome)
    return outcome


def _window(db: str, run_id: int) -> tuple[float, float]:
    conn = sqlite3.connect(db)
    try:
        row = conn.execute("SELECT started_at, stopped_at FROM runs WHERE id = ?", (run_id,))
        since, until = row.fetchone()
    finally:
        conn.close()
    return float(since), float(until)


def _proxy_values(config: DemoConfig) -> Mapping[str, Any]:
    base = load_settings()
    # The proxy's own seconds shrink with the simulator's, so that its cooldowns and bounds
    # stay what they are in simulated seconds for traffic sent to it while it serves.
    scaled = {name: base.value(name) * config.time_scale for name in TIME_SETTINGS}
    return {
        **scaled,
        "host": config.host,
        "port": config.port,
        "router": "tr",
        "db": config.db,
        "restore": False,
    }


def _report(outcome: DemoOutcome, config: DemoConfig, echo: Callable[[str], None]) -> None:
    echo("")
    echo(side_by_side(outcome.runs))
    echo("")
    echo(comparison(outcome.runs))
    echo("")
    echo(
        "Times are simulated seconds unless marked wall. The audit db holds the two replays in "
        "simulated seconds too (runs.clock = 'simulated'), so Datasette shows what this table "
        "shows."
    )
    echo(f"audit db: {config.db} (every transition, step and scheduling decision)")
    echo(f"explore it: {outcome.datasette_url}")
    for run in outcome.runs:
        echo(f"  {run.router} (run {run.run_id}) on the dashboard: {outcome.dashboard(run.router)}")
