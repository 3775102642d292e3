"""Reading a backend's Prometheus ``/metrics`` (vLLM 0.8-0.33 and SGLang), pure.

Names, label sets and units moved between releases; the rules here follow the backend contract
(docs/ARCHITECTURE.md, "The backend contract", which also says what tr reads and what it does
without each reading): parse by name and ignore unknown labels, prefer the newest name and fall
back to older ones, sum data-parallel engines, and convert 0.8's block-counted prefix counters
to tokens.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

Labels = dict[str, str]

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Labels
    value: float


def parse_prometheus(text: str) -> dict[str, list[Sample]]:
    """Samples by metric name; comments, blank and malformed lines are skipped."""
    samples: dict[str, list[Sample]] = defaultdict(list)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line.strip())
        if not match:
            continue
        name, raw_labels, raw_value = match.groups()
        try:
            value = float(raw_value)
        except ValueError:
            continue
        labels = {
            k: v.replace('\\"', '"').replace("\\\\", "\\")
            for k, v in _LABEL.findall(raw_labels or "")
        }
        samples[name].append(Sample(name, labels, value))
    return samples


@dataclass(frozen=True)
class EngineSnapshot:
    """What one poll of a backend says about its KV cache and load (sums over DP engines)."""

    flavour: str  # "vllm" or "sglang"
    engines: int
    capacity_tokens: int | None
    block_size: int | None
    num_gpu_blocks: int | None
    kv_usage: float | None
    running: float | None
    waiting: float | None
    prefix_queries_total: float | None
    prefix_hits_total: float | None
    preemptions_total: float | None
    #: SGLang only: tokens of reusable prefix cache that could be evicted.
    evictable_tokens: float | None = None
    #: The CPU KV tier of vLLM's offloading connector (``num_cpu_blocks`` x ``block_size``);
    #: None without one.
    cpu_capacity_tokens: int | None = None
    #: KV bytes of one token (``kv_cache_memory_bytes`` / ``kv_cache_size_tokens``).
    kv_bytes_per_token: float | None = None
    #: ``vllm:kv_offload_total_{bytes,time}_total`` by ``transfer_type`` (``CPU_to_GPU``,
    #: ``GPU_to_CPU``): what the connector moved and the seconds its copies took.
    offload_bytes: tuple[tuple[str, float], ...] = ()
    offload_seconds: tuple[tuple[str, float], ...] = ()

    @property
    def prefix_hit_rate(self) -> float | None:
        if not self.prefix_queries_total or self.prefix_hits_total is None:
            return None
        return self.prefix_hits_total / self.prefix_queries_total


def _sum(samples: Iterable[Sample]) -> float | None:
    values = [s.value for s in samples if not math.isnan(s.value)]
    return sum(values) if values else None


def _first(metrics: dict[str, list[Sample]], *names: str) -> list[Sample]:
    for name in names:
        if metrics.get(name):
            return metrics[name]
    return []


def _int_label(labels: Labels, name: str) -> int | None:
    raw = labels.get(name)
    if raw is None or raw == "None":
        return None
    try:
        return int(float(raw))
    except ValueError:
        return None


def _float_label(labels: Labels, name: str) -> float | None:
    try:
        return float(labels.get(name, ""))
    except ValueError:
        return None


def _vllm(metrics: dict[str, list[Sample]]) -> EngineSnapshot:
    capacity = 0
    blocks = 0
    cpu_tokens = 0
    memory_bytes = 0
    block_size: int | None = None
    per_engine_capacity: dict[str, int] = {}
    for sample in metrics.get("vllm:cache_config_info", []):
        size = _int_label(sample.labels, "block_size")
        n_blocks = _int_label(sample.labels, "num_gpu_blocks")
        tokens = _int_label(sample.labels, "kv_cache_size_tokens")
        if tokens is None and size is not None and n_blocks is not None:
            tokens = size * n_blocks
        if tokens is None:
            continue
        per_engine_capacity[sample.labels.get("engine", str(len(per_engine_capacity)))] = tokens
        capacity += tokens
        engine_bytes = _int_label(sample.labels, "kv_cache_memory_bytes") or 0
        memory_bytes += engine_bytes
        cpu_blocks = _int_label(sample.labels, "num_cpu_blocks")
        offload_gib = _float_label(sample.labels, "kv_offloading_size")
        if cpu_blocks and size:
            cpu_tokens += cpu_blocks * size
        elif offload_gib and engine_bytes:
            # Real vLLM names the tier by its size in GiB (--kv-offloading-size) only: in tokens
            # at the GPU pool's bytes per token.
            cpu_tokens += int(offload_gib * 2**30 / (engine_bytes / tokens))
        blocks += n_blocks or 0
        block_size = size if size is not None else block_size

    usage_samples = _first(metrics, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    kv_usage: float | None = None
    if usage_samples:
        weights = [per_engine_capacity.get(s.labels.get("engine", ""), 0) for s in usage_samples]
        if all(weights):
            kv_usage = sum(s.value * w for s, w in zip(usage_samples, weights, strict=True))
            kv_usage /= sum(weights)
        else:
            kv_usage = sum(s.value for s in usage_samples) / len(usage_samples)

    queries = _sum(metrics.get("vllm:prefix_cache_queries_total", []))
    hits = _sum(metrics.get("vllm:prefix_cache_hits_total", []))
    if queries is None and block_size:
        # vLLM 0.8 counted prefix-cache queries and hits in blocks, not tokens.
        old_q = _sum(metrics.get("vllm:gpu_prefix_cache_queries_total", []))
        old_h = _sum(metrics.get("vllm:gpu_prefix_cache_hits_total", []))
        queries = None if old_q is None else old_q * block_size
        hits = None if old_h is None else old_h * block_size

    return EngineSnapshot(
        flavour="vllm",
        engines=max(1, len(per_engine_capacity)),
        capacity_tokens=capacity or None,
        block_size=block_size,
        num_gpu_blocks=blocks or None,
        kv_usage=kv_usage,
        running=_sum(metrics.get("vllm:num_requests_running", [])),
        waiting=_sum(metrics.get("vllm:num_requests_waiting", [])),
        prefix_queries_total=queries,
        prefix_hits_total=hits,
        preemptions_total=_sum(metrics.get("vllm:num_preemptions_total", [])),
        cpu_capacity_tokens=cpu_tokens or None,
        kv_bytes_per_token=memory_bytes / capacity if memory_bytes and capacity else None,
        offload_bytes=_by_transfer(metrics.get("vllm:kv_offload_total_bytes_total", [])),
        offload_seconds=_by_transfer(metrics.get("vllm:kv_offload_total_time_total", [])),
    )


def _by_transfer(samples: list[Sample]) -> tuple[tuple[str, float], ...]:
    """A connector counter summed over engines, per ``transfer_type``."""
    out: dict[str, float] = defaultdict(float)
    for s in samples:
        if not math.isnan(s.value):
            out[s.labels.get("transfer_type", "")] += s.value
    return tuple(sorted(out.items()))


def _sglang_ranks(samples: list[Sample]) -> list[Sample]:
    # Every tensor/pipeline rank repeats the same engine-level series; count each DP rank once.
    return [
        s
        for s in samples
        if s.labels.get("tp_rank", "0") == "0" and s.labels.get("pp_rank", "0") == "0"
    ]


def _sglang(metrics: dict[str, list[Sample]]) -> EngineSnapshot:
    def total(name: str) -> float | None:
        return _sum(_sglang_ranks(metrics.get(name, [])))

    capacity = total("sglang:max_total_num_tokens")
    usage = _sglang_ranks(metrics.get("sglang:token_usage", []))
    page = _sglang_ranks(metrics.get("sglang:page_size", []))
    return EngineSnapshot(
        flavour="sglang",
        engines=max(1, len(_sglang_ranks(metrics.get("sglang:max_total_num_tokens", [])))),
        capacity_tokens=None if capacity is None else int(capacity),
        block_size=int(page[0].value) if page else None,
        num_gpu_blocks=None,
        kv_usage=(sum(s.value for s in usage) / len(usage)) if usage else None,
        running=total("sglang:num_running_reqs"),
        waiting=total("sglang:num_queue_reqs"),
        prefix_queries_total=total("sglang:prompt_tokens_total"),
        prefix_hits_total=total("sglang:cached_tokens_total"),
        preemptions_total=total("sglang:num_retracted_requests_total"),
        evictable_tokens=total("sglang:kv_evictable_tokens"),
    )


def interpret(text: str) -> EngineSnapshot | None:
    """The engine snapshot in a /metrics body, or None if it is neither vLLM nor SGLang."""
    metrics = parse_prometheus(text)
    if any(name.startswith("vllm:") for name in metrics):
        return _vllm(metrics)
    if any(name.startswith("sglang:") for name in metrics):
        return _sglang(metrics)
    return None
