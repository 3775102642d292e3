"""Worker mode under agent load: what the load reports say as KV demand passes capacity.

Runs, in one process, a simulated vLLM (faster than real time), thunderproxy as a serverless
worker (unsecured, ``tr``) reporting to a local report sink, and SWE-agent programs arriving
one after another through it, on a KV cache about half of what they need together. Each report
the sink accepts is printed as one row: the programs running, acting and paused, KV demand over
capacity, how long waiting calls have waited, and the workload figures the autoscaler gets.

    python -m thunderproxy.bench.studies.worker_signals [--programs 24] [--rate 0.25]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from ...config import load_settings
from ...runtime import RunningProxy, run
from ...sim import serve_simulator
from ...sim.api.asgi import lifespan, read_whole
from ..agents.agent import Agents, Schedule
from ..agents.transport import HttpTransport
from ..config import DEFAULT_PROFILE, TIME_SETTINGS, BenchConfig
from ..runs.demo import demo_kv_tokens
from ..runs.harness import workload_for

HEADER = (
    f"{'t_s':>6} {'run':>4} {'act':>4} {'paus':>4} {'demand_tok':>10} {'capacity':>9} "
    f"{'ratio':>6} {'wait_p90':>8} {'cur_load':>8} {'new_load':>8} {'cur_perf':>8}"
)


class ReportSink:
    """Accepts ``POST /worker_status/`` and prints each report as a row."""

    def __init__(self, started_at: float, time_scale: float) -> None:
        self.started_at = started_at
        self.time_scale = time_scale
        self.reports: list[dict[str, Any]] = []
        #: Reports during startup (before the agents) are kept but not printed.
        self.live = False

    def row(self, report: dict[str, Any]) -> str:
        p = report["thunderproxy"].get("programs") or {}
        t = (trio.current_time() - self.started_at) / self.time_scale
        ratio = p.get("kv_demand_ratio")
        return (
            f"{t:6.0f} {p.get('programs_running', 0):4d} {p.get('programs_acting', 0):4d} "
            f"{p.get('programs_paused', 0):4d} {p.get('kv_demand_tokens', 0):10d} "
            f"{p.get('kv_capacity_tokens') or 0:9d} "
            f"{'-' if ratio is None else f'{ratio:.2f}':>6} "
            f"{p.get('queue_wait_p90_s', 0.0) / self.time_scale:8.1f} "
            f"{report['cur_load']:8.0f} {report['new_load']:8.0f} {report['cur_perf']:8.0f}"
        )

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        body = await read_whole(receive)
        if scope["path"] == "/worker_status/":
            report = json.loads(body)
            if self.live:
                self.reports.append(report)
                print(self.row(report), flush=True)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


async def main(
    programs: int, rate: float, time_scale: float, concurrency: int
) -> list[dict[str, Any]]:
    """Run it; returns the reports the sink accepted while the agents ran."""
    bench = BenchConfig(
        trace="thunderagent",
        targets=("tr",),
        concurrency=concurrency,
        programs=programs,
        max_steps=12,
        time_scale=time_scale,
        profile=DEFAULT_PROFILE,
    )
    workload = workload_for(bench)
    kv = demo_kv_tokens(workload, concurrency)
    bench = dataclasses.replace(bench, kv_tokens=kv)
    base = load_settings()
    scaled = {name: base.value(name) * time_scale for name in TIME_SETTINGS}
    sink = ReportSink(trio.current_time(), time_scale)
    sink_config = HypercornConfig()
    sink_config.bind = ["127.0.0.1:0"]
    sink_config.accesslog = None
    with tempfile.TemporaryDirectory() as tmp:
        async with trio.open_nursery() as outer:
            sim_url: str = await outer.start(
                partial(
                    serve_simulator,
                    bench.sim_config(workload, "tr", time_scale=time_scale),
                    host="127.0.0.1",
                    port=0,
                )
            )
            sink_url = (await outer.start(partial(serve, sink, sink_config)))[0]  # type: ignore[arg-type]
            settings = load_settings(
                {
                    **scaled,
                    "port": 0,
                    "backends": sim_url,
                    "db": str(Path(tmp) / "audit.db"),
                    "report_addr": sink_url,
                    "unsecured": True,
                    "benchmark_cache": str(Path(tmp) / "bench.json"),
                    "program_tokens": int(workload.mean_context_tokens()),
                    "datasette": False,
                    "restore": False,
                    "log_level": "warning",
                }
            )
            async with trio.open_nursery() as inner:
                proxy: RunningProxy = await inner.start(partial(run, settings))
                assert proxy.worker is not None
                await proxy.worker.settled.wait()
                capacity = proxy.worker.capacity
                print(
                    f"{len(workload.programs)} SWE-agent programs arriving at {rate}/s "
                    f"(simulated), at most {concurrency} at once, on {kv:,} KV tokens; "
                    f"benchmark: {capacity.max_throughput if capacity else 0:.0f} tokens/s, "
                    f"{capacity.programs if capacity else '-'} programs of "
                    f"{settings.program_tokens:,} tokens fit; {1 / time_scale:.0f}x real time",
                    flush=True,
                )
                print(HEADER, flush=True)
                sink.started_at = trio.current_time()
                sink.live = True
                async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0)) as client:
                    transport = HttpTransport(
                        client, base_for=lambda _p: proxy.url, model=bench.model,
                        proxy_url=proxy.url,
                    )  # fmt: skip
                    schedule = Schedule(arrivals="poisson", rate=rate, concurrency=concurrency)
                    agents = Agents(workload, transport, schedule, time_scale=time_scale)
                    await agents.run()
                await trio.sleep(1.5)  # one more report after the last call
                proxy.shutdown.set()
            outer.cancel_scope.cancel()
    peak = max(
        (r["thunderproxy"]["programs"]["kv_demand_ratio"] or 0 for r in sink.reports), default=0
    )
    print(f"{len(sink.reports)} reports; peak KV demand/capacity {peak:.2f}")
    return sink.reports


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=24)
    parser.add_argument("--rate", type=float, default=0.25, help="arrivals per simulated second")
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--time-scale", type=float, default=0.1)
    args = parser.parse_args()
    trio.run(main, args.programs, args.rate, args.time_scale, args.concurrency)


if __name__ == "__main__":
    cli()
