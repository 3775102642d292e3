"""``run_bench``: one bench invocation, every target (and every concurrency of a sweep), on
the virtual clock or in real time; the report it returns is what the CLI prints and stores."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio

from ... import __version__
from ..agents.agent import ungrouped_errors
from ..config import BenchConfig, offloads
from ..engine.server import Echo
from ..report import figures
from ..report.conformance import draws_as_means
from ..workloads.traces import load_workload
from ..workloads.workload import Workload
from . import realtime, store, virtual
from .progress import ProgressBar
from .virtual import TargetResult

#: The figures the summary table and the docs show (``--json`` has every figure).
SUMMARY_KEYS = (
    "steps_per_min",
    "program_time_mean_s",
    "steps_per_min_busy",
    "programs_completed",
    "output_tokens_per_s",
    "prefix_hit_rate",
    "evicted_prefix_tokens",
    "recomputed_prefill_tokens",
    "preemptions",
    "step_latency_p50_s",
    "step_latency_p99_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "program_time_p50_s",
    "program_time_p99_s",
    "pause_time_total_s",
    "pauses",
    "errors",
)

ProgressFactory = Callable[[str, Workload], ProgressBar | None]


@dataclass
class BenchReport:
    config: BenchConfig
    workload: Workload
    results: list[TargetResult] = field(default_factory=list)
    bench_run_id: int | None = None
    version: str = __version__

    def summaries(self) -> list[dict[str, Any]]:
        out = []
        sweep = len({r.concurrency for r in self.results}) > 1
        for r in self.results:
            summary = r.summary()
            if sweep:
                summary["label"] = f"{r.label}@{r.concurrency}"
            out.append(summary)
        return out

    def to_json(self) -> dict[str, Any]:
        """Every figure under stable keys. With exactly one result its figures are also at the
        top level, so ``json["steps_per_min"]`` works for single-target runs."""
        results = self.summaries()
        doc: dict[str, Any] = {
            "workload": self.workload.name,
            "version": self.version,
            "notes": list(self.workload.notes),
            "config": self.config.describe(),
            "bench_run_id": self.bench_run_id,
            "results": results,
        }
        if len(results) == 1:
            doc = {**results[0], **doc}
        return doc

    def table(self) -> str:
        keys: tuple[str, ...] = SUMMARY_KEYS
        if self.has_cpu_tier():
            # The CPU tier's rows only where some backend has one: elsewhere they are all 0.
            at = keys.index("prefix_hit_rate") + 1
            keys = (*keys[:at], "cpu_hit_tokens", "cpu_loads", *keys[at:])
        if self.config.interactive:
            # Each latency class's tail, where the programs are of more than one.
            at = keys.index("ttft_p99_s") + 1
            keys = (*keys[:at], *(k for k, _, _ in figures.KEYS if k.startswith(figures.CLASSES)),
                    *keys[at:])  # fmt: skip
        # --conformance's simulator draws as one column each: their mean.
        summaries = draws_as_means(self.summaries())
        if any(s.get("other_cpu_cores") is not None for s in summaries):
            keys = (*keys, "other_cpu_cores")  # real time: how quiet the machine was
        return figures.table(summaries, keys=keys)

    def has_cpu_tier(self) -> bool:
        config = self.config
        knobs = config.sim_settings
        return any(offloads(t) for t in config.targets) or bool(
            knobs.get("kv_offloading_tokens") or knobs.get("kv_offloading_size")
        )


def code_version() -> str:
    """The package version, and the git commit when run from a checkout (``-dirty`` when it
    has uncommitted changes): figures of a scheduler under development need both."""
    root = Path(__file__).resolve().parents[2]
    try:
        described = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return __version__
    return f"{__version__} (git {described})" if described else __version__


def print_err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def workload_for(config: BenchConfig) -> Workload:
    loaded = load_workload(
        config.trace,
        seed=config.seed,
        run_id=config.audit_run,
        shared_prefix_tokens=config.shared_prefix_tokens,
        carry_answer=config.carry_answer,
    )
    return loaded.sample(config.sample, config.seed).subset(config.programs, config.max_steps)


def run_bench(
    config: BenchConfig,
    *,
    sweep: Sequence[int] = (),
    db: str | None = None,
    command: Sequence[str] = (),
    progress: ProgressFactory | None = None,
    workload: Workload | None = None,
    echo: Echo = print_err,
) -> BenchReport:
    """Measure every target of ``config`` (at every concurrency of ``sweep``, or at
    ``config.concurrency``); results go to ``db`` when given."""
    workload = workload or workload_for(config)
    report = BenchReport(config, workload, version=code_version())
    if db:
        report.bench_run_id = store.start_bench_run(
            db,
            version=report.version,
            command=command,
            trace=config.trace,
            workload=workload,
            clock=config.clock,
            config=config.describe(),
        )
    concurrencies = tuple(sweep) or (config.concurrency_for(workload),)

    def finished(result: TargetResult) -> None:
        report.results.append(result)
        if db and report.bench_run_id is not None:
            store.save_result(db, report.bench_run_id, result)

    def bar(target: str, concurrency: int) -> ProgressBar | None:
        if progress is None:
            return None
        label = target if len(concurrencies) == 1 else f"{target}@{concurrency}"
        return progress(label, workload)

    def on_virtual_clock(
        config: BenchConfig, side: str = "", timing_scale: float | None = None
    ) -> None:
        for concurrency in concurrencies:
            for target in config.targets:
                shown = bar(virtual.result_label(target, side, timing_scale), concurrency)
                result = _timed(
                    partial(
                        virtual.run, workload, config, target, concurrency=concurrency,
                        progress=shown,
                    )
                )  # fmt: skip
                result.side = side
                result.timing_scale = timing_scale
                if shown is not None:
                    shown.close(result.log)
                finished(result)

    if config.virtual:
        on_virtual_clock(config)
    else:
        side = "engine" if config.conformance else ""

        def on_engine(result: TargetResult) -> None:
            result.side = side
            finished(result)

        with ungrouped_errors():
            trio.run(_real_time, workload, config, concurrencies, db, bar, on_engine, echo)
        if config.conformance:
            # The same targets on the simulator: virtual time, the engine's settings and the
            # timing profile fitted to it, once per timing draw (config.SIM_DRAWS).
            draws = config.timing_draws()
            for scale in draws:
                on_virtual_clock(
                    config.on_simulator(scale), "sim", scale if len(draws) > 1 else None
                )
    if db and report.bench_run_id is not None:
        store.finish_bench_run(db, report.bench_run_id)
    return report


def _timed(fn: Callable[[], TargetResult]) -> TargetResult:
    start = time.perf_counter()
    result = fn()
    result.wall_s = time.perf_counter() - start
    return result


async def _real_time(
    workload: Workload,
    config: BenchConfig,
    concurrencies: Sequence[int],
    db: str | None,
    bar: Callable[[str, int], ProgressBar | None],
    finished: Callable[[TargetResult], None],
    echo: Echo,
) -> None:
    with tempfile.TemporaryDirectory(prefix="thunderproxy-bench-") as scratch:
        audit_db = db or str(Path(scratch) / "audit.db")
        async with (
            realtime.ended_by_signals(),
            realtime.http_client(max(concurrencies)) as client,
            trio.open_nursery() as nursery,
        ):
            fleet: realtime.Fleet
            if config.on_engine:
                fleet = realtime.EngineFleet(
                    nursery, client, workload, config, scratch=Path(scratch), echo=echo
                )
            else:
                fleet = realtime.SimFleet(nursery, client, workload, config)
            session = realtime.Session(nursery, client, workload, config, db=audit_db, fleet=fleet)
            # In rounds, each target once a round: a slow stretch of the machine then falls
            # on every target alike rather than on one target's runs.
            rounds = range(1, config.repeat + 1) if config.repeat > 1 else (0,)
            try:
                await session.start()
                for run, concurrency in itertools.product(rounds, concurrencies):
                    for target in config.targets:
                        shown = bar(f"{target} #{run}" if run else target, concurrency)
                        result = await session.run_target(
                            target, concurrency=concurrency, progress=shown
                        )
                        result.run = run
                        if shown is not None:
                            shown.close(result.log)
                        finished(result)
            finally:
                await session.stop()
                nursery.cancel_scope.cancel()
                for note in fleet.notes:
                    echo(f"note: {note}")


def write_json(report: BenchReport, path: str) -> None:
    Path(path).write_text(json.dumps(report.to_json(), indent=2, default=str) + "\n")
