"""The shortcuts a call's lease and close take decide exactly as the computations they skip:
sticky placement without the per-backend loads, and the prompt sizer's fit made when an
estimate is asked for rather than at every call's end."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from thunderproxy.audit import AuditLog
from thunderproxy.audit.records import AuditRecord, TransitionRecord
from thunderproxy.backends import BackendPool, Route, open_backend_pool
from thunderproxy.errors import NoBackendAvailable
from thunderproxy.programs import ProgramRegistry, StepUsage
from thunderproxy.scheduling import Scheduler, TrPolicy
from thunderproxy.scheduling.costs import HoldLedger
from thunderproxy.scheduling.learners import (
    DEFAULT_CHARS_PER_TOKEN,
    SIZER_SAMPLES,
    PromptSizer,
    fit,
)
from thunderproxy.scheduling.tr import PolicyConfig

B0, B1, B2 = "http://b0", "http://b1", "http://b2"


@pytest.fixture
async def scheduler() -> AsyncIterator[Scheduler]:
    send, _receive = trio.open_memory_channel[AuditRecord](100_000)
    async with open_backend_pool([B0, B1, B2]) as pool:
        yield Scheduler(
            policy=TrPolicy(PolicyConfig()),
            registry=ProgramRegistry(lambda t: send.send_nowait(TransitionRecord(t))),
            pool=pool,
            audit=AuditLog(send, run_id=1),
        )


async def _load(scheduler: Scheduler, program_id: str, url: str) -> None:
    """A call of ``program_id`` in flight on ``url``: it weighs on that backend's load."""
    only = scheduler.pool.get(url)
    assert only is not None
    route = Route(None, None, (only,))
    await scheduler.lease(program_id, route, arrived_at=0.0, context_chars=4000)


def _routes(pool: BackendPool) -> list[Route]:
    nodes = tuple(pool)
    return [Route(None, None, nodes), Route("m", "m", nodes[1:]), Route("m", "m", nodes[:1])]


@pytest.mark.parametrize("down", [(), (B0,), (B1,), (B0, B2), (B0, B1, B2)])
async def test_placement_is_the_pure_choice_whatever_the_health(
    scheduler: Scheduler, down: tuple[str, ...]
) -> None:
    # B1 the most loaded, B2 the least: a move would not go to B1.
    await _load(scheduler, "x", B1)
    await _load(scheduler, "y", B1)
    await _load(scheduler, "z", B0)
    for url in down:
        node = scheduler.pool.get(url)
        assert node is not None
        node.health.down("test: stopped")
    for route in _routes(scheduler.pool):
        for current in (None, B0, B1, B2, "http://gone"):
            try:
                expected = scheduler.source.choose("p", current, route)
            except NoBackendAvailable:
                with pytest.raises(NoBackendAvailable):
                    scheduler._choose("p", current, route)
                continue
            assert scheduler._choose("p", current, route) is expected, (route, current)


async def test_a_lease_records_whether_tr_held_there(scheduler: Scheduler) -> None:
    scheduler.schedule_of(B0).hold = replace(HoldLedger(), holding=False)
    await _load(scheduler, "p", B0)
    lease = await scheduler.lease(
        "p", Route(None, None, tuple(scheduler.pool)), arrived_at=0.0, context_chars=400
    )
    assert lease.node.url == B0  # sticky
    assert lease.holding is False
    scheduler.close(lease, StepUsage(100, 10, 0), reason="response complete")


samples = st.lists(
    st.tuples(st.integers(-5, 200_000), st.integers(-5, 200_000)), max_size=3 * SIZER_SAMPLES
)


@given(samples, st.integers(0, 1_000_000))
def test_the_sizer_estimates_from_the_fit_of_its_recent_calls(
    history: list[tuple[int, int]], chars: int
) -> None:
    sizer = PromptSizer()
    for c, t in history:
        sizer = sizer.observe(c, t)
    kept = tuple((c, t) for c, t in history if c >= 0 and t > 0)[-SIZER_SAMPLES:]
    assert sizer.samples == kept
    overhead, rate = fit(kept) if kept else (0.0, DEFAULT_CHARS_PER_TOKEN)
    assert (sizer.overhead, sizer.chars_per_token) == (overhead, rate)
    assert sizer.estimate(chars) == int(overhead + chars / rate)
