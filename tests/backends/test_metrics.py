"""Reading vLLM 0.8-0.33 and SGLang metrics: names, units and engines as the contract lists."""

from __future__ import annotations

import pytest

from thunderproxy.backends.metrics import interpret, parse_prometheus

CURRENT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 37.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.9412
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 5.5310021e+07
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7953327885375e+09
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 4.1187328e+07
vllm:num_preemptions_total{engine="0",model_name="m"} 212.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",\
engine="0",gpu_memory_utilization="0.92",kv_cache_size_tokens="447232",num_cpu_blocks="None",\
num_gpu_blocks="27952",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",\
sliding_window="None"} 1.0
"""

OLD_08 = """\
vllm:num_requests_running{model_name="m"} 2.0
vllm:num_requests_waiting{model_name="m"} 0.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
vllm:gpu_prefix_cache_queries_total{model_name="m"} 100.0
vllm:gpu_prefix_cache_hits_total{model_name="m"} 25.0
vllm:num_preemptions_total{model_name="m"} 0.0
vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0
"""

DATA_PARALLEL = """\
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
vllm:num_preemptions_total{engine="1",model_name="m"} 2.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="3000"} 1.0
"""

SGLANG = """\
sglang:max_total_num_tokens{model_name="m",tp_rank="0",pp_rank="0"} 500000.0
sglang:max_total_num_tokens{model_name="m",tp_rank="1",pp_rank="0"} 500000.0
sglang:token_usage{model_name="m",tp_rank="0",pp_rank="0"} 0.3
sglang:num_running_reqs{model_name="m",tp_rank="0",pp_rank="0"} 7.0
sglang:num_queue_reqs{model_name="m",tp_rank="0",pp_rank="0"} 1.0
sglang:kv_evictable_tokens{model_name="m",tp_rank="0",pp_rank="0"} 120000.0
sglang:num_retracted_requests_total{model_name="m",tp_rank="0",pp_rank="0"} 3.0
sglang:page_size{model_name="m",tp_rank="0",pp_rank="0"} 1.0
"""


def test_current_vllm_prefers_kv_cache_size_tokens() -> None:
    snap = interpret(CURRENT)
    assert snap is not None
    assert snap.flavour == "vllm"
    assert snap.capacity_tokens == 447_232
    assert snap.block_size == 16
    assert snap.kv_usage == pytest.approx(0.9412)
    assert snap.running == 37
    assert snap.waiting == 4
    assert snap.prefix_hit_rate == pytest.approx(4.1187328e07 / 5.5310021e07)
    assert snap.preemptions_total == 212


def test_kv_cache_size_tokens_wins_over_blocks_times_size() -> None:
    text = CURRENT.replace('kv_cache_size_tokens="447232"', 'kv_cache_size_tokens="400000"')
    snap = interpret(text)
    assert snap is not None
    assert snap.capacity_tokens == 400_000


def test_vllm_08_names_and_block_counted_prefix_counters() -> None:
    snap = interpret(OLD_08)
    assert snap is not None
    assert snap.capacity_tokens == 16_000
    assert snap.kv_usage == 0.5
    assert snap.prefix_queries_total == 1_600  # blocks converted to tokens
    assert snap.prefix_hits_total == 400


def test_data_parallel_engines_are_summed() -> None:
    snap = interpret(DATA_PARALLEL)
    assert snap is not None
    assert snap.engines == 2
    assert snap.capacity_tokens == 64_000
    assert snap.running == 8
    assert snap.preemptions_total == 3
    # usage weighted by each engine's capacity: (0.2*16000 + 0.6*48000) / 64000
    assert snap.kv_usage == pytest.approx(0.5)


def test_sglang_counts_each_engine_once_across_tensor_ranks() -> None:
    snap = interpret(SGLANG)
    assert snap is not None
    assert snap.flavour == "sglang"
    assert snap.capacity_tokens == 500_000
    assert snap.kv_usage == 0.3
    assert snap.evictable_tokens == 120_000
    assert snap.preemptions_total == 3


def test_missing_capacity_is_none_not_zero() -> None:
    snap = interpret('vllm:num_requests_running{engine="0"} 1.0\n')
    assert snap is not None
    assert snap.capacity_tokens is None


def test_unknown_or_garbage_text() -> None:
    assert interpret("") is None
    assert interpret("http_requests_total 3\n") is None
    samples = parse_prometheus('x{a="q\\"uote"} 1\nbroken line here\ny 2 1700000000\n')
    assert samples["x"][0].labels == {"a": 'q"uote'}
    assert samples["y"][0].value == 2


OFFLOADING = """\
vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="100000",\
kv_cache_memory_bytes="37683200000",kv_offloading_backend="native",kv_offloading_size="70.0",\
num_cpu_blocks="None",num_gpu_blocks="6250"} 1.0
vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 5.0e+09
vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="GPU_to_CPU"} 2.0e+10
vllm:kv_offload_total_time_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 0.2
vllm:kv_offload_total_time_total{engine="0",model_name="m",transfer_type="GPU_to_CPU"} 0.8
"""


def test_the_offloading_connector_tier_and_its_copies_are_read() -> None:
    snap = interpret(OFFLOADING)
    assert snap is not None
    assert snap.kv_bytes_per_token == 376_832
    # 70 GiB at 376,832 bytes a token: the tier named by its size only.
    assert snap.cpu_capacity_tokens == int(70 * 2**30 / 376_832)
    assert dict(snap.offload_bytes) == {"CPU_to_GPU": 5e9, "GPU_to_CPU": 2e10}
    assert dict(snap.offload_seconds) == {"CPU_to_GPU": 0.2, "GPU_to_CPU": 0.8}
    # Blocks, where the tier gives them, win over the size.
    blocks = interpret(OFFLOADING.replace('num_cpu_blocks="None"', 'num_cpu_blocks="1000"'))
    assert blocks is not None
    assert blocks.cpu_capacity_tokens == 16_000


def test_no_tier_reads_as_none() -> None:
    snap = interpret(CURRENT)
    assert snap is not None
    assert snap.cpu_capacity_tokens is None
    assert snap.offload_bytes == ()
