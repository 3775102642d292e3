"""The step-time model (docs/SIMULATOR.md, "Timing"): one engine step's duration from its batch.

t = t_fixed + t_w + c_tok * max(0, N - n0)            GEMMs: weight-read floor, then compute
      + c_kv * sum(context of each decode)            decode attention reads every KV token
      + c_attn * sum(n*s + n*(n+1)/2 per prefill)     prefill attention, chunk n at offset s
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..config import TimingProfile


@dataclass(frozen=True)
class BatchShape:
    """What the formula needs to know about a step; built from a StepPlan or by hand."""

    num_tokens: int
    decode_context: int  # sum over decodes of the context the new token attends to
    prefill_pairs: float  # sum over prefill chunks of n*s + n*(n+1)/2


def batch_shape(items: Iterable[tuple[int, int, bool]]) -> BatchShape:
    """Shape of a batch given (num_new, start, is_decode) per scheduled request."""
    num_tokens = 0
    decode_context = 0
    prefill_pairs = 0.0
    for num_new, start, is_decode in items:
        num_tokens += num_new
        if is_decode:
            decode_context += start + 1
        else:
            prefill_pairs += num_new * start + num_new * (num_new + 1) / 2
    return BatchShape(num_tokens, decode_context, prefill_pairs)


def step_seconds(profile: TimingProfile, shape: BatchShape) -> float:
    return (
        (profile.t_fixed_ms + profile.t_w_ms) * 1e-3
        + profile.c_tok_us * 1e-6 * max(0, shape.num_tokens - profile.n0)
        + profile.c_kv_ns * 1e-9 * shape.decode_context
        + profile.c_attn_ns * 1e-9 * shape.prefill_pairs
    )


def prefill_seconds(profile: TimingProfile, prompt_len: int, chunk: int) -> float:
    """Time to prefill a prompt alone on an idle server, chunk by chunk (no decode)."""
    total = 0.0
    start = 0
    while start < prompt_len:
        n = min(chunk, prompt_len - start)
        total += step_seconds(profile, batch_shape([(n, start, False)]))
        start += n
    return total
