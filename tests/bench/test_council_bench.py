"""The councils bench measures every council it asks: each router, a live proxy and simulator
on loopback, more conversations from one client than the per-client council job cap allows
by default (that cap once answered the extra ones 429, and their times were counted)."""

from __future__ import annotations

import pytest

from thunderproxy.bench.studies.council_bench import measure


@pytest.mark.parametrize("router", ["default", "tr"])
async def test_every_council_asked_is_answered_and_timed(router: str) -> None:
    result = await measure(router, councils=6, turns=1, kv_tokens=48_000, time_scale=0.05)
    assert result.failed == 0
    assert len(result.council_s) == 6
    assert all(seconds > 0 for seconds in result.council_s)
    assert result.hit_rate is not None
    assert result.prompt_tokens > 0
