"""What an idle program's cache is worth: ``break_even`` claims keep it while keeping it costs
the calls that could run in its place less than its recompute would cost everyone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from thunderproxy.scheduling import tr
from thunderproxy.scheduling.tr import Action

from . import test_tr
from .test_tr import A, R, backend, prog

CFG = replace(test_tr.CFG, idle_claims="break_even", acting_half_life_s=5.0)


def test_the_horizon_is_the_time_to_prefill_a_full_cache() -> None:
    # 20 µs a token on a 100,000-token cache: 2 s; the preemption factor shrinks it with the
    # cache it scales.
    b = backend(100_000, prefill_s_per_token=20e-6)
    assert tr.keep_horizon(b, CFG) == pytest.approx(2.0)
    assert tr.keep_horizon(replace(b, capacity_factor=0.5), CFG) == pytest.approx(1.0)
    # A CPU tier's tokens are not the engine's to prefill: the GPU's own are.
    tiered = replace(b, capacity_tokens=500_000, gpu_tokens=100_000)
    assert tr.keep_horizon(tiered, CFG) == pytest.approx(2.0)
    # Not measured yet, or decayed claims chosen: no horizon.
    assert tr.keep_horizon(backend(100_000), CFG) is None
    assert tr.keep_horizon(b, replace(CFG, idle_claims="decay")) is None
    # Capped, so that the views never need programs idle longer than that.
    assert tr.keep_horizon(backend(10**9, prefill_s_per_token=1e-3), CFG) == tr.MAX_KEEP_S


def test_an_idle_program_counts_whole_until_its_tool_is_expected_to_outlast_the_horizon() -> None:
    b = backend(100_000, prefill_s_per_token=20e-6)  # horizon 2 s
    quick = prog("quick", A, 10_000, acting_since=100.0, tool_s=0.5)
    slow = prog("slow", A, 10_000, acting_since=100.0, tool_s=30.0)
    unknown = prog("unknown", A, 10_000, acting_since=100.0)
    # Its last tool took 0.5 s: its cache is about to be used again, it counts whole.
    assert tr.used_tokens(b, [quick], CFG, now=100.2) == 10_000
    # Past its expected end it is expected to take as long again: at 1.5 s still within 2 s...
    assert tr.used_tokens(b, [quick], CFG, now=101.5) == 10_000
    # ...at 2.5 s no longer: the engine recomputes it sooner than it would come back.
    assert tr.used_tokens(b, [quick], CFG, now=102.5) == 0
    # A program whose tool ran 30 s last time lets its cache go at once.
    assert tr.used_tokens(b, [slow], CFG, now=100.0) == 0
    assert tr.used_tokens(b, [slow], CFG, now=129.0) == 10_000  # 1 s left of 30
    # Nothing known: as long again as it has been idle.
    assert tr.used_tokens(b, [unknown], CFG, now=101.9) == 10_000
    assert tr.used_tokens(b, [unknown], CFG, now=102.1) == 0
    # The same program under decayed claims halves every 5 s instead.
    decayed = replace(CFG, idle_claims="decay")
    assert tr.used_tokens(b, [quick], decayed, now=105.0) == 5_000


def test_a_returning_program_finds_the_room_an_expected_long_tool_left() -> None:
    b = backend(20_000, prefill_s_per_token=20e-6)  # horizon 0.4 s
    long_tool = prog("long", A, 12_000, acting_since=0.0, tool_s=60.0)
    back = prog("back", A, 9_000, acting_since=0.0, tool_s=0.1)
    decision = tr.on_return(back, b, [long_tool, back], CFG, now=0.05)
    assert (decision.action, decision.rule) == (Action.ADMIT, "fits")
    # Under decayed claims the idle program still claims 12,000 tokens and the call waits.
    decayed = replace(CFG, idle_claims="decay", acting_half_life_s=600.0)
    decision = tr.on_return(back, b, [long_tool, back], decayed, now=0.05)
    assert (decision.action, decision.rule) == (Action.PAUSE, "no_room_on_return")


def test_reasoning_programs_count_whole_whatever_the_claims() -> None:
    b = backend(100_000, prefill_s_per_token=20e-6)
    busy = prog("busy", R, 10_000)
    assert tr.used_tokens(b, [busy], CFG, now=1e6) == 10_000
