"""The CPU a real-time run had to itself, read from /proc: the parsing is pure, so it is tested
on made-up texts; one test reads this machine's own /proc where there is one."""

from __future__ import annotations

import os
import sys

import pytest

from thunderproxy.bench.runs.machine import (
    CpuSample,
    busy_ticks,
    cpu_seconds_of,
    other_cores,
    process_cpu_seconds,
    sample,
    tree_ticks,
)


def stat(pid: int, ppid: int, utime: int, stime: int, cutime: int = 0, cstime: int = 0,
         name: str = "python") -> str:  # fmt: skip
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime...
    return (f"{pid} ({name}) S {ppid} 1 1 0 -1 4194304 10 0 0 0 {utime} {stime} {cutime} "
            f"{cstime} 20 0 1 0 100 1000 50")  # fmt: skip


def test_a_process_line_gives_its_own_cpu_seconds() -> None:
    assert cpu_seconds_of(stat(7, 1, 300, 100, 50, 50), 100) == pytest.approx(4.0)
    # A command name with spaces and parentheses does not shift the fields.
    assert cpu_seconds_of(stat(7, 1, 300, 100, name="a) (b"), 100) == pytest.approx(4.0)
    line = "4242 (python3 -m (x)) S 1 2 3 4 5 6 7 8 9 10 250 150 0 0 20 0 1 0 100"
    assert cpu_seconds_of(line, 100) == pytest.approx(4.0)


def test_the_machines_busy_time_leaves_out_idle_and_iowait() -> None:
    text = "cpu  100 5 40 9000 60 3 2 1 0 0\ncpu0 50 2 20 4500 30 1 1 0 0 0\nintr 1\n"
    assert busy_ticks(text) == 100 + 5 + 40 + 3 + 2 + 1
    with pytest.raises(ValueError):
        busy_ticks("intr 1\n")


def test_the_tree_is_the_root_and_every_descendant_with_what_they_reaped() -> None:
    stats = {
        10: stat(10, 1, 100, 10, cutime=30, cstime=5),  # the bench; it reaped a proxy
        11: stat(11, 10, 200, 20),  # the engine's API server
        12: stat(12, 11, 900, 30),  # its engine core
        20: stat(20, 1, 5000, 500),  # a test suite beside it
        21: "21 (gone",  # exited while it was read
    }
    assert tree_ticks(stats, 10) == 145 + 220 + 930
    assert tree_ticks(stats, 11) == 220 + 930
    assert tree_ticks(stats, 99) == 0


def test_other_cores_are_the_machines_time_less_the_trees_per_second() -> None:
    before = CpuSample(at=100.0, machine=10_000, tree=4_000)
    after = CpuSample(at=110.0, machine=12_500, tree=5_000)  # 25 s busy, 10 of them ours
    assert other_cores(before, after, 100) == pytest.approx(1.5)
    # Ticks counted a little apart can make the tree outrun the machine: never below 0.
    assert other_cores(before, CpuSample(110.0, 10_900, 5_000), 100) == 0.0
    assert other_cores(before, before, 100) == 0.0
    assert other_cores(None, after, 100) is None  # not measured (no /proc)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_this_machines_sample_counts_this_process_in_its_tree() -> None:
    taken = sample(5.0)
    assert taken is not None
    assert taken.at == 5.0
    own = process_cpu_seconds(os.getpid())
    assert own is not None
    # The tree holds this process (and the children it reaped), in clock ticks.
    assert taken.tree >= own * os.sysconf("SC_CLK_TCK") - 1
    assert taken.machine >= taken.tree
    nobody = sample(6.0, root=-1)  # no process has that pid: an empty tree
    assert nobody is not None
    assert nobody.tree == 0
