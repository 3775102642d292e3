"""Where a refused call's time goes: one ``thunderproxy serve`` process with ``rpm = 1`` and
``--redis``, called one request at a time over HTTP on loopback, N times each:

- ``refused``: a chat call over the limit (429 from the admission stage);
- ``unknown_model``: a chat call for a model no backend serves (404 from the gateway's route,
  before admission): the same edge, body parsing and error rendering, no admission;
- ``health``: ``GET /health``: the HTTP round trip with almost no work behind it.

Prints the median and mean of each, in ms, as the client saw them. With ``--profile FILE`` the
proxy runs under cProfile and writes its profile there when it stops.

    python scripts/refusal_cost.py [--calls 1500] [--profile refusal.prof]

Needs redis-server on the PATH.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import trio

from thunderproxy.sim import SimConfig, open_simulator

SERVED = "m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1500)
    parser.add_argument("--profile", type=Path, help="run the proxy under cProfile, into FILE")
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        redis = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp]
            + ["--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )
        try:
            results = trio.run(run, Path(tmp), port, args.calls, args.profile)
        finally:
            redis.kill()
            redis.wait()
    print(json.dumps(results))


async def run(
    tmp: Path, redis_port: int, calls: int, profile: Path | None
) -> dict[str, dict[str, float | int]]:
    cfg = tmp / "limits.toml"
    cfg.write_text(
        f'[limits.models."{SERVED}"]\nrpm = 1\n[limits.classes.default]\nratio = 1\nmax_wait = 0\n'
    )
    async with open_simulator(SimConfig(served_model_name=SERVED)) as sim:
        python = [sys.executable]
        if profile is not None:
            python += ["-m", "cProfile", "-o", str(profile)]
        argv = [*python, "-m", "thunderproxy", "serve", "--config", str(cfg)]
        argv += ["--port", "0", "--backends", sim.url, "--router", "default"]
        argv += ["--redis", f"redis://127.0.0.1:{redis_port}/0", "--no-datasette"]
        argv += ["--db", str(tmp / "tp.db"), "--metrics-interval", "60"]
        process = await trio.lowlevel.open_process(argv, stderr=subprocess.PIPE)
        assert process.stderr is not None
        seen = b""
        while b"listening on http://" not in seen:
            chunk = await process.stderr.receive_some()
            if not chunk:
                raise SystemExit("thunderproxy serve exited:\n" + seen.decode())
            seen += chunk
        url = seen.split(b"listening on ", 1)[1].split()[0].decode()
        try:
            return await measure(url, calls)
        finally:
            process.send_signal(signal.SIGINT)
            await process.wait()


async def measure(url: str, calls: int) -> dict[str, dict[str, float | int]]:
    body = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    results: dict[str, dict[str, float | int]] = {}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        first = await client.post("/v1/chat/completions", json={**body, "program_id": "first"})
        assert first.status_code == 200, first.text  # the minute's one call

        def refused(i: int) -> Awaitable[httpx.Response]:
            return client.post("/v1/chat/completions", json={**body, "program_id": f"r{i}"})

        def unknown_model(i: int) -> Awaitable[httpx.Response]:
            wrong = {**body, "model": "not-served", "program_id": f"u{i}"}
            return client.post("/v1/chat/completions", json=wrong)

        def health(i: int) -> Awaitable[httpx.Response]:
            return client.get("/health")

        kinds: dict[str, Callable[[int], Awaitable[httpx.Response]]] = {
            "refused": refused,
            "unknown_model": unknown_model,
            "health": health,
        }
        for name, make in kinds.items():
            seconds = []
            status = 0
            for i in range(calls):
                began = time.perf_counter()
                status = (await make(i)).status_code
                seconds.append(time.perf_counter() - began)
            results[name] = {
                "status": status,
                "p50_ms": round(1000 * statistics.median(seconds), 3),
                "mean_ms": round(1000 * statistics.fmean(seconds), 3),
            }
    return results


if __name__ == "__main__":
    main()
