"""The same rate-limited load through LiteLLM's Router (rpm on one deployment, usage in Redis)
and through thunderproxy (`[limits]` rpm, `--redis`), two instances each, one simulated backend
each, side by side in the same wall-clock minute. Reports, per side: calls admitted in the one
whole minute the run covers against the limit (accuracy), and the time to answer an admitted
and a refused call (admission cost).

    python scripts/bench_litellm.py [--rpm 300] [--workers 4] [--venv .bench-litellm]

Installs litellm and redis into their own virtual environment (``--venv``) the first time;
needs redis-server on the PATH. LiteLLM runs as a library in its driver process (no HTTP hop
between the load and its Router), thunderproxy as `serve` processes behind HTTP on loopback:
thunderproxy's latencies include one more HTTP round trip.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from thunderproxy.sim import SimConfig, open_simulator

HERE = Path(__file__).resolve().parent
SERVED = "m-served"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def litellm_python(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "litellm", "redis"], check=True)
    return python


def redis_server(port: int, directory: str) -> subprocess.Popen[bytes]:
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", directory]
    process = subprocess.Popen(
        [*argv, "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL
    )
    for _ in range(500):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return process
        except OSError:
            time.sleep(0.01)
    raise SystemExit(f"redis-server did not listen on {port}")


async def thunderproxy_side(
    sim_url: str,
    rpm: int,
    redis_port: int,
    start: float,
    duration: float,
    workers: int,
    tmp: Path,
) -> list[tuple[float, bool, float]]:
    cfg = tmp / "limits.toml"
    cfg.write_text(
        f'[limits.models."{SERVED}"]\nrpm = {rpm}\n[limits.classes.default]\nratio = 1\n'
        "max_wait = 0\n"
    )
    calls: list[tuple[float, bool, float]] = []
    procs = []
    try:
        urls = []
        for i in range(2):
            argv = [sys.executable, "-m", "thunderproxy", "serve", "--config", str(cfg)]
            argv += ["--port", "0", "--backends", sim_url, "--router", "default"]
            argv += ["--redis", f"redis://127.0.0.1:{redis_port}/0", "--no-datasette"]
            argv += ["--db", str(tmp / f"tp{i}.db"), "--metrics-interval", "60"]
            process = await trio.lowlevel.open_process(
                argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL
            )
            procs.append(process)
            buffer = b""
            assert process.stderr is not None
            while b"listening on http://" not in buffer:
                chunk = await process.stderr.receive_some()
                if not chunk:
                    raise SystemExit("thunderproxy serve exited:\n" + buffer.decode())
                buffer += chunk
            line = buffer.split(b"listening on ", 1)[1].split()[0]
            urls.append(line.decode())
        await trio.sleep(max(0.0, start - time.time()))
        end = start + duration

        async def worker(client: httpx.AsyncClient, n: int) -> None:
            body = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}]}
            i = 0
            while time.time() < end:
                began, at = time.perf_counter(), time.time()
                body = {**body, "max_tokens": 4, "program_id": f"w{n}-{i}"}
                r = await client.post("/v1/chat/completions", json=body)
                calls.append((at, r.status_code == 200, time.perf_counter() - began))
                i += 1
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            for k, url in enumerate(urls):
                client = httpx.AsyncClient(base_url=url, timeout=30)
                for w in range(workers):
                    nursery.start_soon(worker, client, k * workers + w)
    finally:
        for process in procs:
            process.kill()
    return calls


async def litellm_side(
    python: Path,
    sim_url: str,
    rpm: int,
    redis_port: int,
    start: float,
    duration: float,
    workers: int,
) -> list[tuple[float, bool, float]]:
    calls: list[tuple[float, bool, float]] = []

    async def one() -> None:
        argv = [str(python), str(HERE / "litellm_driver.py"), f"{sim_url}/v1", SERVED, str(rpm)]
        argv += [str(redis_port), str(start), str(duration), str(workers)]
        done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
        if done.returncode != 0:
            raise SystemExit("litellm driver failed:\n" + done.stderr.decode()[-3000:])
        for line in done.stdout.decode().splitlines():
            if line.startswith("["):
                at, ok, seconds = json.loads(line)
                calls.append((at, ok, seconds))

    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(one)
    return calls


def report(
    name: str, calls: list[tuple[float, bool, float]], rpm: int, minute: int
) -> dict[str, Any]:
    inside = [c for c in calls if math.floor(c[0] / 60) == minute]
    admitted = [c for c in inside if c[1]]
    refused = [c for c in calls if not c[1]]
    ok = [c for c in calls if c[1]]

    def ms(values: list[float], q: float) -> float | None:
        if not values:
            return None
        values = sorted(values)
        return round(1000 * values[min(len(values) - 1, int(q * len(values)))], 2)

    return {
        "router": name,
        "attempts": len(calls),
        "attempts_in_minute": len(inside),
        "admitted_in_minute": len(admitted),
        "limit": rpm,
        "over_limit": max(0, len(admitted) - rpm),
        "of_limit_pct": round(100 * len(admitted) / rpm, 1),
        "admitted_p50_ms": ms([c[2] for c in ok], 0.5),
        "admitted_p99_ms": ms([c[2] for c in ok], 0.99),
        "refused_p50_ms": ms([c[2] for c in refused], 0.5),
        "refused_p99_ms": ms([c[2] for c in refused], 0.99),
        "refused_mean_ms": round(1000 * statistics.fmean(c[2] for c in refused), 2)
        if refused
        else None,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rpm", type=int, default=300)
    parser.add_argument("--workers", type=int, default=4, help="per instance")
    parser.add_argument("--venv", type=Path, default=Path(".bench-litellm"))
    args = parser.parse_args()
    python = litellm_python(args.venv)
    # Start 2 s before a minute and run 4 s past it: the minute between is covered whole.
    now = time.time()
    start = (math.floor(now / 60) + 1) * 60 - 2
    if start - now < 15:  # time to start four processes first
        start += 60
    minute = math.floor((start + 2) / 60)
    duration = 64.0
    config = SimConfig(served_model_name=SERVED, time_scale=0.02)
    with tempfile.TemporaryDirectory() as tmp:
        ports = free_port(), free_port()
        servers = [redis_server(p, tmp) for p in ports]
        try:
            async with open_simulator(config) as sim_a, open_simulator(config) as sim_b:
                results: dict[str, list[tuple[float, bool, float]]] = {}

                async def run_tp() -> None:
                    results["thunderproxy"] = await thunderproxy_side(
                        sim_a.url, args.rpm, ports[0], start, duration, args.workers, Path(tmp)
                    )

                async def run_ll() -> None:
                    results["litellm"] = await litellm_side(
                        python, sim_b.url, args.rpm, ports[1], start, duration, args.workers
                    )

                print(
                    f"waiting {start - time.time():.0f} s for the minute to start", file=sys.stderr
                )
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run_tp)
                    nursery.start_soon(run_ll)
            # What the proxies themselves admitted in that minute, by the time they admitted
            # each call (the client's count goes by when it sent it: a call sent just before
            # the minute ended and admitted just after counts in the minute it was sent).
            by_proxy = 0
            for i in range(2):
                conn = sqlite3.connect(Path(tmp) / f"tp{i}.db")
                by_proxy += conn.execute(
                    "select count(*) from decisions where action = 'admit' "
                    "and rule like 'admission.%' and cast(at / 60 as integer) = ?",
                    (minute,),
                ).fetchone()[0]
                conn.close()
        finally:
            for server in servers:
                server.kill()
    for name in ("litellm", "thunderproxy"):
        seen = report(name, results[name], args.rpm, minute)
        if name == "thunderproxy":
            seen["admitted_in_minute_by_proxy"] = by_proxy
        print(json.dumps(seen))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    trio.run(main)
