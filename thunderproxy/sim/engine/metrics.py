"""Histograms and counters the engine observes, with vLLM's bucket boundaries.

Only recording lives here; `exposition.py` turns an engine into Prometheus text.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import SimRequest

REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to and including `max_value`."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return tuple(out)
            out.append(value)
        scale *= 10


class Histogram:
    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last slot is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[int]:
        out = []
        running = 0
        for c in self.counts:
            running += c
            out.append(running)
        return out


class Recorder:
    """Per-request and per-step observations, in simulated seconds."""

    def __init__(self, max_model_len: int) -> None:
        tokens = buckets_1_2_5(max_model_len)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.request_tpot = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = Histogram(tokens)
        self.generation_tokens = Histogram(tokens)
        self.max_num_generation_tokens = Histogram(tokens)
        self.params_max_tokens = Histogram(tokens)
        self.prefill_kv_computed = Histogram(tokens)
        self.params_n = Histogram(PARAMS_N_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)
        self.num_preemptions = Histogram(NUM_PREEMPTIONS_BUCKETS)
        self.uncached_prompt_tokens = Histogram(tokens)  # SGLang personality
        self.finished: Counter[str] = Counter()
        self.admission_rejections: Counter[str] = Counter()
        # Simulator truth about the clock, in wall seconds.
        self.busy_sim_seconds = 0.0
        self.busy_wall_seconds = 0.0
        self.busy_nominal_wall_seconds = 0.0
        self.max_lag_seconds = 0.0
        self.lag_seconds = 0.0

    def token(self, req: SimRequest, now: float) -> None:
        """A request emitted a token at simulated time `now`."""
        if req.first_token_time is None:
            req.first_token_time = now
            self.ttft.observe(now - req.arrival_time)
        elif req.last_token_time is not None:
            self.itl.observe(now - req.last_token_time)
        req.last_token_time = now

    def finish(self, req: SimRequest, now: float) -> None:
        """Per-request histograms, observed once when the request finishes."""
        first_sched = req.first_scheduled_time if req.first_scheduled_time is not None else now
        first_token = req.first_token_time if req.first_token_time is not None else now
        n_out = len(req.output_token_ids)
        self.e2e.observe(now - req.arrival_time)
        self.queue.observe(first_sched - req.arrival_time)
        self.prefill.observe(first_token - first_sched)
        self.decode.observe(now - first_token)
        self.inference.observe(now - first_sched)
        self.prompt_tokens.observe(req.num_prompt_tokens)
        self.generation_tokens.observe(n_out)
        self.max_num_generation_tokens.observe(req.max_tokens)
        self.params_max_tokens.observe(req.max_tokens)
        self.params_n.observe(1)
        self.num_preemptions.observe(req.num_preemptions)
        uncached = req.num_prompt_tokens - max(req.num_cached_tokens, 0)
        self.prefill_kv_computed.observe(uncached)
        self.uncached_prompt_tokens.observe(uncached)
        if n_out > 1:
            self.request_tpot.observe((now - first_token) / (n_out - 1))
        self.finished[req.finish_reason or "stop"] += 1
