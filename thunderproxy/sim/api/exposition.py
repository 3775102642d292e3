"""Prometheus text for /metrics: vLLM's names per compat level, SGLang's, and thundersim's.

Written by hand rather than with prometheus_client so that the layout (one `_created`
gauge family after each counter and histogram, labels sorted, Go-style floats) matches
what vLLM 0.32 was seen to serve.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ..engine.metrics import Histogram

if TYPE_CHECKING:
    from ..engine.core import Engine

Labels = Mapping[str, str]


def fmt(value: float) -> str:
    """Go-style float text: integers print as 3.0, big values switch to an exponent."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6 and "e" not in text:
        digits = (text[:dot] + text[dot + 1 :]).rstrip("0") or "0"
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    parts = []
    for key in sorted(labels):
        value = labels[key].replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
        parts.append(f'{key}="{value}"')
    return "{" + ",".join(parts) + "}"


class Exposition:
    def __init__(self, created: float) -> None:
        self.lines: list[str] = []
        self.created = created

    def gauge(self, name: str, help: str, samples: Iterable[tuple[Labels, float]]) -> None:
        self._family(name, "gauge", help, samples)

    def counter(self, name: str, help: str, samples: Iterable[tuple[Labels, float]]) -> None:
        samples = list(samples)
        self._family(name + "_total", "counter", help, samples)
        self._family(name + "_created", "gauge", help, [(lb, self.created) for lb, _ in samples])

    def histogram(self, name: str, help: str, labels: Labels, hist: Histogram) -> None:
        out = self.lines
        out.append(f"# HELP {name} {help}")
        out.append(f"# TYPE {name} histogram")
        cumulative = hist.cumulative()
        for bound, count in zip((*hist.bounds, math.inf), cumulative, strict=True):
            out.append(f"{name}_bucket{_labels({**labels, 'le': fmt(bound)})} {fmt(count)}")
        out.append(f"{name}_count{_labels(labels)} {fmt(hist.count)}")
        out.append(f"{name}_sum{_labels(labels)} {fmt(hist.sum)}")
        self._family(name + "_created", "gauge", help, [(labels, self.created)])

    def _family(
        self, name: str, kind: str, help: str, samples: Iterable[tuple[Labels, float]]
    ) -> None:
        self.lines.append(f"# HELP {name} {help}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self.lines.append(f"{name}{_labels(labels)} {fmt(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def content_type(engine: Engine) -> str:
    cfg = engine.config
    version = "1.0.0" if cfg.compat == "current" and cfg.personality == "vllm" else "0.0.4"
    return f"text/plain; version={version}; charset=utf-8"


def render(engine: Engine) -> str:
    sglang = engine.config.personality == "sglang"
    return (render_sglang(engine) if sglang else render_vllm(engine)) + render_truth(engine)


def render_vllm(engine: Engine) -> str:
    """vLLM's /metrics at the engine's compat level: the families that version serves, under
    its names, in its order."""
    cfg = engine.config
    base = {"engine": "0", "model_name": cfg.served_model_name}
    exp = Exposition(engine.epoch)
    _vllm_state(exp, engine, base)
    _vllm_counts(exp, engine, base)
    _vllm_histograms(exp, engine, base)
    _vllm_offload(exp, engine, base)
    exp.gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              [(cache_config_labels(engine), 1)])  # fmt: skip
    return exp.text()


def _vllm_state(exp: Exposition, engine: Engine, base: Labels) -> None:
    """The queues, the sleep state, KV use and the prefix cache's counters."""
    compat = engine.config.compat
    new_names = compat != "0.8"
    old_names = compat in ("0.8", "0.9", "0.10")
    newest = compat == "current"
    sched = engine.scheduler
    stats = sched.stats
    exp.gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              [(base, len(sched.running))])  # fmt: skip
    exp.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              [(base, len(sched.waiting))])  # fmt: skip
    if newest:
        exp.gauge("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason.",
                  [({**base, "reason": "capacity"}, len(sched.waiting)),
                   ({**base, "reason": "deferred"}, 0)])  # fmt: skip
        asleep = engine.sleeping
        exp.gauge("vllm:engine_sleep_state", "Engine sleep state.",
                  [({**base, "sleep_state": "awake"}, 0 if asleep else 1),
                   ({**base, "sleep_state": "weights_offloaded"}, 1 if asleep else 0),
                   ({**base, "sleep_state": "discard_all"}, 0)])  # fmt: skip
    usage = engine.pool.usage()
    if old_names:
        exp.gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.",
                  [(base, usage)])  # fmt: skip
    if new_names:
        exp.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                  [(base, usage)])  # fmt: skip
        exp.counter("vllm:prefix_cache_queries",
                    "Prefix cache queries, in terms of number of queried tokens.",
                    [(base, stats.prefix_queries)])  # fmt: skip
        exp.counter("vllm:prefix_cache_hits",
                    "Prefix cache hits, in terms of number of cached tokens.",
                    [(base, stats.prefix_hits)])  # fmt: skip
    if old_names:
        exp.counter("vllm:gpu_prefix_cache_queries",
                    "GPU prefix cache queries, in terms of number of queried blocks.",
                    [(base, stats.prefix_queries_blocks)])  # fmt: skip
        exp.counter("vllm:gpu_prefix_cache_hits",
                    "GPU prefix cache hits, in terms of number of cached blocks.",
                    [(base, stats.prefix_hits_blocks)])  # fmt: skip
    if newest:
        exp.counter("vllm:external_prefix_cache_queries",
                    "External prefix cache queries from KV connector cross-instance cache "
                    "sharing, in terms of number of queried tokens.",
                    [(base, stats.external_queries)])  # fmt: skip
        exp.counter("vllm:external_prefix_cache_hits",
                    "External prefix cache hits from KV connector cross-instance cache "
                    "sharing, in terms of number of cached tokens.",
                    [(base, stats.external_hits)])  # fmt: skip


def _vllm_counts(exp: Exposition, engine: Engine, base: Labels) -> None:
    """Preemptions, tokens, finished requests and admission refusals."""
    cfg = engine.config
    newest = cfg.compat == "current"
    stats = engine.scheduler.stats
    rec = engine.recorder
    exp.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                [(base, stats.preemptions)])  # fmt: skip
    exp.counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                [(base, stats.prompt_tokens)])  # fmt: skip
    if newest:
        computed = stats.prompt_tokens - stats.prompt_tokens_cached
        local_hit = stats.prompt_tokens_cached - stats.prompt_tokens_external
        exp.counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                    [({**base, "source": "local_compute"}, computed),
                     ({**base, "source": "local_cache_hit"}, local_hit),
                     ({**base, "source": "external_kv_transfer"},
                      stats.prompt_tokens_external)])  # fmt: skip
        exp.counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens.",
                    [(base, stats.prompt_tokens_cached)])  # fmt: skip
    exp.counter("vllm:generation_tokens", "Number of generation tokens processed.",
                [(base, stats.generation_tokens)])  # fmt: skip
    reasons = ("stop", "length", "abort", "error", "repetition") if newest else (
        "stop", "length", "abort")  # fmt: skip
    exp.counter("vllm:request_success", "Count of successfully processed requests.",
                [({**base, "finished_reason": r}, rec.finished[r]) for r in reasons])  # fmt: skip
    if newest:
        exp.counter("vllm:admission_rejections", "Requests rejected by admission limits.",
                    [({"model_name": cfg.served_model_name, "reason": r},
                      rec.admission_rejections[r])
                     for r in ("max_num_queued_reqs", "max_num_queued_tokens")])  # fmt: skip


def _vllm_histograms(exp: Exposition, engine: Engine, base: Labels) -> None:
    """Per-request and per-step histograms: tokens, parameters, latencies, phases."""
    compat = engine.config.compat
    newest = compat == "current"
    rec = engine.recorder
    hist = exp.histogram
    hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", base,
         rec.prompt_tokens)  # fmt: skip
    hist("vllm:request_generation_tokens", "Number of generation tokens processed.", base,
         rec.generation_tokens)  # fmt: skip
    hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", base,
         rec.iteration_tokens)  # fmt: skip
    hist("vllm:request_max_num_generation_tokens",
         "Histogram of maximum number of requested generation tokens.", base,
         rec.max_num_generation_tokens)  # fmt: skip
    hist("vllm:request_params_n", "Histogram of the n request parameter.", base, rec.params_n)
    hist("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
         base, rec.params_max_tokens)  # fmt: skip
    hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
         base, rec.ttft)  # fmt: skip
    if compat != "0.8" and compat != "0.9":
        hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
             base, rec.itl)  # fmt: skip
    if not newest:
        hist("vllm:time_per_output_token_seconds",
             "Histogram of time per output token in seconds.", base, rec.itl)  # fmt: skip
    if compat in ("0.11", "current"):
        hist("vllm:request_time_per_output_token_seconds",
             "Histogram of time_per_output_token_seconds per request.", base,
             rec.request_tpot)  # fmt: skip
    for name, h, what in (
        ("e2e_request_latency", rec.e2e, "e2e request latency"),
        ("request_queue_time", rec.queue, "time spent in WAITING phase for request"),
        ("request_inference_time", rec.inference, "time spent in RUNNING phase for request"),
        ("request_prefill_time", rec.prefill, "time spent in PREFILL phase for request"),
        ("request_decode_time", rec.decode, "time spent in DECODE phase for request"),
    ):
        hist(f"vllm:{name}_seconds", f"Histogram of {what} in seconds.", base, h)
    if newest:
        hist("vllm:request_num_preemptions", "Number of preemptions per request.", base,
             rec.num_preemptions)  # fmt: skip
        hist("vllm:request_prefill_kv_computed_tokens",
             "Prompt tokens computed (not cached) per request.", base,
             rec.prefill_kv_computed)  # fmt: skip


def _vllm_offload(exp: Exposition, engine: Engine, base: Labels) -> None:
    """The native OffloadingConnector's families; they exist only with a connector."""
    cpu = engine.cpu
    if cpu is None or engine.config.compat not in ("0.11", "current"):
        return
    kinds = ("CPU_to_GPU", "GPU_to_CPU")
    exp.counter("vllm:kv_offload_total_bytes", "Number of bytes offloaded by KV connector",
                [({**base, "transfer_type": k}, cpu.bytes[k]) for k in kinds])  # fmt: skip
    exp.counter("vllm:kv_offload_total_time", "Total time measured by all KV offloading "
                "operations", [({**base, "transfer_type": k}, cpu.seconds[k])
                               for k in kinds])  # fmt: skip
    for k in kinds:
        exp.histogram("vllm:kv_offload_size", "Histogram of KV offload transfer size, in bytes.",
                      {**base, "transfer_type": k}, cpu.sizes[k])  # fmt: skip


def cache_config_labels(engine: Engine) -> dict[str, str]:
    cfg = engine.config
    blocks = engine.pool.num_blocks
    bs = engine.block_size
    labels = {
        "block_size": str(bs),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(cfg.enable_prefix_caching),
        "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
        "num_cpu_blocks": "None" if engine.cpu is None else str(engine.cpu.num_blocks),
        "num_gpu_blocks": str(blocks),
        "num_gpu_blocks_override": "None" if cfg.num_gpu_blocks is None else str(blocks),
        "prefix_caching_hash_algo": "sha256",
        "sliding_window": "None",
    }
    if cfg.compat != "0.8":
        labels["engine"] = "0"
    if engine.cpu is not None and cfg.compat in ("0.11", "current"):
        labels["kv_offloading_backend"] = "native"
        labels["kv_offloading_size"] = str(cfg.kv_offloading_size)
    if cfg.compat == "current":
        labels["kv_cache_size_tokens"] = str(blocks * bs)
        # As vLLM reports the GPU pool's bytes (what a token's KV costs to move follows).
        labels["kv_cache_memory_bytes"] = str(blocks * bs * cfg.resolved_kv_bytes_per_token())
        labels["kv_cache_max_concurrency"] = str(blocks * bs / cfg.max_model_len)
        labels["effective_attention_block_size"] = str(bs)
        labels["hash_block_size"] = "None"
        labels["user_specified_block_size"] = str(cfg.block_size is not None)
    return labels


def render_sglang(engine: Engine) -> str:
    cfg = engine.config
    base = {"engine_type": "unified", "model_name": cfg.served_model_name, "moe_ep_rank": "0",
            "pp_rank": "0", "tp_rank": "0"}  # fmt: skip
    sched = engine.scheduler
    stats = sched.stats
    rec = engine.recorder
    pool = engine.pool
    bs = engine.block_size
    total = (pool.num_blocks - 1) * bs
    evictable = pool.num_cached_free * bs
    available = pool.num_free * bs - evictable
    used = total - available - evictable
    exp = Exposition(engine.epoch)
    g = exp.gauge
    g("sglang:num_running_reqs", "The number of running requests.", [(base, len(sched.running))])
    g("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
      [(base, len(sched.waiting))])  # fmt: skip
    g("sglang:token_usage", "The token usage.", [(base, used / total if total else 0.0)])
    g("sglang:num_used_tokens", "The number of used tokens.", [(base, used)])
    g("sglang:kv_used_tokens", "KV tokens held by requests.", [(base, used)])
    g("sglang:kv_available_tokens", "KV tokens free and not cached.", [(base, available)])
    g("sglang:kv_evictable_tokens", "KV tokens cached and evictable.", [(base, evictable)])
    g("sglang:max_total_num_tokens", "Maximum total number of tokens.", [(base, total)])
    g("sglang:page_size", "Tokens per KV page.", [(base, bs)])
    g("sglang:num_pages", "Number of KV pages.", [(base, pool.num_blocks - 1)])
    g("sglang:context_len", "Context length.", [(base, cfg.max_model_len)])
    hit_rate = stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0
    g("sglang:cache_hit_rate", "The prefix cache hit rate.", [(base, hit_rate)])
    g("sglang:num_retracted_reqs", "Requests retracted and waiting to resume.",
      [(base, sum(1 for r in sched.waiting if r.num_preemptions))])  # fmt: skip
    c = exp.counter
    c("sglang:prompt_tokens", "Number of prefill tokens processed.", [(base, stats.prompt_tokens)])
    c("sglang:generation_tokens", "Number of generation tokens processed.",
      [(base, stats.generation_tokens)])  # fmt: skip
    # A CPU tier plays SGLang's HiCache host tier here.
    by_source = {"device": stats.prompt_tokens_cached - stats.prompt_tokens_external,
                 "host": stats.prompt_tokens_external, "storage": 0}  # fmt: skip
    c("sglang:cached_tokens", "Prompt tokens served from the cache.",
      [({**base, "cache_source": s}, n) for s, n in by_source.items()])  # fmt: skip
    c("sglang:num_requests", "Number of finished requests.", [(base, sum(rec.finished.values()))])
    c("sglang:num_retracted_requests", "Number of retracted requests.",
      [(base, stats.preemptions)])  # fmt: skip
    c("sglang:num_retracted_input_tokens", "Input tokens of retracted requests.",
      [(base, stats.recomputed_prefill_tokens)])  # fmt: skip
    h = exp.histogram
    h("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
      base, rec.ttft)  # fmt: skip
    h("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
      base, rec.itl)  # fmt: skip
    h("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
      base, rec.e2e)  # fmt: skip
    h("sglang:uncached_prompt_tokens_histogram", "Prompt tokens not served from the cache.",
      base, rec.uncached_prompt_tokens)  # fmt: skip
    return exp.text()


def render_truth(engine: Engine) -> str:
    """thundersim:* series: simulator-only ground truth, never present on a real server."""
    base = {"engine": "0", "model_name": engine.config.served_model_name}
    pool = engine.pool
    stats = engine.scheduler.stats
    rec = engine.recorder
    exp = Exposition(engine.epoch)
    exp.gauge("thundersim:free_blocks", "Free blocks, cached ones included.",
              [(base, pool.num_free)])  # fmt: skip
    exp.gauge("thundersim:cached_free_blocks", "Free blocks that still hold a prefix.",
              [(base, pool.num_cached_free)])  # fmt: skip
    exp.counter("thundersim:evictions", "Cached blocks reused for other tokens.",
                [(base, pool.evictions)])  # fmt: skip
    exp.gauge("thundersim:program_resident_blocks",
              "Blocks (in use or cached) holding each program's KV.",
              [({**base, "program": p}, n)
               for p, n in sorted(pool.resident_by_program.items())])  # fmt: skip
    exp.counter("thundersim:program_evictions", "Evicted cached blocks by program.",
                [({**base, "program": p}, n)
                 for p, n in sorted(pool.evictions_by_program.items())])  # fmt: skip
    exp.counter("thundersim:recomputed_prefill_tokens",
                "Tokens computed again after a preemption.",
                [(base, stats.recomputed_prefill_tokens)])  # fmt: skip
    exp.counter("thundersim:program_preemptions", "Preemptions by program.",
                [({**base, "program": p}, n)
                 for p, n in sorted(stats.preemptions_by_program.items())])  # fmt: skip
    cpu = engine.cpu
    if cpu is not None:
        exp.gauge("thundersim:cpu_tier_blocks", "Blocks held by the CPU KV tier.",
                  [(base, len(cpu))])  # fmt: skip
        for name, value, what in (
            (
                "cpu_tier_hits",
                stats.external_hits // engine.block_size,
                "Blocks first schedules found in the CPU tier.",
            ),
            ("cpu_tier_loads", cpu.loaded, "Blocks loaded from the CPU tier."),
            ("cpu_tier_stores", cpu.stored, "Blocks stored into the CPU tier."),
            ("cpu_tier_evictions", cpu.evicted, "Blocks evicted from the CPU tier."),
        ):
            exp.counter(f"thundersim:{name}", what, [(base, value)])
    exp.counter("thundersim:steps", "Engine steps run.", [(base, stats.steps)])
    exp.counter("thundersim:busy_seconds", "Simulated seconds spent in steps.",
                [(base, rec.busy_sim_seconds)])  # fmt: skip
    exp.gauge("thundersim:clock_lag_seconds", "Wall seconds the step loop is behind its clock.",
              [(base, rec.lag_seconds)])  # fmt: skip
    exp.gauge("thundersim:sim_time_seconds", "Simulated seconds since start.",
              [(base, engine.now())])  # fmt: skip
    return exp.text()
