"""Test policy for the simulator suite.

- Engine tests run in-process on trio's MockClock (`autojump_clock`): virtual time, so a
  long simulated overload finishes in milliseconds and every timing assert is exact.
- HTTP tests start a real hypercorn server on 127.0.0.1 port 0 and talk to it with
  httpx.AsyncClient, on the real clock (autojump would fire while sockets are busy), with a
  small `time_scale` so simulated seconds pass quickly.
- The `conformance` suite (test_sim_conformance.py) compares against a real vLLM on CPU.
"""

from __future__ import annotations

import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import pytest
import trio

from thunderproxy.sim import Engine, SimConfig, Simulator, open_simulator

# The block settings of the real-vLLM CPU oracle (vllm-contract.md §6).
SMALL = dict(
    block_size=32,
    num_gpu_blocks=100,
    max_num_batched_tokens=512,
    max_num_seqs=16,
    max_model_len=2048,
)


def token_prompt(seed: int, length: int) -> list[int]:
    """A random prompt of token ids; distinct seeds share no block."""
    rng = random.Random(seed)
    return [rng.randrange(10, 30_000) for _ in range(length)]


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


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class Family:
    name: str
    type: str
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def value(self, sample: str | None = None, **labels: str) -> float:
        """The one sample matching `sample` (default: the family name) and `labels`."""
        wanted = sample or self.name
        found = [
            v
            for name, lb, v in self.samples
            if name == wanted and all(lb.get(k) == x for k, x in labels.items())
        ]
        assert len(found) == 1, (wanted, labels, self.samples)
        return found[0]


def parse_metrics(text: str) -> dict[str, Family]:
    """A strict-enough Prometheus text parser: families by their TYPE line, samples after."""
    families: dict[str, Family] = {}
    current: Family | None = None
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            current = families[name] = Family(name, kind)
        elif line.startswith("#") or not line.strip():
            continue
        else:
            match = _SAMPLE.match(line)
            assert match, line
            assert current is not None, line
            labels = dict(_LABEL.findall(match.group(3) or ""))
            value = match.group(4)
            current.samples.append((match.group(1), labels, float(value)))
    return families
