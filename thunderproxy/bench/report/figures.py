"""The reported figures of one run, computed from what the agents recorded and from the
simulator's truth, pure. Keys of :data:`KEYS` are stable: scripts read them from ``--json``.

All durations are simulated seconds (real-time runs divide trio seconds by the time scale).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..agents.agent import RunLog, StepLog

#: The verdict on tr (the scheduling suite's, and whether engine and simulator agree on it):
#: at least this share of the best baseline's steps/min ...
MIN_STEPS_RATIO = 0.98
#: ... and at most this multiple of its p99 program time.
MAX_P99_RATIO = 1.02

#: Latency classes reported apart (scheduling/classes.py), where a run has more than one.
CLASSES = ("interactive", "batch")

#: The simulator truth counters summed over backends (``/_sim/state`` ``counters``).
TRUTH_COUNTERS = (
    "prefix_queries",
    "prefix_hits",
    "preemptions",
    "recomputed_prefill_tokens",
    "evictions",
    "prompt_tokens",
    "generation_tokens",
    "steps",
    "cpu_hit_tokens",
    "cpu_loads",
)

#: Every figure, in table order, with its unit and how the summary table prints it.
KEYS: tuple[tuple[str, str, str], ...] = (
    ("steps_per_min", "LLM calls completed per simulated minute (whole run)", "{:.1f}"),
    ("steps_per_min_busy", "the same, until the first agent found no program left", "{:.1f}"),
    ("programs_completed", "programs whose every call succeeded", "{:d}"),
    ("programs_total", "programs in the workload", "{:d}"),
    ("steps_completed", "calls that succeeded", "{:d}"),
    ("output_tokens_per_s", "decoded tokens per simulated second", "{:.0f}"),
    ("prefix_hit_rate", "prefix hits (GPU and CPU tier) / queried prompt tokens (truth)", "{:.3f}"),
    ("prefill_tokens", "prompt tokens computed on first schedule (queries - hits)", "{:,d}"),
    ("cpu_hit_tokens", "prompt tokens first schedules loaded from the CPU tier (truth)", "{:,d}"),
    ("cpu_loads", "blocks loaded from the CPU tier, reloads after preemption included", "{:,d}"),
    ("evicted_prefix_tokens", "tokens a call could have hit (its own history) but missed", "{:,d}"),
    ("recomputed_prefill_tokens", "tokens computed again after preemption (truth)", "{:,d}"),
    ("preemptions", "engine preemptions (truth)", "{:,d}"),
    ("evictions", "cached blocks reused for other tokens (truth)", "{:,d}"),
    ("step_latency_p50_s", "call latency, send to last token, median", "{:.2f}"),
    ("step_latency_p99_s", "call latency, 99th percentile", "{:.2f}"),
    ("ttft_p50_s", "time to first token, median", "{:.2f}"),
    ("ttft_p99_s", "time to first token, 99th percentile", "{:.2f}"),
    ("ttft_first_p99_s", "time to first token of programs' first calls, p99", "{:.2f}"),
    ("ttft_later_p99_s", "time to first token of calls after a program's first, p99", "{:.2f}"),
    ("program_time_mean_s", "program completion time (arrival to last token), mean", "{:.0f}"),
    ("program_time_p50_s", "program completion time, median", "{:.0f}"),
    ("program_time_p99_s", "program completion time, 99th percentile", "{:.0f}"),
    ("pause_time_total_s", "time calls waited in the proxy (admission, pauses)", "{:.0f}"),
    ("pauses", "times the proxy moved a program to PAUSED", "{:,d}"),
    ("wait_admission_total_s", "time first calls waited in the proxy (admission)", "{:.0f}"),
    ("wait_admission_p99_s", "a first call's wait in the proxy, 99th percentile", "{:.1f}"),
    ("wait_admission_max_s", "the longest wait of a first call in the proxy", "{:.1f}"),
    ("wait_mid_total_s", "time later calls waited in the proxy (mid-program)", "{:.0f}"),
    ("wait_mid_p99_s", "a later call's wait in the proxy, 99th percentile", "{:.1f}"),
    ("wait_mid_max_s", "the longest wait of a later call in the proxy", "{:.1f}"),
    ("interactive_ttft_later_p99_s", "interactive programs' later calls: TTFT, p99", "{:.2f}"),
    ("interactive_wait_max_s", "the longest an interactive call waited in the proxy", "{:.2f}"),
    ("batch_ttft_later_p99_s", "batch programs' later calls: TTFT, p99", "{:.2f}"),
    ("batch_wait_max_s", "the longest a batch program's call waited in the proxy", "{:.2f}"),
    ("errors", "failed call attempts", "{:d}"),
    (
        "other_cpu_cores",
        "CPU cores other processes used beside the bench meanwhile (real time)",
        "{:.2f}",
    ),
    ("duration_s", "first arrival to last token", "{:.0f}"),
)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no data."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def sum_truth(states: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Counters of several backends' ``/_sim/state`` (or ``truth.state``) added up, plus the
    worst clock lag any of them reported (a simulator that fell behind its clock)."""
    totals: dict[str, float] = dict.fromkeys(TRUTH_COUNTERS, 0)
    totals["max_lag_s"] = 0.0
    for state in states:
        counters = state.get("counters", {})
        for key in TRUTH_COUNTERS:
            totals[key] += counters.get(key, 0)
        lag = state.get("clock", {}).get("max_lag_seconds", 0.0)
        totals["max_lag_s"] = max(totals["max_lag_s"], float(lag))
    return totals


def compute(
    log: RunLog,
    truth: Mapping[str, float],
    *,
    pause_time_s: float | None,
    pauses: int | None = None,
    waits: Sequence[tuple[int, float]] | None = None,
    classes: Mapping[str, str] | None = None,
    class_waits: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, Any]:
    """The figures of one run (see :data:`KEYS`); ``pause_time_s`` in trio seconds and
    ``pauses`` (programs moved to PAUSED) are None when the target cannot say (a proxy that
    is not thunderproxy). ``waits`` are the proxy's own ``(step, seconds waited)`` per call
    (trio seconds), split into first calls (admission) and later calls (mid-program).
    ``classes`` (program -> latency class) splits later calls' TTFT by class where the run
    has more than one; ``class_waits``, the proxy's waits by the class it recorded."""
    scale = log.time_scale
    ok = [s for s in log.steps if s.ok]
    done = [p for p in log.programs if p.completed and p.finished_at is not None]
    ends = [s.finished_at for s in ok]
    start = min((p.arrived_at for p in log.programs), default=log.started_at)
    end = max(ends, default=start)
    duration = (end - start) / scale
    busy_end = log.exhausted_at if log.exhausted_at is not None else end
    busy_steps = sum(1 for t in ends if t <= busy_end)
    busy = (busy_end - start) / scale
    queries = truth.get("prefix_queries", 0)
    # A CPU-tier hit is loaded, not computed: it counts as a hit like vLLM's cached_tokens.
    cpu_hits = truth.get("cpu_hit_tokens", 0)
    hits = truth.get("prefix_hits", 0) + cpu_hits
    latencies = [(s.finished_at - s.sent_at) / scale for s in ok]
    ttfts = [(s.first_token_at - s.sent_at) / scale for s in ok if s.first_token_at is not None]
    ttft_first = [
        (s.first_token_at - s.sent_at) / scale
        for s in ok
        if s.first_token_at is not None and s.step == 1
    ]
    ttft_later = [
        (s.first_token_at - s.sent_at) / scale
        for s in ok
        if s.first_token_at is not None and s.step > 1
    ]
    split = wait_split(waits, scale)
    times = [(p.finished_at - p.arrived_at) / scale for p in done if p.finished_at is not None]
    # Whole blocks only: the engine caches full blocks and recomputes the last one.
    lost = [
        max(0, s.reusable_tokens - s.cached_tokens - 32)
        for s in ok
        if s.cached_tokens is not None and s.reusable_tokens
    ]
    # None when no call had history of its own to re-use (block prompts, one-call programs):
    # the figure does not apply there, and 0 would read as "nothing was lost".
    evicted = sum(lost) if lost else None
    completion = sum(s.completion_tokens or 0 for s in ok)
    figures: dict[str, Any] = {
        "steps_per_min": 60.0 * len(ok) / duration if duration > 0 else 0.0,
        "steps_per_min_busy": 60.0 * busy_steps / busy if busy > 0 else 0.0,
        "programs_completed": len(done),
        "programs_total": len(log.programs),
        "steps_completed": len(ok),
        "output_tokens_per_s": completion / duration if duration > 0 else 0.0,
        "prefix_hit_rate": hits / queries if queries else None,
        "prefill_tokens": int(queries - hits),
        "cpu_hit_tokens": int(cpu_hits),
        "cpu_loads": int(truth.get("cpu_loads", 0)),
        "evicted_prefix_tokens": evicted,
        "recomputed_prefill_tokens": int(truth.get("recomputed_prefill_tokens", 0)),
        "preemptions": int(truth.get("preemptions", 0)),
        "evictions": int(truth.get("evictions", 0)),
        "step_latency_p50_s": percentile(latencies, 50),
        "step_latency_p99_s": percentile(latencies, 99),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_first_p99_s": percentile(ttft_first, 99),
        "ttft_later_p99_s": percentile(ttft_later, 99),
        "program_time_mean_s": sum(times) / len(times) if times else None,
        "program_time_p50_s": percentile(times, 50),
        "program_time_p99_s": percentile(times, 99),
        "pause_time_total_s": None if pause_time_s is None else pause_time_s / scale,
        "pauses": pauses,
        **split,
        **by_class(ok, scale, classes, class_waits),
        "errors": sum(1 for s in log.steps if not s.ok),
        "duration_s": duration,
        "sim_max_lag_s": truth.get("max_lag_s", 0.0),
    }
    return figures


def by_class(
    ok: Sequence[StepLog],
    scale: float,
    classes: Mapping[str, str] | None,
    waits: Mapping[str, Sequence[float]] | None,
) -> dict[str, Any]:
    """Later calls' TTFT p99 and the longest wait in the proxy, per latency class: what an
    interactive class promises is read apart from the batch programs beside it. None where
    the run's programs are all of one class (the whole run's figures say it) or, for waits,
    where the target cannot say."""
    out: dict[str, Any] = {}
    mixed = classes is not None and len(set(classes.values())) > 1
    for name in CLASSES:
        ttfts = [
            (s.first_token_at - s.sent_at) / scale
            for s in ok
            if mixed
            and classes is not None
            and classes.get(s.program_id) == name
            and s.first_token_at is not None
            and s.step > 1
        ]
        held = None if waits is None or not mixed else waits.get(name)
        out[f"{name}_ttft_later_p99_s"] = percentile(ttfts, 99)
        out[f"{name}_wait_max_s"] = max(held) / scale if held else None
    return out


def wait_split(waits: Sequence[tuple[int, float]] | None, scale: float) -> dict[str, Any]:
    """The proxy's waits apart: a program's first call waits at admission (the program has
    not started, nothing of it is held up), a later call waits mid-program (its history is
    cached and its run is stretched by the wait). None when the target cannot say."""
    out: dict[str, Any] = {}
    for name, first in (("admission", True), ("mid", False)):
        values = None if waits is None else [w / scale for step, w in waits if (step <= 1) == first]
        out[f"wait_{name}_total_s"] = None if values is None else sum(values)
        out[f"wait_{name}_p99_s"] = None if not values else percentile(values, 99)
        out[f"wait_{name}_max_s"] = None if not values else max(values)
    return out


def fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    spec = next((f for k, _, f in KEYS if k == key), "{}")
    try:
        return spec.format(int(value) if spec.endswith("d}") else value)
    except (TypeError, ValueError):
        return str(value)


def table(results: Sequence[Mapping[str, Any]], *, keys: Sequence[str] | None = None) -> str:
    """A plain-text table, one column per result (labelled by its ``label``)."""
    keys = list(keys) if keys is not None else [k for k, _, _ in KEYS]
    labels = [str(r.get("label", r.get("target", "?"))) for r in results]
    rows = [["figure", *labels]]
    for key in keys:
        rows.append([key, *(fmt(key, r.get(key)) for r in results)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(results: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> str:
    """The same table in Markdown, for docs/BENCHMARKS.md."""
    labels = [str(r.get("label", r.get("target", "?"))) for r in results]
    out = ["| figure | " + " | ".join(labels) + " |", "| --- |" + " ---: |" * len(labels)]
    for key in keys:
        out.append(f"| `{key}` | " + " | ".join(fmt(key, r.get(key)) for r in results) + " |")
    return "\n".join(out)
