"""Proxy overhead: what thunderproxy adds to each streamed call, direct vs through the proxy.

A trivial fast backend (``fastbackend.py``, its own process) streams a fixed number of chunks
at a fixed pace. For each concurrency, N client streams call it back to back for a while,
first directly, then through a fresh ``thunderproxy serve`` process per router. Reported per
cell: TTFT and total latency (p50/p99, wall ms), the proxy's CPU per request and per relayed
chunk (from /proc/<pid>/stat, less what the same proxy used idle just before: its pollers and
monitor), and how busy the client itself was (``resource.getrusage``):
on a small machine the client and the backend share the cores with the proxy, so a saturated
client inflates both sides alike.
"""

from __future__ import annotations

import importlib.util
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from ...config import load_settings
from ...errors import ConfigError
from ..agents.agent import BenchError
from ..report import figures
from ..runs.machine import process_cpu_seconds
from ..runs.realtime import (
    PROXY_LISTENING,
    SIM_LISTENING,
    Child,
    serve_argv,
    start_child,
    stop_child,
)
from . import requestcost
from .fastbackend import stamps

CHAT = "/v1/chat/completions"

#: The proxy's own routers, and the other relays measured beside them. ``floor`` is this
#: stack's own floor: a bare ASGI relay on Hypercorn with the proxy's HTTP/1.1 client, no
#: gateway (``relay_floor.py``); ``floor-trio`` the same relay on bare trio sockets, without
#: Hypercorn, which tells the ASGI server's share of that floor.
ROUTERS = ("default", "tr")
#: The routers with Hypercorn reading every connection (``--http-front hypercorn``), to measure
#: the HTTP front (http/front.py) against in the same run.
ON_HYPERCORN = ("default-hypercorn", "tr-hypercorn")
RELAYS = ("floor", "floor-trio", "nginx", "fastapi", "litellm")
TARGETS = (*ROUTERS, *ON_HYPERCORN, *RELAYS)
#: How to install what a relay needs, when it is missing.
INSTALL = "pip install 'thunderproxy[bench]'"
INSTALL_NGINX = "apt-get install nginx-light (or your system's nginx package)"
#: nginx says nothing when it listens; it logs its file limit once its sockets are bound.
NGINX_LISTENING = re.compile(rb"(getrlimit\(RLIMIT_NOFILE\))")
UVICORN_LISTENING = re.compile(rb"Uvicorn running on (http://\S+)")
#: LiteLLM imports for long; on a loaded machine it may take a minute to listen.
LITELLM_START_S = 180.0
#: Bound on the one stream each target gets before it is measured.
WARM_UP_S = 120.0


def parse_targets(value: str) -> tuple[str, ...]:
    """``--target`` for ``--overhead``: names from ``TARGETS`` (direct always runs)."""
    chosen = tuple(t.strip() for t in value.split(",") if t.strip() and t.strip() != "direct")
    unknown = [t for t in chosen if t not in TARGETS]
    if unknown:
        raise ConfigError(
            f"--target {','.join(unknown)} cannot be measured with --overhead; choose from "
            f"{', '.join(TARGETS)}."
        )
    return chosen or ("default",)


def missing(target: str) -> str | None:
    """Why ``target`` cannot run here (None: it can)."""
    if target == "nginx":
        return None if nginx_command() else f"not installed (nginx): {INSTALL_NGINX}"
    needs = {"fastapi": ("fastapi", "uvicorn", "httpx"), "litellm": ("litellm",)}.get(target, ())
    for module in needs:
        if importlib.util.find_spec(module) is None:
            return f"not installed ({module}): {INSTALL}"
    if target == "litellm" and not litellm_command().exists():
        return f"not installed (no {litellm_command()}): {INSTALL}"
    return None


def nginx_command() -> str | None:
    # Debian installs it in /usr/sbin, which a user's PATH may leave out.
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


def nginx_config(backend: str, port: int, scratch: Path) -> str:
    """nginx as the C floor of a relay: one process in the foreground, HTTP/1.1 kept alive
    to the backend, nothing buffered (each chunk goes out as it comes), no access log."""
    upstream = backend.removeprefix("http://").rstrip("/")
    temp = "\n".join(
        f"  {kind}_temp_path {scratch / ('nginx-' + kind)};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return (
        "daemon off;\n"
        "master_process off;\n"
        "worker_processes 1;\n"
        "error_log stderr notice;\n"
        f"pid {scratch / 'nginx.pid'};\n"
        "events { worker_connections 4096; }\n"
        "http {\n"
        "  access_log off;\n"
        f"{temp}\n"
        f"  upstream backend {{ server {upstream}; keepalive 512; }}\n"
        "  server {\n"
        f"    listen 127.0.0.1:{port};\n"
        "    location / {\n"
        "      proxy_pass http://backend;\n"
        "      proxy_http_version 1.1;\n"
        '      proxy_set_header Connection "";\n'
        "      proxy_buffering off;\n"
        "    }\n"
        "  }\n"
        "}\n"
    )


def litellm_command() -> Path:
    return Path(sys.executable).parent / "litellm"


def litellm_config(backend: str) -> str:
    """LiteLLM's proxy config: one model, ``fast``, on the fast backend; no key (loopback)."""
    return (
        "model_list:\n"
        "  - model_name: fast\n"
        "    litellm_params:\n"
        "      model: openai/fast\n"
        f"      api_base: {backend}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "general_settings:\n"
        "  dangerously_permit_weak_or_unset_master_key: true\n"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True)
class OverheadConfig:
    concurrencies: tuple[int, ...] = (1, 32, 128)
    #: thunderproxy's routers and the other relays (``TARGETS``), in the order they run.
    targets: tuple[str, ...] = ("default",)
    #: Measured seconds per cell, after ``warmup_s`` seconds that are not counted.
    seconds: float = 10.0
    warmup_s: float = 2.0
    #: Seconds the fresh proxy is left idle first, to measure (and subtract) the CPU its
    #: pollers and monitor use without traffic.
    idle_s: float = 3.0
    chunks: int = 32
    interval_ms: float = 20.0
    #: Characters of the prompt (about four per token).
    prompt_chars: int = 4_000
    #: Rounds per concurrency: each measures direct, then every target, so each target's added
    #: latency is taken against the direct cell of its own round, minutes apart at most.
    rounds: int = 1
    #: Where each router's cell leaves a cProfile dump of its measured window (None: not
    #: profiled; see ``requestcost.py``).
    profile_dir: str | None = None


@dataclass
class Cell:
    path: str  # "direct", the proxy's router or another relay
    concurrency: int
    round: int = 0
    #: Why the target was not measured (not installed, failed to start).
    skipped: str | None = None
    requests: int = 0
    chunks: int = 0
    errors: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    #: Each call's two hops (``hops_ms``): its time to first token less the backend's own wait.
    hops_ms: list[float] = field(default_factory=list)
    total_ms: list[float] = field(default_factory=list)
    window_s: float = 0.0
    proxy_cpu_s: float | None = None
    #: The proxy's CPU seconds per second with no traffic (background pollers).
    proxy_idle_cpu: float | None = None
    client_cpu_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "path": self.path,
            "skipped": self.skipped,
            "concurrency": self.concurrency,
            "round": self.round,
            "requests": self.requests,
            "chunks": self.chunks,
            "errors": self.errors,
            "requests_per_s": self.requests / self.window_s if self.window_s else 0.0,
            "ttft_p50_ms": figures.percentile(self.ttft_ms, 50),
            "ttft_p99_ms": figures.percentile(self.ttft_ms, 99),
            "hops_p50_ms": figures.percentile(self.hops_ms, 50),
            "total_p50_ms": figures.percentile(self.total_ms, 50),
            "total_p99_ms": figures.percentile(self.total_ms, 99),
            "proxy_cpu_s": self.proxy_cpu_s,
            "proxy_idle_cpu_util": self.proxy_idle_cpu,
            "proxy_cpu_per_request_us": None,
            "proxy_cpu_per_chunk_us": None,
            "proxy_cpu_util": None,
            "client_cpu_util": self.client_cpu_s / self.window_s if self.window_s else 0.0,
        }
        if self.proxy_cpu_s is not None and self.requests:
            # What the traffic cost: the window's CPU less what the idle proxy would have used.
            busy = max(0.0, self.proxy_cpu_s - (self.proxy_idle_cpu or 0.0) * self.window_s)
            out["proxy_cpu_per_request_us"] = 1e6 * busy / self.requests
            out["proxy_cpu_per_chunk_us"] = 1e6 * busy / max(1, self.chunks)
            out["proxy_cpu_util"] = self.proxy_cpu_s / self.window_s
        return out


def hops_ms(sent_ns: int, first_ns: int, line: str) -> float | None:
    """The two hops of a call's time to first token, in ms: the request's way to the backend
    and the first chunk's way back, without the backend's own wait between them (pure). None
    when the relay did not pass the backend's stamps through."""
    stamped = stamps(line)
    if stamped is None:
        return None
    read_at, sent_at = stamped
    return ((read_at - sent_ns) + (first_ns - sent_at)) / 1e6


def client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measure(
    client: httpx.AsyncClient,
    url: str,
    cell: Cell,
    config: OverheadConfig,
    *,
    proxy: Child | None,
    profiled: bool = False,
) -> Cell:
    body_text = "word " * (config.prompt_chars // 5)
    start = trio.current_time()
    measure_from = start + config.warmup_s
    stop_at = measure_from + config.seconds
    cpu_at: dict[str, float | None] = {}

    async def mark_start() -> None:
        await trio.sleep_until(measure_from)
        cpu_at["proxy"] = None if proxy is None else process_cpu_seconds(proxy.pid)
        cpu_at["client"] = client_cpu()
        if profiled and proxy is not None:
            os.kill(proxy.pid, signal.SIGUSR1)  # requestcost.record: the profile starts now

    async def stream(i: int) -> None:
        body: dict[str, Any] = {
            "model": "fast",
            "messages": [{"role": "user", "content": body_text}],
            "stream": True,
            "max_tokens": config.chunks,
        }
        if proxy is not None:
            body["extra_body"] = {"program_id": f"overhead-{i}"}
        while trio.current_time() < stop_at:
            sent = trio.current_time()
            sent_ns = time.monotonic_ns()  # the backend's clock: see fastbackend.stamps
            first: float | None = None
            hops: float | None = None
            chunks = 0
            try:
                async with client.stream("POST", url + CHAT, json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            chunks += 1
                            if first is None:
                                first = trio.current_time()
                                hops = hops_ms(sent_ns, time.monotonic_ns(), line)
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            done = trio.current_time()
            if sent < measure_from:
                continue
            if not ok or first is None:
                cell.errors += 1
                continue
            cell.requests += 1
            cell.chunks += chunks
            cell.ttft_ms.append(1000 * (first - sent))
            if hops is not None:
                cell.hops_ms.append(hops)
            cell.total_ms.append(1000 * (done - sent))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(mark_start)
        for i in range(cell.concurrency):
            nursery.start_soon(stream, i)
    end = trio.current_time()
    cell.window_s = end - measure_from
    cell.client_cpu_s = client_cpu() - (cpu_at.get("client") or 0.0)
    if proxy is not None:
        after = process_cpu_seconds(proxy.pid)
        before = cpu_at.get("proxy")
        cell.proxy_cpu_s = None if after is None or before is None else after - before
    return cell


async def warm_up(client: httpx.AsyncClient, url: str, config: OverheadConfig) -> None:
    """One whole stream before anything is measured: a relay that loads its code on the first
    call (LiteLLM does, for seconds) would otherwise spend the first cell's warm-up on it."""
    body = {"model": "fast", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with trio.fail_after(WARM_UP_S):
        async with client.stream("POST", url + CHAT, json=body) as response:
            async for _ in response.aiter_raw():
                pass
    if response.status_code != 200:
        raise BenchError(f"{url} answered the warm-up stream with {response.status_code}")


async def idle_cpu(proxy: Child, seconds: float) -> float | None:
    """The proxy's CPU use (cores) while nothing is sent to it."""
    before = process_cpu_seconds(proxy.pid)
    start = trio.current_time()
    await trio.sleep(seconds)
    after = process_cpu_seconds(proxy.pid)
    if before is None or after is None:
        return None
    return (after - before) / (trio.current_time() - start)


async def run_overhead(config: OverheadConfig) -> list[Cell]:
    cells: list[Cell] = []
    size = 2 * max(config.concurrencies) + 16
    with tempfile.TemporaryDirectory(prefix="thunderproxy-overhead-") as scratch:
        async with (
            httpx.AsyncClient(
                timeout=httpx.Timeout(60.0),
                limits=httpx.Limits(max_connections=size, max_keepalive_connections=size),
            ) as client,
            trio.open_nursery() as nursery,
        ):
            backend = await start_child(
                nursery,
                "fast backend",
                [
                    sys.executable,
                    "-m",
                    "thunderproxy.bench.relay.fastbackend",
                    "--chunks",
                    str(config.chunks),
                    "--interval-ms",
                    str(config.interval_ms),
                ],
                SIM_LISTENING,
            )
            try:
                for concurrency in config.concurrencies:
                    for round_ in range(config.rounds):
                        cells += await measure_round(
                            nursery, client, backend.url, Path(scratch), config, concurrency, round_
                        )
            finally:
                await stop_child(backend)
                nursery.cancel_scope.cancel()
    return cells


async def measure_round(
    nursery: trio.Nursery,
    client: httpx.AsyncClient,
    backend: str,
    scratch: Path,
    config: OverheadConfig,
    concurrency: int,
    round_: int,
) -> list[Cell]:
    """Direct, then each target in a fresh process of its own, at one concurrency."""
    direct = Cell("direct", concurrency, round_)
    cells = [await measure(client, backend, direct, config, proxy=None)]
    progress(f"{concurrency} streams, round {round_ + 1}/{config.rounds}: direct measured")
    for target in config.targets:
        reason = missing(target)
        if reason is not None:
            cells.append(Cell(target, concurrency, round_, skipped=reason))
            continue
        profile = None
        if config.profile_dir is not None and target not in RELAYS:
            name = f"{target}-{concurrency}" + (f"-{round_}" if config.rounds > 1 else "")
            profile = str(Path(config.profile_dir) / f"{name}.prof")
        proxy = await start_target(nursery, target, backend, scratch, concurrency, profile)
        try:
            await warm_up(client, proxy.url, config)
            idle = await idle_cpu(proxy, config.idle_s)
            cell = await measure(
                client,
                proxy.url,
                Cell(target, concurrency, round_),
                config,
                proxy=proxy,
                profiled=profile is not None,
            )
            cell.proxy_idle_cpu = idle
            cells.append(cell)
        finally:
            await stop_child(proxy)
        progress(f"{concurrency} streams, round {round_ + 1}/{config.rounds}: {target} measured")
    return cells


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def start_target(
    nursery: trio.Nursery,
    target: str,
    backend: str,
    scratch: Path,
    concurrency: int,
    profile: str | None = None,
) -> Child:
    """A fresh process of ``target`` in front of ``backend`` (a router's run under cProfile
    when ``profile`` names its dump)."""
    if target not in RELAYS:
        router, _, front = target.partition("-")
        settings = load_settings(
            host="127.0.0.1",
            port=0,
            backends=backend,
            router=router,
            http_front=front or "fast",
            db=str(scratch / f"{target}-{concurrency}.db"),
            restore=False,
        )
        argv = serve_argv(settings)
        if profile is not None:
            argv = requestcost.record_argv(profile, argv)
        return await start_child(nursery, f"thunderproxy ({target})", argv, PROXY_LISTENING)
    if target in ("floor", "floor-trio"):
        argv = [sys.executable, "-m", "thunderproxy.bench.relay.relay_floor", "--backend", backend]
        if target == "floor-trio":
            argv += ["--server", "trio"]
        return await start_child(nursery, f"{target} relay", argv, PROXY_LISTENING)
    if target == "fastapi":
        argv = [
            sys.executable,
            "-m",
            "thunderproxy.bench.relay.relay_fastapi",
            "--backend",
            backend,
        ]
        return await start_child(nursery, "fastapi relay", argv, PROXY_LISTENING)
    if target == "nginx":
        port = free_port()
        config = scratch / "nginx.conf"
        config.write_text(nginx_config(backend, port, scratch), encoding="utf-8")
        argv = [nginx_command() or "nginx", "-c", str(config), "-p", str(scratch)]
        url = f"http://127.0.0.1:{port}"
        return await start_child(nursery, "nginx relay", argv, NGINX_LISTENING, url=url)
    config = scratch / "litellm.yaml"
    config.write_text(litellm_config(backend), encoding="utf-8")
    argv = [str(litellm_command()), "--config", str(config), "--host", "127.0.0.1"]
    argv += ["--port", str(free_port())]
    # LiteLLM's imports alone can take a minute on a loaded machine.
    return await start_child(
        nursery, "litellm proxy", argv, UVICORN_LISTENING, start_timeout=LITELLM_START_S
    )


#: The latencies reported as what a target adds to direct's (``added_<key>``).
ADDED = ("ttft_p50_ms", "ttft_p99_ms", "hops_p50_ms", "total_p50_ms", "total_p99_ms")


def report(cells: list[Cell]) -> list[dict[str, Any]]:
    """One row per (target, concurrency): its figures, what it adds to direct, and its
    requests/s as a ratio to direct's and to thunderproxy's (the first router measured)."""
    direct = {(c.concurrency, c.round): c.summary() for c in cells if c.path == "direct"}
    ours: dict[tuple[int, int], dict[str, Any]] = {}
    for cell in cells:
        if cell.path in ROUTERS and cell.skipped is None:
            ours.setdefault((cell.concurrency, cell.round), cell.summary())
    rows = []
    for cell in cells:
        row = cell.summary()
        if cell.skipped is not None:
            rows.append(row)
            continue
        base = direct.get((cell.concurrency, cell.round))
        if cell.path != "direct" and base is not None:
            for key in ADDED:
                if row[key] is not None and base[key] is not None:
                    row["added_" + key] = row[key] - base[key]
            if base["requests_per_s"]:
                row["rps_vs_direct"] = row["requests_per_s"] / base["requests_per_s"]
        mine = ours.get((cell.concurrency, cell.round))
        if cell.path in RELAYS and mine is not None and mine["requests_per_s"]:
            row["rps_vs_thunderproxy"] = row["requests_per_s"] / mine["requests_per_s"]
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    columns = (
        ("path", "{}"),
        ("concurrency", "{}"),
        ("requests_per_s", "{:.1f}"),
        ("rps_vs_direct", "{:.2f}"),
        ("rps_vs_thunderproxy", "{:.2f}"),
        ("ttft_p50_ms", "{:.1f}"),
        ("ttft_p99_ms", "{:.1f}"),
        ("total_p50_ms", "{:.1f}"),
        ("total_p99_ms", "{:.1f}"),
        ("added_ttft_p50_ms", "{:+.1f}"),
        ("added_ttft_p99_ms", "{:+.1f}"),
        ("added_hops_p50_ms", "{:+.2f}"),
        ("added_total_p50_ms", "{:+.1f}"),
        ("added_total_p99_ms", "{:+.1f}"),
        ("proxy_cpu_per_request_us", "{:.0f}"),
        ("proxy_cpu_per_chunk_us", "{:.0f}"),
        ("proxy_cpu_util", "{:.2f}"),
        ("proxy_idle_cpu_util", "{:.3f}"),
        ("client_cpu_util", "{:.2f}"),
        ("errors", "{}"),
    )
    header = [name for name, _ in columns]
    measured = [row for row in rows if row.get("skipped") is None]
    body = []
    for row in measured:
        cells = []
        for name, spec in columns:
            value = row.get(name)
            cells.append("-" if value is None else spec.format(value))
        body.append(cells)
    lines = aligned(header, body)
    skipped = {row["path"]: row["skipped"] for row in rows if row.get("skipped") is not None}
    lines += [f"{path}: {reason}" for path, reason in skipped.items()]
    return "\n".join(lines)


def aligned(header: list[str], body: list[list[str]]) -> list[str]:
    """Rows of text cells as lines, each column right-aligned to its widest cell."""
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    return lines + ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in body]


#: The figures ``over_rounds`` sums up, each as its median and range over the rounds.
ACROSS_ROUNDS = (
    ("added_ttft_p50_ms", "{:+.1f}"),
    ("added_hops_p50_ms", "{:+.2f}"),
    ("proxy_cpu_per_chunk_us", "{:.0f}"),
    ("rps_vs_direct", "{:.2f}"),
)


def over_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (target, concurrency), each figure of ``ACROSS_ROUNDS`` as (median, lowest,
    highest) over the rounds it was measured in (pure)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        if row["path"] != "direct" and row.get("skipped") is None:
            groups.setdefault((row["path"], row["concurrency"]), []).append(row)
    summary = []
    for (path, concurrency), group in groups.items():
        out: dict[str, Any] = {"path": path, "concurrency": concurrency, "rounds": len(group)}
        for name, _ in ACROSS_ROUNDS:
            values = sorted(row[name] for row in group if row.get(name) is not None)
            out[name] = (statistics.median(values), values[0], values[-1]) if values else None
        summary.append(out)
    return summary


def rounds_table(summary: list[dict[str, Any]]) -> str:
    """``over_rounds`` as text: each figure as "median (lowest..highest)"."""
    header = ["path", "concurrency", "rounds", *(name for name, _ in ACROSS_ROUNDS)]
    body = []
    for row in summary:
        cells = [row["path"], str(row["concurrency"]), str(row["rounds"])]
        for name, spec in ACROSS_ROUNDS:
            value = row[name]
            if value is None:
                cells.append("-")
            else:
                mid, low, high = (spec.format(v) for v in value)
                cells.append(f"{mid} ({low}..{high})")
        body.append(cells)
    return "\n".join(aligned(header, body))


def describe_run(config: OverheadConfig) -> str:
    """What the table was measured on: the run's shape and the machine's load when it ended."""
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "-"
    return (
        f"{config.chunks} chunks {config.interval_ms:g} ms apart per stream; "
        f"{config.seconds:g} s measured per cell after {config.warmup_s:g} s warm-up; "
        f"{os.cpu_count()} CPUs, load average {load} (1, 5, 15 min) at the end; "
        f"Python {sys.version.split()[0]}"
    )


def as_json(config: OverheadConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "mode": "overhead",
        "config": asdict(config),
        "machine": describe_run(config),
        "results": rows,
        "over_rounds": over_rounds(rows),
    }
