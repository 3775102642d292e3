"""Test policy for the simulator suite.

- Engine tests run in-process on trio's MockClock (`autojump_clock`): virtual time, so a
  long simulated overload finishes in milliseconds and every timing assert is exact.
- HTTP tests start a real hypercorn server on 127.0.0.1 port 0 and talk to it with
  httpx.AsyncClient, on the real clock (autojump would fire while sockets are busy), with a
  small `time_scale` so simulated seconds pass quickly.
- The `conformance` suite (test_sim_conformance.py) compares against a real vLLM on CPU.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
import trio

from thunderproxy.sim import Engine, SimConfig, Simulator, open_simulator

from .helpers import SMALL


@pytest.fixture
def small_config() -> SimConfig:
    return SimConfig(**SMALL)  # type: ignore[arg-type]


@pytest.fixture
def start_engine(nursery: trio.Nursery) -> Callable[[SimConfig], Awaitable[Engine]]:
    """Start engines whose step loops live in the test's nursery."""

    async def start(config: SimConfig) -> Engine:
        engine = Engine(config)
        await nursery.start(engine.run)
        return engine

    return start


@pytest.fixture
async def sim(request: pytest.FixtureRequest) -> AsyncIterator[Simulator]:
    """A simulator over HTTP; parametrize indirectly with a dict of SimConfig overrides."""
    overrides = getattr(request, "param", {})
    config = SimConfig(**{**SMALL, "time_scale": 0.01, **overrides})  # type: ignore[arg-type]
    async with open_simulator(config) as simulator:
        yield simulator


@pytest.fixture
async def client(sim: Simulator) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sim.url, timeout=10.0) as http:
        yield http
