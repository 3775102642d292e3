"""The step-time model: its sanity values (docs/SIMULATOR.md, "Timing"), and the engine's clock
following the formula."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio
from trio.testing import MockClock

from thunderproxy.sim import PROFILES, Engine, SimConfig
from thunderproxy.sim.engine.timing import batch_shape, prefill_seconds, step_seconds

from .helpers import token_prompt

H100 = PROFILES["h100-8b"]
Start = Callable[[SimConfig], Awaitable[Engine]]


def decode_step(batch: int, context: int) -> float:
    return step_seconds(H100, batch_shape([(1, context - 1, True)] * batch))


@pytest.mark.parametrize(
    ("seconds", "published"),
    [
        pytest.param(lambda: decode_step(1, 1024), 6.6e-3, id="decode-b1-1k"),
        pytest.param(lambda: decode_step(64, 4096), 19.6e-3, id="decode-b64-4k"),
        pytest.param(lambda: decode_step(256, 1024), 23e-3, id="decode-b256-1k"),
        pytest.param(lambda: prefill_seconds(H100, 4096, 8192), 0.113, id="prefill-4k"),
        pytest.param(lambda: prefill_seconds(H100, 32768, 8192), 1.5, id="prefill-32k-4-chunks"),
        pytest.param(
            lambda: 8192 / step_seconds(H100, batch_shape([(512, 0, False)] * 16)) / 1e3,
            40,
            id="peak-prefill-ktok/s",
        ),  # fmt: skip
    ],
)
def test_h100_8b_matches_the_published_sanity_values(
    seconds: Callable[[], float], published: float
) -> None:
    assert seconds() == pytest.approx(published, rel=0.10)


def test_formula_terms() -> None:
    # t_fixed + t_w only, below n0 and with no context.
    assert step_seconds(H100, batch_shape([])) == pytest.approx(6.5e-3)
    # 1000 prefill tokens from position 0: compute above n0 plus n(n+1)/2 pairs.
    expected = 6.5e-3 + 24e-6 * (1000 - 128) + 1.3e-9 * 1000 * 1001 / 2
    assert step_seconds(H100, batch_shape([(1000, 0, False)])) == pytest.approx(expected)
    # A chunk starting at s also attends to the s tokens before it.
    shape = batch_shape([(100, 900, False)])
    assert shape.prefill_pairs == 100 * 900 + 100 * 101 / 2


async def test_engine_ttft_and_itl_follow_the_formula(
    autojump_clock: MockClock, start_engine: Start
) -> None:
    """On the MockClock an idle 4K prompt's TTFT is the formula's, within 10% of the
    documented 113 ms."""
    engine = await start_engine(SimConfig())
    handle = engine.submit(token_prompt(1, 4096), max_tokens=3, ignore_eos=True)
    outputs = [o async for o in handle]
    ttft = outputs[0].time - outputs[0].arrival_time
    assert ttft == pytest.approx(prefill_seconds(H100, 4096, 8192), rel=1e-9)
    assert ttft == pytest.approx(0.113, rel=0.10)
    itl = outputs[1].time - outputs[0].time
    assert itl == pytest.approx(decode_step(1, 4097), rel=1e-9)  # 4096 tokens + itself


async def test_engine_decode_step_at_batch_64(
    autojump_clock: MockClock, start_engine: Start
) -> None:
    engine = await start_engine(SimConfig())
    async with trio.open_nursery() as nursery:
        for seed in range(64):
            # Long enough that the first are still decoding when the last finish prefill.
            handle = engine.submit(token_prompt(seed, 4095), max_tokens=40, ignore_eos=True)
            nursery.start_soon(drain, handle)
    full_decodes = [rec[1] for rec in engine.trace if rec[2] == 64 and all(b[3] for b in rec[3])]
    assert full_decodes
    assert full_decodes[0] == pytest.approx(19.6e-3, rel=0.10)


async def drain(handle: object) -> None:
    async for _ in handle:  # type: ignore[attr-defined]
        pass


async def test_frontend_delay_scales_with_prompt_and_can_be_aborted(
    autojump_clock: MockClock, start_engine: Start
) -> None:
    engine = await start_engine(SimConfig(c_prep_us=10.0))
    handle = engine.submit(token_prompt(1, 1000), max_tokens=1, ignore_eos=True)
    [out] = [o async for o in handle]
    prefill = prefill_seconds(H100, 1000, 8192)
    assert out.time - out.arrival_time == pytest.approx(0.010 + prefill, rel=1e-9)
    doomed = engine.submit(token_prompt(2, 1000), max_tokens=1, request_id="gone")
    engine.abort("gone")
    await trio.sleep(0.1)
    assert engine.scheduler.stats.steps == 1
    assert [o.finish_reason async for o in doomed] == ["abort"]
