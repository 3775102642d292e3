"""The CPU a real-time run had to itself: what the bench's processes used, and what the rest of
the machine used beside them.

A real engine's timings are only its own on a quiet machine. vLLM's CPU build computes on one
core; another process on that core (a test suite, a second bench) slows every step of the arm it
overlaps, and the arm's figures then measure the machine as much as the router. So each real-time
arm records ``other_cpu_cores``: CPU seconds per second that processes outside the bench's own
process tree (the bench, its proxy, its engine and the engine's workers) used meanwhile.

Linux only (``/proc``); elsewhere the figure is None (not measured).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

#: Fields of ``/proc/<pid>/stat`` after the command name (``stat_fields``), counted from 0.
STATE, PPID = 0, 1
_UTIME, _STIME, _CUTIME, _CSTIME = 11, 12, 13, 14
#: ``/proc/stat``'s ``cpu`` line: user nice system idle iowait irq softirq steal (guest is
#: already inside user). Idle and iowait are the time no process ran.
_IDLE_COLUMNS = (3, 4)


def cpu_seconds_of(stat: str, ticks_per_s: int) -> float:
    """User + system CPU seconds from a /proc/<pid>/stat line (pure)."""
    fields = stat_fields(stat)
    return (int(fields[_UTIME]) + int(fields[_STIME])) / ticks_per_s


def process_cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return cpu_seconds_of(fh.read(), ticks_per_second())
    except OSError:
        return None  # not Linux, or the process is gone


def stat_fields(stat: str) -> list[str]:
    """The fields of a /proc/<pid>/stat line after the command name (pure): that name may
    hold spaces or parentheses, so they are counted from the last ")"."""
    return stat[stat.rindex(")") + 2 :].split()


def busy_ticks(proc_stat: str) -> int:
    """Clock ticks every CPU spent running anything, from ``/proc/stat``'s first line (pure)."""
    first = proc_stat.split("\n", 1)[0].split()
    if not first or first[0] != "cpu":
        raise ValueError("no aggregate 'cpu' line")
    columns = [int(v) for v in first[1:9]]
    return sum(v for i, v in enumerate(columns) if i not in _IDLE_COLUMNS)


def tree_ticks(stats: Mapping[int, str], root: int) -> int:
    """Clock ticks used by ``root`` and every descendant in ``stats`` (pid -> its stat line),
    children they already reaped included (pure)."""
    children: dict[int, list[int]] = {}
    parsed: dict[int, list[str]] = {}
    for pid, line in stats.items():
        try:
            fields = stat_fields(line)
            children.setdefault(int(fields[PPID]), []).append(pid)
        except (ValueError, IndexError):
            continue  # a process that exited while it was read
        parsed[pid] = fields
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        of = parsed.get(pid)
        if of is None:
            continue
        total += sum(int(of[i]) for i in (_UTIME, _STIME, _CUTIME, _CSTIME))
        todo.extend(children.get(pid, ()))
    return total


@dataclass(frozen=True)
class CpuSample:
    """The machine's busy ticks and the bench tree's ticks at one moment."""

    at: float
    machine: int
    tree: int


def other_cores(
    before: CpuSample | None, after: CpuSample | None, ticks_per_s: int | None = None
) -> float | None:
    """CPU seconds per second used outside the bench's tree between two samples (pure given
    ``ticks_per_s``; this machine's by default); None where either was not measured."""
    if before is None or after is None:
        return None
    ticks_per_s = ticks_per_second() if ticks_per_s is None else ticks_per_s
    wall = after.at - before.at
    if wall <= 0:
        return 0.0
    other = (after.machine - before.machine) - (after.tree - before.tree)
    return max(0.0, other / ticks_per_s / wall)


def read_stats(pids: Iterable[str]) -> dict[int, str]:
    """Each of ``pids``' /proc stat line (those gone meanwhile left out)."""
    stats = {}
    for name in pids:
        try:
            stats[int(name)] = Path(f"/proc/{name}/stat").read_text(errors="replace")
        except OSError:
            continue  # gone meanwhile
    return stats


def sample(at: float, root: int | None = None) -> CpuSample | None:
    """The machine's and this process tree's CPU at ``at`` (the caller's clock, in seconds);
    None where /proc cannot be read.

    Reads every process's stat line (a few hundred files): sampled once at each end of an
    arm, not per call."""
    try:
        machine = busy_ticks(Path("/proc/stat").read_text(encoding="ascii"))
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except (OSError, ValueError):
        return None
    tree = tree_ticks(read_stats(pids), os.getpid() if root is None else root)
    return CpuSample(at, machine, tree)


def ticks_per_second() -> int:
    return os.sysconf("SC_CLK_TCK")
