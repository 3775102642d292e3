"""The startup benchmark: how much workload per second the backends sustain (the report's
``max_perf``) and how many agent programs their KV cache holds, measured once and cached.

The built-in benchmark suits OpenAI-compatible servers: tokens generated per second over a few
concurrent chat completions, so the autoscaler's ``cost`` should count tokens. Anything else
brings its own ``module:function``: an async function called with the backend's URL and an
``httpx.AsyncClient`` whose base URL is that backend (pass relative paths), returning workload
per second in the units the autoscaler's ``cost`` uses. That client's transport is the backend
itself (``backends/transport.py``), so the benchmark's requests go out as the proxy's own do:
the backend's credentials, connections and errors (as httpx's).
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import trio

from ..backends.metrics import interpret
from ..errors import ConfigError
from .state import Capacity

log = logging.getLogger("thunderproxy.worker")

BenchmarkFn = Callable[[str, httpx.AsyncClient], Awaitable[float]]

#: Built-in benchmark: concurrent requests per round, rounds, tokens asked per request.
CONCURRENCY = 8
ROUNDS = 3
MAX_TOKENS = 128
PROMPT = (
    "You are benchmarking an inference server. Write a long, detailed explanation of how a "
    "compiler turns source code into machine code, step by step."
)
#: One benchmark request may take this long before the benchmark is declared failed.
REQUEST_TIMEOUT_S = 300.0


class BenchmarkError(Exception):
    """The benchmark could not measure the backend; the worker reports this and turns beacon."""


def load_benchmark(spec: str) -> BenchmarkFn:
    """The async function named ``module:function``; ConfigError naming what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--benchmark {spec!r} must be module:function, e.g. mybench:run")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--benchmark {spec!r}: cannot import {module_name}: {exc}") from exc
    fn = getattr(module, attr, None)
    if fn is None or not inspect.iscoroutinefunction(fn):
        raise ConfigError(
            f"--benchmark {spec!r}: {module_name}.{attr} is not an async function taking "
            "(backend_url, client)."
        )
    return fn  # type: ignore[no-any-return]


async def first_model(client: httpx.AsyncClient) -> str | None:
    """The first model the backend serves (/v1/models), or None if it does not say."""
    try:
        response = await client.get("/v1/models")
        models = response.json().get("data") or []
        return str(models[0]["id"]) if models else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


async def chat_tokens_per_second(
    backend_url: str,
    client: httpx.AsyncClient,
    *,
    concurrency: int = CONCURRENCY,
    rounds: int = ROUNDS,
    max_tokens: int = MAX_TOKENS,
) -> float:
    """Generated tokens per second over ``rounds`` of ``concurrency`` concurrent chat
    completions (the best round, after one warm-up request)."""
    model = await first_model(client)
    if model is None:
        raise BenchmarkError(f"{backend_url}/v1/models names no model to benchmark")
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        # A fixed length makes rounds comparable; servers that ignore it still report usage.
        "ignore_eos": True,
    }

    async def one() -> int:
        response = await client.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            raise BenchmarkError(
                f"{backend_url}/v1/chat/completions answered {response.status_code}: "
                f"{response.text[:200]}"
            )
        usage = response.json().get("usage") or {}
        return int(usage.get("completion_tokens") or 0)

    with trio.fail_after(REQUEST_TIMEOUT_S):
        await one()

    async def run_one(tokens: list[int]) -> None:
        tokens.append(await one())

    best = 0.0
    for _ in range(rounds):
        tokens: list[int] = []
        start = trio.current_time()
        with trio.fail_after(REQUEST_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(run_one, tokens)
        elapsed = trio.current_time() - start
        if elapsed > 0:
            best = max(best, sum(tokens) / elapsed)
    if best <= 0:
        raise BenchmarkError(f"{backend_url} generated no tokens during the benchmark")
    return best


async def kv_capacity_tokens(client: httpx.AsyncClient) -> int | None:
    """The backend's KV cache size in tokens, from its Prometheus /metrics (vLLM, SGLang)."""
    try:
        response = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    snapshot = interpret(response.text)
    return None if snapshot is None else snapshot.capacity_tokens


def read_cache(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable benchmark cache %s (%s); measuring again", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: str, data: dict[str, Any]) -> None:
    """Atomically, so a crash mid-write never leaves a cache that fails to parse."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    with os.fdopen(fd, "w") as out:
        json.dump(data, out, indent=2, sort_keys=True)
    os.replace(tmp, target)


def cache_key(backend_url: str, model: str | None, benchmark: str) -> str:
    return f"{backend_url} {model or '-'} {benchmark or 'builtin'}"


async def measure(
    backends: Sequence[tuple[str, httpx.AsyncClient]],
    *,
    benchmark: str,
    cache_path: str,
    program_tokens: int,
) -> Capacity:
    """Throughput and KV capacity summed over ``backends``, each taken from the cache when
    it holds that backend URL and model, else measured and added to it."""
    fn: BenchmarkFn = load_benchmark(benchmark) if benchmark else chat_tokens_per_second
    cache = await trio.to_thread.run_sync(read_cache, cache_path)
    details: list[dict[str, Any]] = []
    all_cached = True
    for url, client in backends:
        model = await first_model(client)
        key = cache_key(url, model, benchmark)
        entry = cache.get(key)
        if isinstance(entry, dict) and isinstance(entry.get("max_throughput"), int | float):
            details.append({**entry, "cached": True})
            continue
        all_cached = False
        try:
            throughput = float(await fn(url, client))
        except BenchmarkError:
            raise
        except Exception as exc:  # a user's benchmark may fail in any way; report it
            raise BenchmarkError(
                f"benchmark {benchmark or 'builtin'} failed on {url}: {type(exc).__name__}: {exc}"
            ) from exc
        if not throughput > 0:
            raise BenchmarkError(
                f"benchmark {benchmark or 'builtin'} measured {throughput!r} on {url}; "
                "it must return a positive workload per second"
            )
        entry = {
            "backend": url,
            "model": model,
            "benchmark": benchmark or "builtin",
            "max_throughput": throughput,
            "kv_capacity_tokens": await kv_capacity_tokens(client),
        }
        cache[key] = entry
        details.append({**entry, "cached": False})
    if not all_cached:
        await trio.to_thread.run_sync(write_cache, cache_path, cache)
    capacities = [d["kv_capacity_tokens"] for d in details if d.get("kv_capacity_tokens")]
    kv = sum(capacities) if capacities else None
    return Capacity(
        max_throughput=sum(float(d["max_throughput"]) for d in details),
        kv_capacity_tokens=kv,
        programs=None if kv is None or program_tokens <= 0 else kv // program_tokens,
        cached=all_cached,
        details=details,
    )
