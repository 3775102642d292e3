"""How far the simulator agrees with a real engine on the same replay (pure).

``bench --engine ... --conformance`` runs each target on the engine (real time) and on the
simulator (virtual time, the engine's settings and the timing profile fitted to it). A figure
agrees when it is within its bound below; the verdict (tr behind default on steps per minute
by the scheduling suite's rule, or not) must be the same on both sides, since that is what a
scheduling change is judged by. With ``--repeat`` the engine's side is the mean of its runs
(tr/default the ratio of the means): one run under KV pressure is one draw of which prompts
the engine evicts, and its tr/default has moved by more than the ratio's bound between two
runs of the same replay. The simulator's virtual time repeats itself to the digit, but a
replay under pressure turns on each call's timing there too, so its side is the mean of
replays with its timing scaled a little either way (``--sim-draws``, ``config.SIM_DRAWS``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .figures import MIN_STEPS_RATIO

#: steps/min of the simulator within this fraction of the engine's.
STEPS_TOLERANCE = 0.15
#: prefix hit rates within this much of each other.
HIT_RATE_TOLERANCE = 0.05
#: preemptions within this many, or within this fraction of the engine's.
PREEMPTIONS_ABSOLUTE = 3
PREEMPTIONS_RELATIVE = 0.25
#: tr's steps/min over default's within this fraction of the engine's ratio.
RATIO_TOLERANCE = 0.10


@dataclass(frozen=True)
class Row:
    figure: str
    engine: float | None
    sim: float | None
    agrees: bool | None  # None: not measured on one side

    def cells(self) -> list[str]:
        mark = "-" if self.agrees is None else "yes" if self.agrees else "NO"
        return [self.figure, _fmt(self.engine), _fmt(self.sim), mark]


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100 or float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:.3f}" if abs(value) < 1 else f"{value:.2f}"


#: Other processes' CPU (cores) beside an engine arm past which its timings are the machine's
#: as much as the engine's: the CPU build computes on one core, and measured on the demo's
#: workload it ran at 1.00 of its profile's speed alone, 0.93 beside about two virtual
#: replays at the lowest priority and 0.83 beside three or four (``docs/SIMULATOR.md``,
#: "Replay conformance").
QUIET_CORES = 0.25


def _by_side(summaries: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Mapping[str, Any]]]:
    """Each side's figures per target; a target run several times on a side is their mean."""
    runs: dict[str, dict[str, list[Mapping[str, Any]]]] = {"engine": {}, "sim": {}}
    for summary in summaries:
        side = summary.get("side")
        if side in runs:
            runs[side].setdefault(str(summary["target"]), []).append(summary)
    return {
        side: {target: _mean(of) for target, of in targets.items()}
        for side, targets in runs.items()
    }


def _mean(summaries: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """Several runs (or draws) of one target as one summary: every numeric figure their mean,
    over the runs that measured it, the rest the first run's, and ``runs`` how many."""
    if len(summaries) == 1:
        return summaries[0]
    mean: dict[str, Any] = {**summaries[0], "runs": len(summaries)}
    for key in {key for s in summaries for key, value in s.items() if _is_number(value)}:
        values = [float(s[key]) for s in summaries if _is_number(s.get(key))]
        mean[key] = sum(values) / len(values)
    return mean


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def runs_of(summaries: Sequence[Mapping[str, Any]], side: str = "engine") -> int:
    """How many runs of each target a side averages (the fewest of any target)."""
    return min((int(s.get("runs", 1)) for s in _by_side(summaries)[side].values()), default=0)


def draws_as_means(summaries: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The summaries with each target's simulator draws (``timing_scale`` set) replaced by one,
    every numeric figure their mean, where the first of them was: the side-by-side table's
    columns."""
    draws: dict[tuple[str, Any], list[Mapping[str, Any]]] = {}
    for summary in summaries:
        if summary.get("timing_scale") is not None:
            draws.setdefault((str(summary["target"]), summary.get("concurrency")), []).append(
                summary
            )
    out: list[Mapping[str, Any]] = []
    for summary in summaries:
        key = (str(summary["target"]), summary.get("concurrency"))
        if summary.get("timing_scale") is None:
            out.append(summary)
        elif summary is draws[key][0]:
            scales = [float(d["timing_scale"]) for d in draws[key]]
            out.append({
                **_mean(draws[key]),
                "label": f"{key[0]} (sim, mean of {len(scales)}: "
                f"x{min(scales):g}-{max(scales):g})",
            })  # fmt: skip
    return out


def _num(summary: Mapping[str, Any] | None, key: str) -> float | None:
    if summary is None:
        return None
    value = summary.get(key)
    return None if value is None else float(value)


def within(engine: float | None, sim: float | None, *, relative: float = 0.0,
           absolute: float = 0.0) -> bool | None:  # fmt: skip
    """Whether ``sim`` is within ``absolute``, or ``relative`` of ``engine``, of ``engine``."""
    if engine is None or sim is None:
        return None
    return abs(sim - engine) <= max(absolute, relative * abs(engine))


def ratio(summaries: Mapping[str, Mapping[str, Any]], key: str = "steps_per_min") -> float | None:
    """tr's figure over default's on one side; None without both."""
    tr, default = _num(summaries.get("tr"), key), _num(summaries.get("default"), key)
    if tr is None or not default:
        return None
    return tr / default


def agreement(summaries: Sequence[Mapping[str, Any]]) -> list[Row]:
    """One row per compared figure, every target that ran on both sides, then tr/default."""
    sides = _by_side(summaries)
    rows: list[Row] = []
    for target in sides["engine"]:
        engine, sim = sides["engine"][target], sides["sim"].get(target)
        e, s = _num(engine, "steps_per_min"), _num(sim, "steps_per_min")
        rows.append(Row(f"{target} steps/min", e, s, within(e, s, relative=STEPS_TOLERANCE)))
        e, s = _num(engine, "prefix_hit_rate"), _num(sim, "prefix_hit_rate")
        rows.append(Row(f"{target} prefix hit rate", e, s,
                        within(e, s, absolute=HIT_RATE_TOLERANCE)))  # fmt: skip
        e, s = _num(engine, "preemptions"), _num(sim, "preemptions")
        rows.append(Row(f"{target} preemptions", e, s, within(
            e, s, absolute=PREEMPTIONS_ABSOLUTE, relative=PREEMPTIONS_RELATIVE)))  # fmt: skip
        e, s = _num(engine, "program_time_p99_s"), _num(sim, "program_time_p99_s")
        # Shown, not judged: a tail of a few programs moves with any one call's timing.
        rows.append(Row(f"{target} p99 program time (s)", e, s, None))
        other = _num(engine, "other_cpu_cores")
        if other is not None:
            # Shown, not judged: the machine beside the engine (the simulator has none).
            rows.append(Row(f"{target} other processes' CPU (cores)", other, None, None))
    e, s = ratio(sides["engine"]), ratio(sides["sim"])
    if e is not None or s is not None:
        agrees = within(e, s, relative=RATIO_TOLERANCE)
        if agrees is not None and e is not None and s is not None:
            # The same verdict: behind by the suite's rule, or not. Level (0.99 against 1.00)
            # is not two verdicts; the ratio bound above judges the margin.
            agrees = agrees and (e >= MIN_STEPS_RATIO) == (s >= MIN_STEPS_RATIO)
        rows.append(Row("tr / default steps/min", e, s, agrees))
    return rows


def agrees(rows: Sequence[Row]) -> bool:
    """Every row that both sides measured within its bound."""
    return all(row.agrees is not False for row in rows)


def agreement_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    rows = agreement(summaries)
    runs, draws = runs_of(summaries), runs_of(summaries, "sim")
    engine = f"engine (mean of {runs} runs)" if runs > 1 else "engine"
    sim = f"simulator (mean of {draws} draws)" if draws > 1 else "simulator"
    table = [["engine vs simulator", engine, sim, "agrees"]]
    table += [row.cells() for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines = []
    for n, cells in enumerate(table):
        right = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        lines.append("  ".join([cells[0].ljust(widths[0]), *right]))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    verdict = "agree" if agrees(rows) else "DISAGREE"
    busy = busy_arms(summaries)
    bounds = (
        f"bounds: steps/min within {STEPS_TOLERANCE:.0%}, hit rate within "
        f"{HIT_RATE_TOLERANCE}, preemptions within {PREEMPTIONS_ABSOLUTE} or "
        f"{PREEMPTIONS_RELATIVE:.0%}, tr/default within {RATIO_TOLERANCE:.0%} with the same "
        "verdict"
    )
    out = [*lines, "", f"engine and simulator {verdict} ({bounds})"]
    if busy:
        out.append(
            f"not a quiet machine: other processes used {busy} beside the engine, whose model "
            "computes on one core, so its timings (steps/min, tr/default) are partly the "
            f"machine's; compare runs with under {QUIET_CORES} cores of other work"
        )
    return "\n".join(out)


def busy_arms(summaries: Sequence[Mapping[str, Any]]) -> str:
    """The engine arms that had other work beside them past ``QUIET_CORES``, as "default
    0.31 cores, tr #2 1.20 cores" ("" when every arm had the machine to itself or none was
    measured)."""
    busy = []
    for summary in summaries:
        other = _num(summary, "other_cpu_cores")
        if summary.get("side") == "engine" and other is not None and other > QUIET_CORES:
            busy.append(f"{summary.get('label', summary['target'])} {other:.2f} cores")
    return ", ".join(busy)
