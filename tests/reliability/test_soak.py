"""Load and soak: zero proxy-originated errors, flat memory, audit rows equal to steps served.

The default suite runs a short version; the full one (1,000 programs for 10 minutes) is
`pytest -m soak tests/reliability/test_soak.py -s`."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from tests.reliability.soak import soak


async def test_short_load(tmp_path: Path) -> None:
    # Eight seconds of 100 programs: a few hundred calls on a quiet machine, above 100 on a busy
    # one; the ten-minute soak below is the long version.
    result = await soak(tmp_path, programs=100, seconds=8)
    assert result.exit_code == 0
    assert result.proxy_errors == 0, result.errors
    assert result.served > 100
    assert result.audit_steps == result.served


@pytest.mark.soak
async def test_soak_1000_programs_10_minutes(tmp_path: Path) -> None:
    result = await soak(tmp_path, programs=1000, seconds=600, report=True)
    assert result.exit_code == 0
    assert result.proxy_errors == 0, result.errors
    assert result.audit_steps == result.served
    # Flat memory: after warm-up, the last third of the samples stays within 25% of the middle.
    samples = result.rss_kib[len(result.rss_kib) // 6 :]
    third = len(samples) // 3
    middle = statistics.median(samples[third : 2 * third])
    late = statistics.median(samples[2 * third :])
    print(f"served {result.served} steps, {result.programs_done} programs; rss {middle} -> {late}")
    assert late <= middle * 1.25
