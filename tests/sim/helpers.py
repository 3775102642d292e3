"""Shared helpers of the simulator tests (fixtures live in conftest.py)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

# The block settings of the real-vLLM CPU oracle (docs/SIMULATOR.md, "Tests").
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
