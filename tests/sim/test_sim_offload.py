"""The CPU KV tier (vLLM's native offloading connector) on the pure engine and MockClock."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from trio.testing import MockClock

from thunderproxy.backends.metrics import interpret
from thunderproxy.scheduling.tiers import Tiers
from thunderproxy.sim import Engine, SimConfig, StepOutput
from thunderproxy.sim.api.exposition import render
from thunderproxy.sim.engine.blocks import BlockPool, block_hashes
from thunderproxy.sim.engine.offload import CPUTier
from thunderproxy.sim.engine.scheduler import Scheduler, SimRequest

from .helpers import SMALL, parse_metrics, token_prompt

Start = Callable[[SimConfig], Awaitable[Engine]]
# 32-token blocks of 128 KiB/token: 4 MiB a block, 160 µs a block at 25 GB/s.
OFFLOAD = dict(SMALL, kv_offloading_tokens=400 * 32, kv_bytes_per_token=131_072)


async def run(engine: Engine, prompt: list[int], **kw: object) -> list[StepOutput]:
    kw.setdefault("max_tokens", 3)
    kw.setdefault("ignore_eos", True)
    handle = engine.submit(prompt, **kw)  # type: ignore[arg-type]
    return [out async for out in handle]


def tier(num_blocks: int) -> CPUTier:
    return CPUTier(
        num_blocks, block_size=32, bytes_per_block=1000, bandwidth_bytes_per_s=1e6, latency_s=0
    )


def test_full_blocks_are_stored_as_they_are_computed_not_on_eviction() -> None:
    cpu = tier(100)
    pool = BlockPool(100)
    sched = Scheduler(
        pool, block_size=32, max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=512,
        cpu=cpu,
    )  # fmt: skip
    req = SimRequest("a", token_prompt(0, 608), 3, 0.0, sampler=lambda: (7, "x"))
    sched.add_request(req)
    sched.complete_step(sched.schedule(0.0), 1.0)
    # The first 512-token chunk: its 16 blocks are stored while the GPU still holds them.
    assert cpu.stored == 16
    assert pool.evictions == 0
    assert cpu.bytes["GPU_to_CPU"] == 16 * 1000
    # A store lands after its transfer (16 ms at 1 MB/s); before that it is no hit.
    req.ensure_hashes(16, 32)
    assert cpu.lookup(req.block_hashes[:16], 1.0) == 0
    assert cpu.lookup(req.block_hashes[:16], 1.016) == 16
    sched.complete_step(sched.schedule(1.0), 2.0)
    assert cpu.stored == 19  # 608 // 32: the partial last block is never stored


def test_cpu_tier_evicts_least_recently_used_and_spares_blocks_being_loaded() -> None:
    cpu = tier(4)
    cpu.store([1, 2], 0.0)
    cpu.store([3, 4], 0.0)
    cpu.touch([1])  # 2 is now the oldest
    cpu.store([5], 0.0)
    assert list(cpu.blocks) == [3, 4, 1, 5]
    assert cpu.evicted == 1
    cpu.load([3], 1.0)  # referenced while its load runs
    cpu.store([6], 1.0)
    assert list(cpu.blocks) == [3, 1, 5, 6]
    cpu.load([1, 5, 6], 1.0)
    assert cpu.store([7], 1.0) == 0
    assert cpu.store_skipped == 1
    cpu.complete_load([3])
    assert cpu.store([7], 1.0) == 1
    assert 3 not in cpu.blocks


async def first_token_time(config: SimConfig, start_engine: Start) -> tuple[Engine, StepOutput]:
    """The LRU run of real vLLM: a 608-token prefix, six other prompts evict it from the GPU."""
    engine = await start_engine(config)
    target = token_prompt(0, 608)
    await run(engine, target)
    for seed in range(200, 206):
        await run(engine, token_prompt(seed, 608))
    start = engine.now()
    outs = await run(engine, target)
    assert outs[0].arrival_time == start
    return engine, outs[0]


async def test_evicted_gpu_prefix_is_loaded_from_the_cpu_tier_at_pcie_cost(
    autojump_clock: MockClock, start_engine: Start
) -> None:
    plain, miss = await first_token_time(SimConfig(**SMALL), start_engine)  # type: ignore[arg-type]
    assert miss.num_cached_tokens == 0  # the GPU alone lost it
    slow, hit = await first_token_time(SimConfig(**OFFLOAD), start_engine)  # type: ignore[arg-type]
    fast, free_hit = await first_token_time(
        SimConfig(**OFFLOAD, kv_offload_bandwidth_gbps=1e12, kv_offload_latency_us=0),  # type: ignore[arg-type]
        start_engine,
    )
    assert hit.num_cached_tokens == free_hit.num_cached_tokens == 576
    assert slow.cpu is not None
    assert slow.cpu.loaded == 18
    # Loaded, not recomputed: only the last 32 tokens are prefilled.
    assert slow.trace[-3][3][0][1:3] == (32, 576)
    # The transfer delays the prefill by exactly latency + bytes / bandwidth.
    transfer = 20e-6 + 18 * 32 * 131_072 / 25e9
    ttft = hit.time - hit.arrival_time
    assert ttft - (free_hit.time - free_hit.arrival_time) == pytest.approx(transfer, rel=1e-6)
    assert ttft < miss.time - miss.arrival_time  # and it beats recomputing 608 tokens
    stats = slow.scheduler.stats
    assert stats.external_hits == 576
    assert stats.prompt_tokens_external == 576


async def test_a_load_overlaps_with_other_requests_steps(
    autojump_clock: MockClock, start_engine: Start
) -> None:
    # A slow bus (1 GB/s: 75 ms for the 18 blocks) while another request decodes.
    config = SimConfig(**OFFLOAD, kv_offload_bandwidth_gbps=1.0)  # type: ignore[arg-type]
    engine, _ = await first_token_time(config, start_engine)
    target = token_prompt(0, 608)
    for seed in range(300, 306):
        await run(engine, token_prompt(seed, 608))
    other = engine.submit(token_prompt(400, 40), max_tokens=200, ignore_eos=True)
    loaded = engine.submit(target, max_tokens=1, ignore_eos=True)
    outs = [o async for o in loaded]
    decoded = len(other.drain())
    assert outs[-1].num_cached_tokens == 576
    assert outs[-1].time - outs[-1].arrival_time > 0.075
    assert decoded > 5  # the other request kept stepping while the bytes moved


async def test_metrics_and_truth_report_the_tier(
    autojump_clock: MockClock, start_engine: Start
) -> None:
    engine, _ = await first_token_time(SimConfig(**OFFLOAD), start_engine)  # type: ignore[arg-type]
    fams = parse_metrics(render(engine))
    base = {"engine": "0", "model_name": engine.config.served_model_name}
    assert fams["vllm:external_prefix_cache_hits_total"].value(**base) == 576
    assert fams["vllm:external_prefix_cache_queries_total"].value(**base) == 8 * 608
    by_source = fams["vllm:prompt_tokens_by_source_total"]
    assert by_source.value(source="external_kv_transfer", **base) == 576
    loaded = fams["vllm:kv_offload_total_bytes_total"]
    assert loaded.type == "counter"
    assert loaded.value(transfer_type="CPU_to_GPU", **base) == 18 * 32 * 131_072
    assert fams["vllm:kv_offload_total_time_total"].type == "counter"
    assert fams["vllm:kv_offload_size"].type == "histogram"
    info = fams["vllm:cache_config_info"].samples[0][1]
    assert info["num_cpu_blocks"] == "400"
    assert info["kv_offloading_backend"] == "native"
    assert fams["thundersim:cpu_tier_loads_total"].value(**base) == 18
    # The GPU's own prefix counters leave the tier's tokens out.
    assert fams["vllm:prefix_cache_hits_total"].value(**base) == 0


async def test_a_tier_of_size_zero_is_no_tier(
    autojump_clock: MockClock, start_engine: Start
) -> None:
    engine, hit = await first_token_time(
        SimConfig(**dict(SMALL, kv_offloading_size=0.0)),  # type: ignore[arg-type]
        start_engine,
    )
    assert engine.cpu is None
    assert hit.num_cached_tokens == 0
    text = render(engine)
    assert "kv_offload" not in text
    assert 'num_cpu_blocks="None"' in text


def test_gib_convert_to_blocks_as_vllm_does() -> None:
    # 1 GiB of Llama-3.1-8B KV (128 KiB a token) in 16-token blocks: 512 blocks.
    assert SimConfig(kv_offloading_size=1.0).resolved_num_cpu_blocks() == 512
    assert SimConfig(kv_offloading_tokens=1000).resolved_num_cpu_blocks() == 62
    assert SimConfig().resolved_num_cpu_blocks() == 0


def test_landed_loads_that_block_each_other_give_their_blocks_back() -> None:
    cpu = tier(200)
    pool = BlockPool(100)  # 99 usable blocks
    sched = Scheduler(
        pool, block_size=32, max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=8192,
        cpu=cpu,
    )  # fmt: skip
    reqs = []
    for seed in (1, 2):
        prompt = token_prompt(seed, 70 * 32 + 1)
        cpu.store(block_hashes(prompt[: 40 * 32], 32), 0.0)  # 40 blocks in the tier
        req = SimRequest(f"r{seed}", prompt, 1, 0.0, sampler=lambda: (7, "x"))
        sched.add_request(req)
        reqs.append(req)
    plan = sched.schedule(1.0)  # both start loads, 80 blocks held
    assert plan.scheduled == []
    assert sched.next_load_ready() == pytest.approx(1.040)
    # Landed, but each needs 31 more blocks and 19 are free: nobody can start.
    assert sched.schedule(2.0).scheduled == []
    assert sched.next_load_ready() is None
    assert sched.release_landed()
    plan = sched.schedule(2.0)
    # The loaded blocks stayed cached: the first request finds them on the GPU now.
    assert [s.request for s in plan.scheduled] == [reqs[0]]
    assert plan.scheduled[0].start == 40 * 32


async def test_sglang_reports_tier_hits_as_host_cache(
    autojump_clock: MockClock, start_engine: Start
) -> None:
    config = SimConfig(**OFFLOAD, personality="sglang")  # type: ignore[arg-type]
    engine, hit = await first_token_time(config, start_engine)
    assert hit.num_cached_tokens == 576
    cached = parse_metrics(render(engine))["sglang:cached_tokens_total"]
    assert cached.value(cache_source="host") == 576
    assert cached.value(cache_source="device") == 0


async def test_the_proxy_reads_the_tier_and_its_link_from_the_metrics(
    autojump_clock: MockClock, start_engine: Start
) -> None:
    # What tr learns (scheduling/tiers.py) from what the simulator exports as vLLM does.
    engine, _ = await first_token_time(SimConfig(**OFFLOAD), start_engine)  # type: ignore[arg-type]
    snap = interpret(render(engine))
    assert snap is not None
    assert snap.cpu_capacity_tokens == 400 * 32
    assert snap.kv_bytes_per_token == 131_072
    assert dict(snap.offload_bytes)["CPU_to_GPU"] == 18 * 32 * 131_072
    tiers = Tiers().observe(snap, at=1.0)
    assert tiers.cpu_tokens == 12_800
    # Bytes over seconds of every copy, the 20 µs per transfer included: a little under 25 GB/s.
    assert tiers.bandwidth is not None
    assert 20e9 < tiers.bandwidth < 25e9
    assert tiers.reload_s_per_token == pytest.approx(131_072 / tiers.bandwidth)
