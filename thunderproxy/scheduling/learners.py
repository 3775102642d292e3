"""What the scheduler learns from observations, as pure values: each learner is a frozen value
with an ``observe`` that returns the next one, and reads no clock and does no I/O.

- :class:`PromptSizer` turns a new program's prompt characters into a token estimate, per model:
  a fit of ``tokens = overhead + chars / chars_per_token`` over recent calls, so the chat
  template's fixed overhead is not smeared into the per-character rate. Its rate is bounded by
  what a tokenizer can do (a token covers at least one character and rarely more than eight),
  so no run of tiny prompts can make a long one look larger than its characters.
- :class:`SharedPrefix` is the common system prefix of one backend: the median of the cached
  tokens first calls got (a first call can only hit what other programs left).
- :class:`CapacityFactor` shrinks a backend's usable capacity when its engine preempts (the
  capacity model was too optimistic) and lets it recover while the engine does not.
- :class:`Saturation` counts the seconds a backend's engine was seen full (its running calls'
  KV near its capacity, or calls already queued in it): a call held in the proxy meanwhile
  would have waited in the engine's queue instead (the hold ledger, costs.py).
- :class:`CallTime` is how long one backend's calls take, sent to last byte: what its resume
  rounds are spaced by where calls are short (tr.resume_cooldown).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from functools import cached_property

#: Until a model's calls have been measured, prompts are sized at this many chars per token.
DEFAULT_CHARS_PER_TOKEN = 4.0
#: Bounds of any tokenizer family: a token covers at least one character (so an estimate never
#: exceeds the characters it came from) and, for text, rarely more than eight.
MIN_CHARS_PER_TOKEN = 1.0
MAX_CHARS_PER_TOKEN = 8.0
#: A chat template adds a few dozen tokens per message; more than this is not a template.
MAX_OVERHEAD_TOKENS = 2048
#: Calls kept per model for the fit.
SIZER_SAMPLES = 64
#: First-call cached-token samples kept per backend.
SHARED_PREFIX_SAMPLES = 64
PREEMPTION_BACKOFF = 0.9
PREEMPTION_RECOVERY = 0.02
MIN_CAPACITY_FACTOR = 0.5


def _clamp(value: float, low: float, high: float) -> float:
    return max(low, min(high, value))


def moving_mean(old: float | None, new: float, weight: float) -> float:
    """An exponentially weighted mean after ``new``, which weighs ``weight`` (None: no
    observation yet, and ``new`` is all it knows)."""
    return new if old is None else old + weight * (new - old)


@dataclass(frozen=True)
class PromptSizer:
    """Recent ``(chars, prompt_tokens)`` of one model's calls and the fit they give.

    Every call's end is observed, but only a program's first call is sized: the fit is made
    when an estimate is asked for, once per value, not at each observation (its exact sums
    cost more than the rest of a call's close)."""

    samples: tuple[tuple[int, int], ...] = ()

    def observe(self, chars: int, prompt_tokens: int) -> PromptSizer:
        if chars < 0 or prompt_tokens <= 0:
            return self
        return PromptSizer((*self.samples[-(SIZER_SAMPLES - 1) :], (chars, prompt_tokens)))

    @cached_property
    def _fit(self) -> tuple[float, float]:
        return fit(self.samples) if self.samples else (0.0, DEFAULT_CHARS_PER_TOKEN)

    @property
    def overhead(self) -> float:
        return self._fit[0]

    @property
    def chars_per_token(self) -> float:
        return self._fit[1]

    def estimate(self, chars: int) -> int:
        overhead, rate = self._fit
        return int(overhead + chars / rate)


def fit(samples: tuple[tuple[int, int], ...]) -> tuple[float, float]:
    """Least squares ``tokens = overhead + chars / rate``, both bounded. Without spread in the
    characters there is no slope to fit: the rate stays the default and only the overhead is
    learned (this is what a run of identical tiny prompts teaches, and all it should)."""
    xs = [c for c, _ in samples]
    ys = [t for _, t in samples]
    mean_x = statistics.fmean(xs)
    mean_y = statistics.fmean(ys)
    var_x = statistics.fmean((x - mean_x) ** 2 for x in xs)
    rate = DEFAULT_CHARS_PER_TOKEN
    if var_x > 0 and max(xs) - min(xs) >= 64:
        cov = statistics.fmean((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
        if cov > 0:
            rate = _clamp(var_x / cov, MIN_CHARS_PER_TOKEN, MAX_CHARS_PER_TOKEN)
    overhead = _clamp(mean_y - mean_x / rate, 0.0, MAX_OVERHEAD_TOKENS)
    return overhead, rate


def program_estimate(context_chars: int, chars_per_token: float) -> int:
    """A known program's next prompt, at its own measured rate (bounded as any tokenizer's)."""
    rate = _clamp(chars_per_token, MIN_CHARS_PER_TOKEN, MAX_CHARS_PER_TOKEN)
    return int(context_chars / rate)


@dataclass(frozen=True)
class SharedPrefix:
    samples: tuple[int, ...] = ()

    def observe(self, cached_tokens: int) -> SharedPrefix:
        if cached_tokens < 0:
            return self
        return SharedPrefix((*self.samples[-(SHARED_PREFIX_SAMPLES - 1) :], cached_tokens))

    @property
    def tokens(self) -> int:
        return int(statistics.median(self.samples)) if self.samples else 0


@dataclass(frozen=True)
class CapacityFactor:
    factor: float = 1.0
    #: The engine's preemption counter at the last reading (None: never read).
    last_preemptions: float | None = None

    def observe(self, preemptions_total: float) -> CapacityFactor:
        previous = self.last_preemptions
        if previous is None or preemptions_total < previous:
            # First reading, or the engine restarted (its counter reset).
            return replace(self, last_preemptions=preemptions_total)
        if preemptions_total > previous:
            factor = max(MIN_CAPACITY_FACTOR, self.factor * PREEMPTION_BACKOFF)
        else:
            factor = min(1.0, self.factor + PREEMPTION_RECOVERY)
        return CapacityFactor(factor, preemptions_total)


#: The engine's KV use (running and queued calls; its prefix cache excluded) from which it is
#: full: less than a typical agent call's room left (20K of 432K tokens is 4.6%).
SATURATED_KV = 0.95


@dataclass(frozen=True)
class Saturation:
    """Seconds one backend's engine was seen full, from its polls: the interval after a poll
    that showed calls queued in the engine, or its KV use at ``SATURATED_KV`` or above, counts
    as full until the next poll says otherwise."""

    full_s: float = 0.0
    last_at: float | None = None
    full: bool = False

    def observe(self, at: float, kv_usage: float | None, waiting: float | None) -> Saturation:
        """A poll at ``at`` (None for what it did not report)."""
        if self.last_at is not None and at <= self.last_at:
            return self  # the same poll, read again at the next tick
        full = (waiting or 0) > 0 or (kv_usage is not None and kv_usage >= SATURATED_KV)
        return Saturation(self.seconds(at), at, full)

    def seconds(self, now: float) -> float:
        """Seconds seen full up to ``now``, the last poll's state taken to hold until then."""
        if not self.full or self.last_at is None or now <= self.last_at:
            return self.full_s
        return self.full_s + (now - self.last_at)


#: Weight of the newest call in :class:`CallTime`'s moving mean (about the last 32 calls).
CALL_TIME_WEIGHT = 1 / 32


@dataclass(frozen=True)
class CallTime:
    """A moving mean of one backend's call durations (sent to last byte, seconds)."""

    seconds: float | None = None

    def observe(self, seconds: float) -> CallTime:
        if seconds < 0:
            return self
        return CallTime(moving_mean(self.seconds, seconds, CALL_TIME_WEIGHT))
