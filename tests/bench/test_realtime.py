"""Real-time runs: simulators and proxies as processes on loopback, driven over HTTP.

Slow (tens of seconds each), so marked ``slow``: run with ``pytest -m slow tests/bench``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from tests.bench.synthetic import write_thunderagent
from tests.conftest import apt_install
from thunderproxy.bench.config import BenchConfig
from thunderproxy.bench.relay import overhead
from thunderproxy.bench.runs import machine
from thunderproxy.bench.runs.harness import run_bench

pytestmark = pytest.mark.slow

#: Figures that must agree within 10% between a virtual and a real-time run of one workload.
AGREE = ("steps_per_min", "output_tokens_per_s", "program_time_p50_s")


def test_virtual_and_real_time_runs_agree_within_ten_percent(tmp_path: Path) -> None:
    # Calls of a few hundred decoded tokens (seconds each, like the real trace's), so that the
    # milliseconds HTTP adds per call stay small next to them.
    trace = write_thunderagent(tmp_path / "calls.jsonl", programs=6, steps=5, output=(200, 400))
    base = BenchConfig(trace=str(trace), targets=("direct", "tr"), concurrency=3, kv_tokens=9_000)
    virtual = run_bench(dataclasses.replace(base, virtual=True))
    real = run_bench(dataclasses.replace(base, time_scale=0.25), db=str(tmp_path / "r.db"))
    for v, r in zip(virtual.results, real.results, strict=True):
        assert r.figures["programs_completed"] == v.figures["programs_completed"] == 6
        assert r.figures["errors"] == 0
        for key in AGREE:
            assert r.figures[key] == pytest.approx(v.figures[key], rel=0.10), (r.target, key)
    # The real tr run is an ordinary audit run of the bench's own proxy.
    tr = real.results[1]
    assert tr.proxy_run_id is not None
    assert tr.proxy_cpu_s is not None
    assert tr.proxy_cpu_s > 0
    conn = sqlite3.connect(tmp_path / "r.db")
    (steps,) = conn.execute(
        "select count(*) from steps where run_id = ?", (tr.proxy_run_id,)
    ).fetchone()
    conn.close()
    assert steps == 30


def test_a_real_time_arm_records_the_cpu_other_processes_used_beside_it(tmp_path: Path) -> None:
    # A busy loop outside the bench's process tree: started from a shell that exits at once,
    # so that it is nobody's child here (the bench's own simulators and proxies are, and are
    # not counted). It stops by itself after 60 s, and is killed at the end.
    started = subprocess.run(
        ["sh", "-c", f"{sys.executable} -c 'import time\nend = time.time() + 60\n"
         "while time.time() < end: pass' >/dev/null 2>&1 & echo $!"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    burner = int(started.stdout.strip())
    try:
        trace = write_thunderagent(tmp_path / "calls.jsonl", programs=3, steps=3)
        config = BenchConfig(trace=str(trace), targets=("default",), concurrency=3,
                             kv_tokens=9_000, time_scale=0.25)  # fmt: skip
        report = run_bench(config)
    finally:
        subprocess.run(["kill", str(burner)], check=False)
    (result,) = report.results
    other = result.figures["other_cpu_cores"]
    assert other is not None
    # The loop had a core's worth to take; on a busy machine it gets less of one.
    assert other > 0.3, other
    assert "other_cpu_cores" in report.table()  # shown, as real time measures it


def test_repeated_runs_come_in_rounds_each_target_once_a_round(tmp_path: Path) -> None:
    trace = write_thunderagent(tmp_path / "calls.jsonl", programs=2, steps=2)
    config = BenchConfig(trace=str(trace), targets=("direct", "default"), concurrency=2,
                         kv_tokens=9_000, time_scale=0.05, repeat=2)  # fmt: skip
    report = run_bench(config, db=str(tmp_path / "r.db"))
    assert [r.label for r in report.results] == ["direct #1", "default #1", "direct #2",
                                                 "default #2"]  # fmt: skip
    assert all(r.figures["programs_completed"] == 2 for r in report.results)
    conn = sqlite3.connect(tmp_path / "r.db")
    runs = conn.execute("select target, json_extract(figures, '$.run') from bench_results")
    assert runs.fetchall() == [("direct", 1), ("default", 1), ("direct", 2), ("default", 2)]
    conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_external_proxy_pointed_at_the_bench_backends(tmp_path: Path) -> None:
    backend_port, proxy_port = free_port(), free_port()
    proxy = subprocess.Popen(
        [sys.executable, "-m", "thunderproxy", "serve", "--port", str(proxy_port),
         "--backends", f"http://127.0.0.1:{backend_port}", "--metrics-interval", "0.2",
         "--db", str(tmp_path / "external.db"), "--router", "tr"],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        trace = write_thunderagent(tmp_path / "calls.jsonl", programs=3, steps=3)
        config = BenchConfig(
            trace=str(trace),
            targets=(f"http://127.0.0.1:{proxy_port}",),
            concurrency=3,
            kv_tokens=100_000,
            time_scale=0.25,
            backend_ports=(backend_port,),
        )
        report = run_bench(config)
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
    (result,) = report.results
    assert result.figures["programs_completed"] == 3
    assert result.figures["pause_time_total_s"] is None  # not ours to know
    conn = sqlite3.connect(tmp_path / "external.db")
    released = conn.execute(
        "select count(*) from transitions where to_status = 'stopped'"
    ).fetchone()
    conn.close()
    assert released == (3,)  # the bench released every program at its end


async def test_overhead_cells_measure_latency_and_proxy_cpu() -> None:
    config = overhead.OverheadConfig(
        concurrencies=(2,),
        targets=("default", "fastapi"),
        seconds=1.5,
        warmup_s=0.5,
        idle_s=0.5,
        chunks=8,
    )
    with trio.fail_after(120):
        cells = await overhead.run_overhead(config)
    rows = overhead.report(cells)
    direct, proxied, relay = rows
    assert direct["path"] == "direct"
    assert proxied["path"] == "default"
    assert relay["path"] == "fastapi"
    if relay["skipped"] is None:
        assert relay["requests"] > 0
        assert relay["rps_vs_thunderproxy"] > 0
    else:  # the bench extra is not installed here: the table says how to install it
        assert "pip install" in overhead.table(rows)
    assert direct["requests"] > 0
    assert proxied["requests"] > 0
    assert proxied["proxy_cpu_per_request_us"] > 0
    assert proxied["proxy_idle_cpu_util"] is not None
    assert "added_ttft_p50_ms" in proxied
    assert "proxy_cpu_per_chunk_us" in overhead.table(rows)


@pytest.fixture(scope="session")
def nginx_installed() -> None:
    if overhead.nginx_command() is None:
        apt_install("nginx-light")
    if overhead.nginx_command() is None:
        pytest.skip("nginx is not installed and apt-get could not install it")


async def test_overhead_rounds_measure_nginx_against_their_own_direct_cells(
    nginx_installed: None,
) -> None:
    config = overhead.OverheadConfig(
        concurrencies=(2,),
        targets=("nginx",),
        seconds=1.0,
        warmup_s=0.5,
        idle_s=0.2,
        chunks=4,
        rounds=2,
    )
    with trio.fail_after(120):
        cells = await overhead.run_overhead(config)
    rows = overhead.report(cells)
    assert [(row["path"], row["round"]) for row in rows] == [
        ("direct", 0),
        ("nginx", 0),
        ("direct", 1),
        ("nginx", 1),
    ]
    for row in rows:
        assert row["requests"] > 0
        assert row["errors"] == 0
        assert row["hops_p50_ms"] is not None  # nginx passes the backend's stamps through
    for direct, relay in (rows[0:2], rows[2:4]):
        assert relay["added_ttft_p50_ms"] == pytest.approx(
            relay["ttft_p50_ms"] - direct["ttft_p50_ms"]
        )
        assert relay["proxy_cpu_per_chunk_us"] is not None
    (summary,) = overhead.over_rounds(rows)
    assert summary["rounds"] == 2


def _children(pid: int) -> dict[int, str]:
    """The live child processes of ``pid`` and their command lines, from /proc."""
    stats = machine.read_stats(name for name in os.listdir("/proc") if name.isdigit())
    out = {}
    for child, line in stats.items():
        if int(machine.stat_fields(line)[machine.PPID]) == pid:
            try:
                out[child] = (
                    Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                )
            except OSError:
                continue  # gone meanwhile
    return out


def _alive(pid: int) -> bool:
    stat = machine.read_stats([str(pid)]).get(pid)
    return stat is not None and machine.stat_fields(stat)[machine.STATE] != "Z"


async def test_sigterm_stops_a_real_time_bench_and_every_process_it_started(
    tmp_path: Path,
) -> None:
    # Long enough that the bench is mid-run when the signal comes (calls of seconds each).
    trace = write_thunderagent(tmp_path / "calls.jsonl", programs=4, steps=20, output=(200, 400))
    bench = await trio.lowlevel.open_process(
        [sys.executable, "-m", "thunderproxy", "bench", "--trace", str(trace), "--target", "tr",
         "--concurrency", "2", "--kv-tokens", "9000", "--time-scale", "1.0",
         "--db", str(tmp_path / "r.db"), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    output = bytearray()

    async def read() -> None:
        assert bench.stdout is not None
        async for chunk in bench.stdout:
            output.extend(chunk)

    children: dict[int, str] = {}
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            with trio.fail_after(60):
                while not any(" serve " in c for c in children.values()):
                    await trio.sleep(0.2)
                    children = _children(bench.pid)
            assert any(" sim " in c for c in children.values()), children
            await trio.sleep(2.0)  # calls under way
            bench.send_signal(signal.SIGTERM)
            with trio.fail_after(60):
                await bench.wait()
    finally:
        bench.kill()
        for pid in [p for p in children if _alive(p)]:  # orphans of a failed stop
            os.kill(pid, signal.SIGKILL)
    out = output.decode()
    assert bench.returncode == 1, out
    assert "stopped by SIGTERM" in out
    assert not [pid for pid in children if _alive(pid)], children
