"""The in-process per-call measurement runs whole calls through the edge and the gateway."""

from __future__ import annotations

import pytest

from thunderproxy.bench.relay.callcost import body, measure, measure_one_shot


@pytest.mark.parametrize("router", ["default", "tr"])
async def test_whole_calls_are_measured_with_their_first_chunk(router: str) -> None:
    result = await measure(router, programs=2, rounds=2, history=3)
    assert result["body_bytes"] == len(body(0, 3))
    assert 0 < result["cpu_to_first_chunk_us"] < result["cpu_per_call_us"]


async def test_per_chunk_mode_relays_through_the_h1_client_and_prices_one_chunk() -> None:
    result = await measure("default", programs=2, rounds=3, history=0, per_chunk=True, chunks=8)
    # One more chunk costs far less than a whole call. The chunk's price is a difference of two
    # CPU readings, which noise on a busy machine can push to or below zero: only its bound is
    # checked, not its sign.
    assert result["cpu_per_call_us"] > 0
    assert result["cpu_per_chunk_us"] < result["cpu_per_call_us"] / 4


@pytest.mark.parametrize("router", ["default", "tr"])
async def test_one_shot_mode_makes_every_call_a_new_program(router: str) -> None:
    # measure_one_shot itself checks that the registry holds a program per call.
    batches = await measure_one_shot(router, before=30, batches=2, batch=10)
    assert len(batches) == 2
    assert all(b > 0 for b in batches)
