"""Measure a real engine's step time and fit the simulator's timing formula to it.

The engine is measured from outside, through its own OpenAI API, the way the bench's agents
see it (its API server's tokenizing and streaming included):

- **prefill**: one prompt of L fresh tokens after s cached ones, one token asked; the time to
  its first token is the prefill's steps (chunks of the engine's token budget) plus the
  frontend's work on the whole prompt;
- **decode**: B streams over one cached context of C tokens decode together; a stream's
  tokens per second while all B decode gives the step time of a batch of B decodes. Every
  bench word is one token of four letters, so a chunk's text says how many tokens it carried.

The formula (``sim/engine/timing.py``) is linear in its constants once ``n0`` is 0, so the
fit is least squares over every measurement, each row weighted by 1/time (relative errors
count alike for a 5 ms decode step and a 2 s prefill). A constant the data pull below zero
is held at zero and the rest fitted again.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from ...sim.config import TimingProfile
from ...sim.engine.timing import BatchShape, batch_shape
from .server import Echo, EngineServer

#: Prompt lengths (fresh tokens, cached tokens before them) of the prefill measurements.
PREFILL_POINTS = ((256, 0), (1024, 0), (4096, 0), (8192, 0), (16384, 0), (1024, 8192),
                  (4096, 16384), (1024, 24576))  # fmt: skip
#: Streams at once, and the context they decode over: mostly where agent programs decode (a
#: few streams over 8K to 24K tokens each), a few short contexts for the fixed cost.
DECODE_POINTS = ((1, 256), (4, 256), (16, 256), (1, 8192), (2, 8192), (4, 8192), (8, 8192),
                 (1, 16384), (2, 16384), (3, 16384), (4, 16384), (2, 24576))  # fmt: skip
DECODE_TOKENS = 64
#: Each point is measured this often (once a round) and the median kept: the machine's
#: speed drifts by tens of percent from minute to minute, and a replay runs at its typical
#: speed, not its best.
REPEATS = 3
#: The constants fitted, in the order of a measurement's features.
CONSTANTS = ("t_fixed_ms", "c_tok_us", "c_kv_ns", "c_attn_ns", "c_prep_us")
#: Each constant's unit in seconds.
UNITS = (1e-3, 1e-6, 1e-9, 1e-9, 1e-6)


@dataclass(frozen=True)
class Measurement:
    """One timed observation and the formula's features for it: steps, tokens computed,
    decode context read, prefill attention pairs, prompt tokens the frontend handled."""

    kind: str
    label: str
    seconds: float
    features: tuple[float, float, float, float, float]


def prefill_features(fresh: int, cached: int, budget: int) -> tuple[float, ...]:
    """A prompt's prefill, chunk by chunk under the step's token budget, as the formula sees
    it; the last chunk also samples the first token."""
    steps, tokens, pairs = 0, 0, 0.0
    start = cached
    left = fresh
    while left > 0:
        n = min(budget, left)
        shape: BatchShape = batch_shape([(n, start, False)])
        steps += 1
        tokens += shape.num_tokens
        pairs += shape.prefill_pairs
        start += n
        left -= n
    return (steps, tokens, 0.0, pairs, float(fresh + cached))


def decode_features(streams: int, context: int) -> tuple[float, ...]:
    shape = batch_shape([(1, context, True)] * streams)
    return (1.0, shape.num_tokens, shape.decode_context, 0.0, 0.0)


class Prompts:
    """Fresh prompt text from the engine's own words (no two prompts share a block)."""

    def __init__(self, words: Sequence[str], seed: int = 0) -> None:
        self.words = list(words)
        self.random = random.Random(f"calibrate:{seed}")

    def text(self, tokens: int) -> str:
        return "".join(self.random.choices(self.words, k=tokens))


class Calibration:
    def __init__(
        self,
        server: EngineServer,
        client: httpx.AsyncClient,
        *,
        model: str,
        words: Sequence[str],
        word_ids: Sequence[int],
        budget: int,
        echo: Echo,
    ) -> None:
        self.server = server
        self.client = client
        self.model = model
        self.prompts = Prompts(words)
        self.word_ids = list(word_ids)
        self.budget = budget
        self.echo = echo
        #: Template tokens around one user message and the generation prompt.
        self.overhead = 9

    def _body(self, content: str, max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            **({"allowed_token_ids": self.word_ids} if self.word_ids else {}),
        }

    async def _stream(self, content: str, max_tokens: int) -> list[tuple[float, int]]:
        """(arrival time, tokens) of each content chunk, the request's send time first."""
        events = [(time.perf_counter(), 0)]
        url = self.server.url + "/v1/chat/completions"
        async with self.client.stream("POST", url, json=self._body(content, max_tokens)) as r:
            if r.status_code != 200:
                raise RuntimeError(f"calibration request answered {r.status_code}")
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                for choice in json.loads(line[5:]).get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        # Own engine: one four-letter word a token. Another model's
                        # tokenizer is unknown: one token a chunk, as vLLM streams them.
                        tokens = len(text) // 4 if self.word_ids else 1
                        events.append((time.perf_counter(), tokens))
        return events

    async def prefill(self, fresh: int, cached: int) -> Measurement:
        prefix = self.prompts.text(cached) if cached else ""
        if cached:
            await self._stream(prefix, 1)  # puts the prefix in the cache
        content = prefix + self.prompts.text(fresh - self.overhead)
        events = await self._stream(content, 1)
        ttft = events[1][0] - events[0][0]
        # The first cached prompt's last block is recomputed: count it as fresh.
        hit = (cached - 1) // 32 * 32 if cached else 0
        return Measurement(
            "prefill", f"L={fresh} s={cached}", ttft,
            prefill_features(fresh + cached - hit, hit, self.budget),  # type: ignore[arg-type]
        )  # fmt: skip

    async def decode(self, streams: int, context: int) -> Measurement:
        # Each stream decodes over a context of its own, as programs do. Streams sharing one
        # context read the same KV blocks, which a CPU's cache then serves: 4 streams over
        # 16K tokens took 17-18 ms a step over one shared context and 25 ms over four.
        contexts = [self.prompts.text(context - self.overhead - 8) for _ in range(streams)]
        for text in contexts:  # prefilled one by one, so that the streams start together
            await self._stream(text, 1)
        results: list[list[tuple[float, int]]] = []

        async def one(i: int) -> None:
            results.append(await self._stream(contexts[i] + self.prompts.text(8), DECODE_TOKENS))

        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(one, i)
        # Every stream's short tail is prefilled in one step, then all of them decode
        # together, one token each a step, until they end together: from the last first
        # token to the last answer's end is DECODE_TOKENS - 1 steps. (A stream's own chunk
        # times say less: a stream that falls behind gets several tokens in one chunk.)
        first = max(events[1][0] for events in results)
        last = max(events[-1][0] for events in results)
        step = (last - first) / (DECODE_TOKENS - 1)
        return Measurement(
            "decode", f"B={streams} C={context}", step,
            decode_features(streams, context + DECODE_TOKENS // 2),  # type: ignore[arg-type]
        )  # fmt: skip

    async def measure(self) -> list[Measurement]:
        # Rounds over every point rather than a point's repeats in a row: the machine's speed
        # drifts over minutes, and a point measured in one slow minute would bend the fit.
        points: list[tuple[str, int, int]] = [("prefill", *p) for p in PREFILL_POINTS]
        points += [("decode", *p) for p in DECODE_POINTS]
        runs: list[list[Measurement]] = [[] for _ in points]
        await self._stream(self.prompts.text(64), 8)  # warm-up: first request costs more
        for round_ in range(REPEATS):
            self.echo(f"  round {round_ + 1} of {REPEATS}")
            for n, (kind, a, b) in enumerate(points):
                m = await (self.prefill(a, b) if kind == "prefill" else self.decode(a, b))
                runs[n].append(m)
                self.echo(f"    {kind:7} {m.label:>16}: {m.seconds * 1e3:8.2f} ms")
                await self.server.reset_prefix_cache(self.client)
        return [median(r) for r in runs]


def median(runs: Sequence[Measurement]) -> Measurement:
    return sorted(runs, key=lambda m: m.seconds)[len(runs) // 2]


def fit(measurements: Sequence[Measurement]) -> dict[str, float]:
    """Weighted least squares of the formula's constants, none below zero."""
    active = list(range(len(CONSTANTS)))
    while True:
        solution = _solve(measurements, active)
        negative = [i for i in active if solution[i] < 0]
        if not negative:
            return {CONSTANTS[i]: solution[i] / UNITS[i] for i in range(len(CONSTANTS))}
        active.remove(min(negative, key=lambda i: solution[i]))


def _solve(measurements: Sequence[Measurement], active: Sequence[int]) -> list[float]:
    k = len(active)
    ata = [[0.0] * k for _ in range(k)]
    atb = [0.0] * k
    for m in measurements:
        w = 1.0 / m.seconds
        row = [m.features[i] * w for i in active]
        y = m.seconds * w
        for a in range(k):
            atb[a] += row[a] * y
            for b in range(k):
                ata[a][b] += row[a] * row[b]
    values = _gauss(ata, atb)
    full = [0.0] * len(CONSTANTS)
    for a, i in enumerate(active):
        full[i] = values[a]
    return full


def _gauss(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Solve a small dense system by Gaussian elimination with partial pivoting."""
    n = len(rhs)
    a = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if a[col][col] == 0:
            continue
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            for c in range(col, n + 1):
                a[r][c] -= factor * a[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        if a[r][r] == 0:
            continue
        x[r] = (a[r][n] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x


def predicted(constants: dict[str, float], m: Measurement) -> float:
    return sum(constants[name] * unit * f for name, unit, f in
               zip(CONSTANTS, UNITS, m.features, strict=True))  # fmt: skip


def profile_of(
    name: str,
    constants: dict[str, float],
    *,
    kv_tokens: int,
    block_size: int,
    kv_bytes_per_token: int,
    description: str,
) -> TimingProfile:
    return TimingProfile(
        name,
        t_fixed_ms=round(constants["t_fixed_ms"], 4),
        t_w_ms=0.0,
        c_tok_us=round(constants["c_tok_us"], 4),
        n0=0,
        c_kv_ns=round(constants["c_kv_ns"], 4),
        c_attn_ns=round(constants["c_attn_ns"], 6),
        kv_capacity_tokens=kv_tokens,
        block_size=block_size,
        description=description,
        c_prep_us=round(constants["c_prep_us"], 4),
        kv_bytes_per_token=kv_bytes_per_token,
    )


def write_profile(
    path: Path, profile: TimingProfile, measurements: Sequence[Measurement], command: str
) -> None:
    """The profile as the simulator loads it, with the measurements it was fitted to."""
    constants = {n: getattr(profile, n) for n in CONSTANTS}
    doc = {
        **asdict(profile),
        "fitted_by": command,
        "measurements": [
            {
                "kind": m.kind,
                "label": m.label,
                "measured_ms": round(m.seconds * 1e3, 3),
                "fitted_ms": round(predicted(constants, m) * 1e3, 3),
            }
            for m in measurements
        ],
    }
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
