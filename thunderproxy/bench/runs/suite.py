"""``thunderproxy bench --suite NAME``: a fixed matrix of scheduling cells on the virtual
clock, every cell run through ``tr`` and its baselines, with a verdict per cell.

A cell is one workload on one backend (a :class:`~.config.BenchConfig`) and its arms: the
candidate (``tr``, or ``tr+offload`` over a CPU tier), the baselines it is judged against
(``default``; ``offload`` alone where the backend has a CPU tier) and, where pausing has
headroom, the free-reload bound (docs/SCHEDULING.md, "How far pausing can go"), which no
pausing policy can pass and so is reported as a ratio, not judged against.

The verdict rule (:func:`verdict`): the candidate passes when its steps/min are at least
0.98x the best baseline's (the baseline with the most steps/min) and its p99 program time at
most 1.02x that baseline's. Arms run one per process, ``jobs`` at a time: each virtual run is
deterministic whatever runs beside it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from ...errors import ConfigError
from ..config import BenchConfig
from ..report.figures import MAX_P99_RATIO, MIN_STEPS_RATIO
from ..workloads.workload import Workload

#: Where some programs are interactive: their later calls' TTFT p99 at most this multiple of
#: the baseline's, and none of their calls held past the class's bound.
MAX_INTERACTIVE_TTFT_RATIO = 1.2

#: The free-reload bound's backend: a CPU tier far larger than any trace, a link that costs
#: nothing (docs/SCHEDULING.md, "How far pausing can go").
BOUND_OFFLOAD_TOKENS = 50_000_000
BOUND_SIM = {"kv_offload_bandwidth_gbps": 1_000_000.0, "kv_offload_latency_us": 0.0}

#: Roles of an arm.
CANDIDATE, BASELINE, BOUND = "candidate", "baseline", "bound"


@dataclass(frozen=True)
class Arm:
    """One column of a cell: a bench target, its role, and what it changes of the cell's
    configuration (the bound's CPU tier and link)."""

    label: str
    target: str
    role: str
    changes: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Cell:
    name: str
    title: str
    config: BenchConfig
    arms: tuple[Arm, ...]
    #: Open-loop cells: Poisson arrivals at this multiple of what the cache holds (the rate is
    #: worked out from the workload when the cell runs, see :func:`poisson_rate`).
    load: float | None = None

    def arm_config(self, arm: Arm, workload: Workload | None = None) -> BenchConfig:
        config = dataclasses.replace(self.config, targets=(arm.target,), **dict(arm.changes))
        if self.load is not None:
            if workload is None:
                from .harness import workload_for

                workload = workload_for(config)
            config = dataclasses.replace(config, rate=poisson_rate(workload, config, self.load))
        return config

    def command(self, arm: Arm) -> str:
        """The ``thunderproxy bench`` command that measures this arm alone."""
        return bench_command(self.arm_config(arm))


def _arms(
    candidate: str = "tr", *, bound: bool = False, baselines: Sequence[str] = ("default",)
) -> tuple[Arm, ...]:
    arms = [Arm(b, b, BASELINE) for b in baselines]
    arms.append(Arm(candidate, candidate, CANDIDATE))
    if bound:
        changes = {"offload_tokens": BOUND_OFFLOAD_TOKENS, "sim_settings": dict(BOUND_SIM)}
        arms.append(Arm("bound", "offload", BOUND, changes))
    return tuple(arms)


def poisson_rate(workload: Workload, config: BenchConfig, load: float) -> float:
    """Programs per simulated second that keep ``load`` times as many programs in flight as
    the cache holds, were each to take as long as it would alone on an idle engine (Little's
    law: in flight = rate x time in the system). The cache holds ``kv / mean context``
    programs; a program alone takes its tool gaps plus one decode step per output token."""
    from ...sim import PROFILES
    from ...sim.engine.timing import batch_shape, step_seconds

    profile = PROFILES[config.profile]
    kv = config.kv_tokens or profile.kv_capacity_tokens
    holds = kv / max(1.0, workload.mean_context_tokens())
    alone = []
    for program in workload.programs:
        seconds = 0.0
        for n, step in enumerate(program.steps):
            if n:
                seconds += step.gap_before_s * config.gap_scale
            decode = step_seconds(profile, batch_shape([(1, step.prompt_tokens, True)]))
            seconds += step.output_tokens * decode
        alone.append(seconds)
    mean_alone = sum(alone) / max(1, len(alone))
    # Four significant digits: the rate the printed command gives is the one that ran.
    return float(f"{load * holds / mean_alone:.4g}")


def bench_command(config: BenchConfig) -> str:
    """The flags of ``config`` that differ from the CLI's defaults, as one command line."""
    base = BenchConfig()
    parts = ["thunderproxy bench --virtual"]
    if config.trace != base.trace:
        parts.append(f"--trace {config.trace}")
    parts.append(f"--target {','.join(config.targets)}")
    flags = (
        ("programs", "--programs"),
        ("max_steps", "--max-steps"),
        ("concurrency", "--concurrency"),
        ("kv_tokens", "--kv-tokens"),
        ("offload_tokens", "--offload-tokens"),
        ("shared_prefix_tokens", "--shared-prefix-tokens"),
        ("carry_answer", "--carry-answer"),
        ("arrivals", "--arrivals"),
        ("interactive", "--interactive"),
    )
    for name, flag in flags:
        value = getattr(config, name)
        if value is not None and value != getattr(base, name):
            parts.append(f"{flag} {value}")
    if config.sample != base.sample:
        parts.append(f"--sample {config.sample:g}")
    if config.rate:
        parts.append(f"--rate {config.rate:g}")
    if not config.release:
        parts.append("--no-release")
    if config.seed != base.seed:
        parts.append(f"--seed {config.seed}")
    for name, value in sorted(config.sim_settings.items()):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        parts.append(f"--sim {name}={value}")
    for name, value in sorted(config.proxy_settings.items()):
        parts.append(f"--set {name}={value}")
    parts.append("--db ''")
    return " ".join(parts)


#: SWE-agent cells replay the first 32 programs of the trace (about 1,440 calls), so that the
#: whole suite runs in about half an hour on two cores; cells of more agents replay one program
#: per agent (with 32 programs, 64 agents would start every program at once, as 32 do, and the
#: cell would repeat the 32-agent one figure for figure).
SWE_PROGRAMS = 32


def _swe(agents: int, kv: int, **more: Any) -> BenchConfig:
    return BenchConfig(
        trace="thunderagent",
        virtual=True,
        programs=max(SWE_PROGRAMS, agents),
        concurrency=agents,
        kv_tokens=kv,
        **more,
    )


def _short(seed: int) -> BenchConfig:
    return BenchConfig(
        virtual=True, programs=32, max_steps=12, concurrency=16, kv_tokens=80_000, seed=seed
    )


def _demo_cell() -> Cell:
    from .demo import DemoConfig, demo_bench_config

    config = dataclasses.replace(demo_bench_config(DemoConfig()), virtual=True, targets=())
    return Cell("demo", "the demo's workload (`thunderproxy demo`)", config, _arms())


def full_cells() -> list[Cell]:
    """Every cell of the ``full`` suite."""
    cells = []
    for agents in (8, 16, 32, 64):
        cells.append(
            Cell(
                f"swe-{agents}",
                f"SWE-agent trace, {agents} agents, 432K",
                _swe(agents, 432_000),
                _arms(bound=agents >= 32),
            )
        )
    for seed in (0, 1, 2):
        cells.append(
            Cell(
                f"short-s{seed}",
                f"32 programs x 12 calls, 16 agents, 80K, seed {seed}",
                _short(seed),
                _arms(bound=True),
            )
        )
    cells.append(_demo_cell())
    cells.append(
        Cell(
            "council",
            "LLM councils (3-4 members and a chairman), 24K",
            BenchConfig(trace="council", virtual=True, kv_tokens=24_000),
            _arms(),
        )
    )
    cells.append(
        Cell(
            "oneshot",
            "one-shot calls naming no program, 1/s, 24K",
            BenchConfig(trace="oneshot", virtual=True, kv_tokens=24_000, release=False),
            _arms(),
        )
    )
    for kv in (216_000, 432_000):
        cells.append(
            Cell(
                f"mooncake-{kv // 1000}k",
                f"Mooncake conversation trace, a quarter of its sessions, {kv // 1000}K",
                BenchConfig(trace="mooncake", virtual=True, sample=0.25, kv_tokens=kv),
                _arms(),
            )
        )
    cells.append(
        Cell(
            "mixed",
            "SWE-agent, 32 agents, 432K: 4 interactive programs among 28 batch ones",
            _swe(32, 432_000, interactive=4),
            _arms(),
        )
    )
    cells.append(
        Cell(
            "prefix13k",
            "SWE-agent, 32 agents, 432K, 13K shared prefix, answers carried at 0.3, no release",
            _swe(32, 432_000, shared_prefix_tokens=13_000, carry_answer=0.3, release=False),
            _arms(bound=True),
        )
    )
    for agents in (32, 64):
        for ratio in (1, 4):
            cells.append(
                Cell(
                    f"cpu{ratio}x-{agents}",
                    f"SWE-agent, {agents} agents, 432K, a CPU tier of {ratio}x the GPU cache",
                    _swe(agents, 432_000, offload_tokens=ratio * 432_000),
                    _arms("tr+offload", baselines=("offload",)),
                )
            )
    for load in (1.5, 2.0):
        cells.append(
            Cell(
                f"poisson-{load:g}x",
                f"SWE-agent, programs arriving (Poisson) at {load:g}x what 432K holds",
                # The rate is a placeholder: poisson_rate() sets it from the workload.
                _swe(0, 432_000, arrivals="poisson", rate=1.0),
                _arms(),
                load=load,
            )
        )
    return cells


def ci_cells() -> list[Cell]:
    """A few small cells that finish in seconds: the suite's shape, not tr's figures."""
    small = BenchConfig(virtual=True, programs=6, max_steps=4, concurrency=4, kv_tokens=12_000)
    return [
        Cell("ci-short", "6 programs x 4 calls, 4 agents, 12K", small, _arms(bound=True)),
        Cell(
            "ci-cpu",
            "6 programs x 4 calls, 4 agents, 12K, a CPU tier of 1x the GPU cache",
            dataclasses.replace(small, offload_tokens=12_000),
            _arms("tr+offload", baselines=("offload",)),
        ),
        Cell(
            "ci-council",
            "LLM councils, 24K (the first 12 programs)",
            BenchConfig(trace="council", virtual=True, kv_tokens=24_000, programs=12),
            _arms(),
        ),
    ]


SUITES: dict[str, Callable[[], list[Cell]]] = {"full": full_cells, "ci": ci_cells}


def cells_of(name: str, only: Sequence[str] = ()) -> list[Cell]:
    """The cells of suite ``name``; with ``only``, just those cells, in the suite's order."""
    try:
        cells = SUITES[name]()
    except KeyError:
        raise ConfigError(f"--suite {name!r} is not one of {', '.join(SUITES)}.") from None
    if not only:
        return cells
    unknown = sorted(set(only) - {c.name for c in cells})
    if unknown:
        raise ConfigError(
            f"--cells: suite {name!r} has no cell {', '.join(unknown)}; its cells are "
            f"{', '.join(c.name for c in cells)}."
        )
    return [c for c in cells if c.name in only]


# -- running --------------------------------------------------------------------------------


@dataclass
class CellResult:
    cell: Cell
    #: Each arm's figures (``TargetResult.summary()``), by label.
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)
    commands: dict[str, str] = field(default_factory=dict)

    @property
    def verdict(self) -> Verdict | None:
        return (
            verdict(self.cell, self.figures) if len(self.figures) == len(self.cell.arms) else None
        )


def run_arm(cell: Cell, arm: Arm) -> tuple[dict[str, Any], str]:
    """One arm on the virtual clock (in a worker process): its figures and its command."""
    from . import virtual
    from .harness import workload_for

    config = dataclasses.replace(cell.config, targets=(arm.target,))
    workload = workload_for(config)
    config = cell.arm_config(arm, workload)
    started = time.perf_counter()
    result = virtual.run(workload, config, arm.target)
    summary = result.summary()
    summary["label"] = arm.label
    summary["wall_s"] = time.perf_counter() - started
    return summary, bench_command(config)


def run_suite(
    cells: Sequence[Cell],
    *,
    jobs: int = 1,
    log: TextIO | None = None,
    on_update: Callable[[list[CellResult]], None] | None = None,
) -> list[CellResult]:
    """Every arm of every cell, ``jobs`` at a time (1: in this process); progress on ``log``,
    and ``on_update`` called with every result so far after each run (a suite cut short
    still leaves what it measured)."""
    out = log if log is not None else sys.stderr
    results = [CellResult(cell) for cell in cells]
    tasks = [(n, arm) for n, cell in enumerate(cells) for arm in cell.arms]
    began = time.perf_counter()
    done = 0

    def report(n: int, arm: Arm, summary: dict[str, Any], command: str) -> None:
        nonlocal done
        done += 1
        results[n].figures[arm.label] = summary
        results[n].commands[arm.label] = command
        out.write(
            f"[{done}/{len(tasks)}] {cells[n].name} {arm.label}: "
            f"{summary.get('steps_per_min') or 0:.1f} steps/min, "
            f"{summary['wall_s']:.0f} s wall ({time.perf_counter() - began:.0f} s so far)\n"
        )
        verdict_now = results[n].verdict
        if verdict_now is not None:
            out.write(f"    {cells[n].name}: {verdict_now.line()}\n")
        out.flush()
        if on_update is not None:
            on_update(results)

    out.write(f"scheduling suite: {len(cells)} cells, {len(tasks)} runs, {jobs} at a time\n")
    out.flush()
    if jobs <= 1:
        for n, arm in tasks:
            out.write(f"  running {cells[n].name} {arm.label} ...\n")
            out.flush()
            report(n, arm, *run_arm(cells[n], arm))
        return results
    # The shortest runs first (a run's cost grows with its calls), so that a suite stopped
    # early has measured as many whole cells as it could.
    from .harness import workload_for

    calls = [workload_for(cell.config).steps for cell in cells]
    tasks.sort(key=lambda task: calls[task[0]])
    # Fork: the parent runs no trio while workers start, and each worker runs its own.
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = {pool.submit(run_arm, cells[n], arm): (n, arm) for n, arm in tasks}
        for future in concurrent.futures.as_completed(futures):
            n, arm = futures[future]
            report(n, arm, *future.result())
    return results


# -- verdicts and the table -----------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    candidate: str
    baseline: str
    steps_ratio: float | None
    p99_ratio: float | None
    passed: bool
    #: Candidate steps/min over the free-reload bound's, where the cell has the bound.
    bound_ratio: float | None = None
    #: Where some programs are interactive: their later calls' TTFT p99 over the baseline's,
    #: the longest any of their calls waited in the proxy, and the class's bound.
    interactive_ttft_ratio: float | None = None
    interactive_wait_max_s: float | None = None
    interactive_bound_s: float | None = None

    def line(self) -> str:
        def x(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}x"

        text = (
            f"{'PASS' if self.passed else 'FAIL'}: {self.candidate} {x(self.steps_ratio)} "
            f"{self.baseline}'s steps/min, {x(self.p99_ratio)} its p99 program time"
        )
        if self.bound_ratio is not None:
            text += f"; {x(self.bound_ratio)} the free-reload bound's steps/min"
        if self.interactive_bound_s is not None:
            held = self.interactive_wait_max_s
            text += (
                f"; interactive: {x(self.interactive_ttft_ratio)} its later calls' TTFT p99, "
                f"held at most {'-' if held is None else f'{held:.2f}'} s "
                f"(bound {self.interactive_bound_s:g} s)"
            )
        return text


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or not b:
        return None
    return float(a) / float(b)


def verdict(cell: Cell, figures: Mapping[str, Mapping[str, Any]]) -> Verdict:
    """The candidate against the cell's best baseline (most steps/min): passes with at least
    ``MIN_STEPS_RATIO`` of its steps/min and at most ``MAX_P99_RATIO`` of its p99 program time."""
    candidate = next(a.label for a in cell.arms if a.role == CANDIDATE)
    baselines = [a.label for a in cell.arms if a.role == BASELINE]
    best = max(baselines, key=lambda b: figures[b].get("steps_per_min") or 0.0)
    mine, theirs = figures[candidate], figures[best]
    steps = _ratio(mine.get("steps_per_min"), theirs.get("steps_per_min"))
    p99 = _ratio(mine.get("program_time_p99_s"), theirs.get("program_time_p99_s"))
    passed = (
        steps is not None
        and p99 is not None
        and steps >= MIN_STEPS_RATIO
        and p99 <= MAX_P99_RATIO
        and not mine.get("errors")
    )
    bound = next((a.label for a in cell.arms if a.role == BOUND), None)
    bound_ratio = None
    if bound is not None:
        bound_ratio = _ratio(mine.get("steps_per_min"), figures[bound].get("steps_per_min"))
    if not cell.config.interactive:
        return Verdict(candidate, best, steps, p99, passed, bound_ratio)
    # Interactive programs: the class's promise, on top of the cell's rule.
    limit = cell.config.settings(_proxy_target(cell)).policy.interactive_max_wait_s
    ttft = _ratio(
        mine.get("interactive_ttft_later_p99_s"), theirs.get("interactive_ttft_later_p99_s")
    )
    held = mine.get("interactive_wait_max_s")
    kept = (
        ttft is not None
        and ttft <= MAX_INTERACTIVE_TTFT_RATIO
        and held is not None
        and float(held) <= limit + 1e-6
    )
    return Verdict(candidate, best, steps, p99, passed and kept, bound_ratio, ttft, held, limit)


def _proxy_target(cell: Cell) -> str:
    return next(a.target for a in cell.arms if a.role == CANDIDATE)


def longest_wait(summary: Mapping[str, Any]) -> float | None:
    """The longest any call waited in the proxy (None: a target without a proxy)."""
    waits = [summary.get("wait_admission_max_s"), summary.get("wait_mid_max_s")]
    known = [float(w) for w in waits if w is not None]
    if known:
        return max(known)
    return None if summary.get("pause_time_total_s") is None else 0.0


#: The table's columns: header, figure (or a function of the figures), format.
COLUMNS: tuple[tuple[str, Callable[[Mapping[str, Any]], Any], str], ...] = (
    ("steps/min", lambda s: s.get("steps_per_min"), "{:.1f}"),
    ("mean program (s)", lambda s: s.get("program_time_mean_s"), "{:,.0f}"),
    ("p99 program (s)", lambda s: s.get("program_time_p99_s"), "{:,.0f}"),
    ("later TTFT p99 (s)", lambda s: s.get("ttft_later_p99_s"), "{:.1f}"),
    ("longest wait (s)", longest_wait, "{:.1f}"),
)


def rows(results: Sequence[CellResult]) -> list[list[str]]:
    """One row per arm: cell, target, the figures of :data:`COLUMNS`, the verdict."""
    out = [["cell", "target", *(c[0] for c in COLUMNS), "verdict"]]
    for result in results:
        judged = result.verdict
        for arm in result.cell.arms:
            summary = result.figures.get(arm.label)
            cells = []
            for _, get, spec in COLUMNS:
                value = None if summary is None else get(summary)
                cells.append("-" if value is None else spec.format(value))
            note = ""
            if judged is not None and arm.role == CANDIDATE:
                note = judged.line()
            elif arm.role == BOUND:
                note = "reference: no pausing policy passes it"
            out.append([result.cell.name, arm.label, *cells, note])
            if summary is not None and result.cell.config.interactive:
                out += _class_rows(result.cell.name, arm.label, summary)
    return out


def _class_rows(cell: str, label: str, summary: Mapping[str, Any]) -> list[list[str]]:
    """An arm's later calls' TTFT p99 and longest wait per latency class, where the cell's
    programs are of more than one (the other columns are the whole arm's, above)."""
    out = []
    for name in ("interactive", "batch"):
        ttft = summary.get(f"{name}_ttft_later_p99_s")
        held = summary.get(f"{name}_wait_max_s")
        cells = ["-"] * len(COLUMNS)
        cells[3] = "-" if ttft is None else f"{ttft:.1f}"
        cells[4] = "-" if held is None else f"{held:.1f}"
        out.append([cell, f"{label}, {name}", *cells, ""])
    return out


def text_table(results: Sequence[CellResult]) -> str:
    table = rows(results)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
    lines = []
    for n, row in enumerate(table):
        left = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        right = [c.rjust(w) for c, w in zip(row[2:-1], widths[2:], strict=True)]
        lines.append("  ".join([*left, *right, row[-1]]).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(results: Sequence[CellResult]) -> str:
    table = rows(results)
    head = "| " + " | ".join(table[0]) + " |"
    rule = "| --- | --- |" + " ---: |" * len(COLUMNS) + " --- |"
    body = ["| " + " | ".join(r) + " |" for r in table[1:]]
    return "\n".join([head, rule, *body])


def summary_line(results: Sequence[CellResult]) -> str:
    verdicts = [r.verdict for r in results if r.verdict is not None]
    passed = sum(1 for v in verdicts if v.passed)
    return (
        f"{passed} of {len(verdicts)} cells pass: the candidate at least {MIN_STEPS_RATIO}x the "
        f"best baseline's steps/min and at most {MAX_P99_RATIO}x its p99 program time "
        "(times in simulated seconds)"
    )


def to_json(
    name: str, results: Sequence[CellResult], *, version: str, complete: bool = True
) -> dict[str, Any]:
    cells = []
    for result in results:
        judged = result.verdict
        cells.append(
            {
                "name": result.cell.name,
                "title": result.cell.title,
                "arms": [
                    {"label": a.label, "target": a.target, "role": a.role} for a in result.cell.arms
                ],
                "commands": result.commands,
                "results": result.figures,
                "verdict": None if judged is None else dataclasses.asdict(judged),
            }
        )
    return {
        "suite": name,
        "version": version,
        "complete": complete,
        "clock": "virtual",
        "rule": {"min_steps_ratio": MIN_STEPS_RATIO, "max_p99_ratio": MAX_P99_RATIO},
        "cells": cells,
    }
