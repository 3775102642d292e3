"""tr's gate over a CPU KV tier: the learned tiers and the capacity they give are pure values;
the scheduler applies them on trio's MockClock with a real registry, pool and audit channel."""

from __future__ import annotations

import json
from dataclasses import replace

import trio

from thunderproxy.audit import DecisionRecord
from thunderproxy.backends import EngineSnapshot
from thunderproxy.programs import ProgramStatus
from thunderproxy.scheduling.tiers import GPU, GPU_CPU, Tiers, assumed_tier, gate, spill_tokens
from thunderproxy.scheduling.tr import PolicyConfig

from .test_scheduler import B0, Harness, harness, snapshot

__all__ = ["harness"]  # the fixture, shared with the scheduler's tests

CFG = PolicyConfig()
#: GLM-4.5's KV per token; 25 GB/s is PCIe 4.0 x16's usable copy rate.
BYTES_PER_TOKEN = 376_832
PCIE4 = 25e9


def tiered(
    capacity: int,
    cpu_tokens: int | None,
    *,
    loaded_s: float = 0.0,
    stored_s: float = 1.0,
) -> EngineSnapshot:
    """A vLLM snapshot with a CPU tier whose copies moved at 25 GB/s for the given seconds."""
    seconds = (("CPU_to_GPU", loaded_s), ("GPU_to_CPU", stored_s))
    return replace(
        snapshot(capacity),
        cpu_capacity_tokens=cpu_tokens,
        kv_bytes_per_token=BYTES_PER_TOKEN,
        offload_bytes=tuple((kind, s * PCIE4) for kind, s in seconds),
        offload_seconds=seconds,
    )


def test_the_link_is_measured_from_the_connector_counters() -> None:
    tiers = Tiers().observe(tiered(100_000, 400_000, loaded_s=2.0, stored_s=6.0), at=10.0)
    assert tiers.cpu_tokens == 400_000
    assert tiers.bandwidth == PCIE4
    assert tiers.reload_s_per_token == BYTES_PER_TOKEN / PCIE4
    assert tiers.load_share == 0.0  # one reading: no interval to measure a share over yet


def test_the_load_share_is_the_growth_of_load_seconds_over_the_interval() -> None:
    tiers = Tiers().observe(tiered(100_000, 400_000, loaded_s=2.0), at=10.0)
    # 4 s of loads in a 5 s interval: the link was busy 80% of the time.
    busier = tiers.observe(tiered(100_000, 400_000, loaded_s=6.0), at=15.0)
    assert 0.2 < busier.load_share < 0.3  # moved a step of 0.3 towards 0.8
    # The same poll offered again (the monitor ticks faster than the poller) changes nothing.
    assert busier.observe(tiered(100_000, 400_000, loaded_s=9.0), at=15.0) is busier
    # An engine restart resets the counters: no share is read across it.
    restarted = busier.observe(tiered(100_000, 400_000, loaded_s=0.5), at=20.0)
    assert restarted.load_share == busier.load_share
    assert restarted.load_seconds == 0.5


def test_without_a_tier_or_a_measured_link_the_gate_is_the_gpu() -> None:
    plain = Tiers().observe(tiered(100_000, None), at=1.0)
    assert gate(100_000, plain, 1.0, CFG) == replace(gate(100_000, Tiers(), 1.0, CFG))
    assert gate(100_000, plain, 1.0, CFG).tier == GPU
    assert gate(100_000, plain, 1.0, CFG).capacity_tokens == 100_000
    unmeasured = Tiers(cpu_tokens=400_000, bytes_per_token=BYTES_PER_TOKEN)
    assert gate(100_000, unmeasured, 1.0, CFG).tier == GPU
    assert gate(None, unmeasured, 1.0, CFG).capacity_tokens is None


def test_a_measured_tier_extends_the_capacity_by_its_room() -> None:
    tiers = Tiers().observe(tiered(100_000, 400_000), at=1.0)
    g = gate(100_000, tiers, 1.0, CFG)
    assert (g.tier, g.capacity_tokens, g.spill_tokens) == (GPU_CPU, 500_000, 400_000)
    # Preemptions shrink the GPU's part only (limit() multiplies it all by the factor).
    shrunk = gate(100_000, tiers, 0.5, CFG)
    assert shrunk.capacity_tokens is not None
    assert shrunk.capacity_tokens * 0.5 == 100_000 * 0.5 + 400_000


def test_a_slow_link_bounds_the_tier_by_what_it_reloads_in_the_window() -> None:
    # 1 GB/s: 60 s of link time reload about 159K tokens of 368 KiB, not the 400K the tier holds.
    slow = replace(Tiers().observe(tiered(100_000, 400_000), at=1.0), bandwidth=1e9)
    assert spill_tokens(slow, CFG) == int(60 * 1e9 / BYTES_PER_TOKEN)
    assert spill_tokens(slow, replace(CFG, tier_reload_window_s=600)) == 400_000


def test_a_busy_link_shrinks_the_tier_to_nothing() -> None:
    tiers = Tiers().observe(tiered(100_000, 400_000), at=1.0)
    assert spill_tokens(replace(tiers, load_share=0.1), CFG) == 400_000
    assert spill_tokens(replace(tiers, load_share=0.25), CFG) == 400_000
    assert spill_tokens(replace(tiers, load_share=0.375), CFG) == 200_000
    assert spill_tokens(replace(tiers, load_share=0.5), CFG) == 0
    assert gate(100_000, replace(tiers, load_share=0.6), 1.0, CFG).tier == GPU
    assert spill_tokens(tiers, replace(CFG, tier_max_load_share=0.0)) == 0


def test_the_tier_a_decision_assumed() -> None:
    assert assumed_tier(None, 1.0, 50_000) is None
    assert assumed_tier(100_000, 1.0, 90_000) == "gpu"
    assert assumed_tier(100_000, 1.0, 120_000) == "cpu"
    assert assumed_tier(100_000, 0.5, 60_000) == "cpu"


async def test_with_a_tier_an_idle_program_is_not_paused_for_a_newcomer(
    harness: Harness, autojump_clock: trio.testing.MockClock
) -> None:
    # The scheduler test's overflow (6000 + 3000 + 2000 > 10000) on a backend with a CPU tier:
    # a, idle, lives in the tier; c is admitted at once, and the log says it reached there.
    sched = harness.scheduler
    node = sched.pool.get(B0)
    assert node is not None
    node.snapshot = tiered(10_000, 40_000)
    node.last_poll_at = trio.current_time()
    sched.tick()
    await harness.step("a", 6_000)
    await trio.sleep(1)
    await harness.step("b", 3_000)
    harness.records()
    await harness.step("c", 2_000)
    assert sched.registry.get("c").status is ProgramStatus.ACTING
    assert sched.registry.get("a").status is ProgramStatus.ACTING
    records = [r for r in harness.records() if isinstance(r, DecisionRecord)]
    admitted = next(r for r in records if r.program_id == "c" and r.action == "admit")
    assert admitted.capacity_tokens is not None
    assert admitted.capacity_tokens > 10_000
    assert admitted.detail is not None
    assert json.loads(admitted.detail) == {"tier": "cpu", "gpu_tokens": 10_000}
    assert not [r for r in records if r.action in ("pause", "queue")]


async def test_when_reloads_keep_the_link_busy_tr_pauses_as_on_the_gpu_alone(
    harness: Harness, autojump_clock: trio.testing.MockClock
) -> None:
    sched = harness.scheduler
    node = sched.pool.get(B0)
    assert node is not None
    # Two polls 5 s apart with 5 s of loads between them: the link did nothing but reload,
    # and after a few such polls its share is past the bound.
    loaded = 0.0
    for _ in range(4):
        node.snapshot = tiered(10_000, 40_000, loaded_s=loaded)
        node.last_poll_at = trio.current_time()
        sched.tick()
        await trio.sleep(5)
        loaded += 5.0
    assert sched.schedule_of(B0).tiers.load_share > CFG.tier_max_load_share
    await harness.step("a", 6_000)
    await trio.sleep(1)
    await harness.step("b", 3_000)
    harness.records()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(harness.step, "c", 2_000)
        await trio.sleep(0.5)
        assert sched.registry.get("c").status is ProgramStatus.PAUSED
        assert ("queue", "c", "capacity_full") in harness.decisions()
        sched.release("a")
