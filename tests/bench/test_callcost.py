"""The in-process per-call measurement runs whole calls through the edge and the gateway."""

from __future__ import annotations

import pytest

from thunderproxy.bench.callcost import body, measure


@pytest.mark.parametrize("router", ["default", "tr"])
async def test_whole_calls_are_measured_with_their_first_chunk(router: str) -> None:
    result = await measure(router, programs=2, rounds=2, history=3)
    assert result["body_bytes"] == len(body(0, 3))
    assert 0 < result["cpu_to_first_chunk_us"] < result["cpu_per_call_us"]
