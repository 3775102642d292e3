"""Whether holding programs back pays on a backend, learned from what its calls show: a pure,
frozen value with ``observe_*`` methods that return the next one (no clock, no I/O).

tr holds a call back (a newcomer queued, a returning program paused) so that the programs
already running keep their KV cache. That saves recompute only when those programs come back
while their cache is still kept; and it costs the held call its wait, where the engine had
room for it. Both are measured per call, in seconds of latency:

    cost of a call = its wait in the proxy while the engine had room
                   + its own history it found evicted · prefill_s_per_token · in_flight

- The wait while the engine had room: a call's wait in the proxy less ``displaced_s``, the
  seconds of it the backend's polls showed the engine full (learners.Saturation: calls queued
  in it, or its KV use, prefix cache left out, at 0.95 or above). Released into a full engine,
  a held call waits in the engine's queue instead; only where the engine had room does holding
  make it wait. On the SWE-agent trace at 64 agents the engine was full for 64% of the held
  calls' waits in the first 565 s: charged their whole wait, held calls looked to lose 26 s
  each against the recompute they kept, holding stopped 565 s into the run (27.9 steps/min
  against 30.1 holding throughout), and calls then waited 62 to 95 s in the engine's queue
  instead of the proxy's. At 32 agents, where tr keeps room in the engine, it was full for 10%
  of the waits.
- A call's wait in the engine's queue (its time to first token less its prefill at
  ``prefill_s_per_token``: ``engine_wait``, logged as ``engine_queue_s``) is no cost of not
  holding, for the same reason: held, the call would have waited in the proxy. Charged on both
  sides, it made not holding look dear where it was not: on the Mooncake quarter trace at 216K
  (with ``--no-return-evidence``) the ledger stopped holding 64 s in, then weighed the calls
  without holding, 15 s in the engine's queue as the hour's load built up, against the held
  calls of the first minute, and held again (median call 164.4 s against 142.7 s).
- ``prefill_s_per_token``: the fastest prefill per uncached prompt token seen on the backend.
  A call's time to first token is its prefill plus its wait in the engine's queue; the engine's
  speed does not change with load, its queue does. (The fastest of the last 64 calls, as it
  was, measured the queue once the engine was overloaded: 28 µs per token at the start of the
  Mooncake quarter trace at 216K, up to 1,354 µs later, which made every recompute look 48
  times dearer and turned holding back on.)
- ``in_flight``: calls on the backend when the call goes out, those held back for it included
  (without holding they would be in flight too): a second of recompute is a second every one
  of them waits for the engine.
- Its own history counts only for a program that came back within the protection horizon
  (``horizon_s``; the scheduler passes ``reuse_tokens=0`` otherwise): tr no longer counts an
  idle program's cache after it, so what such a program recomputes is recomputed with holding
  or without, and a program that never calls again saves nothing by being held.
- A wait is charged to holding even where holding stopped while the call waited (only holding
  makes a call wait): released at once, such calls would otherwise make not holding look as
  expensive as the waits it ends.

The ledger keeps, each learned only in its own state, the mean and variance of the cost of
calls made while holding (``on``) and while not (``off``), and while holding, per call, what
not holding would have changed (``gain``): the history the call found cached, had holding not
kept it, recomputed (counted ``ESTIMATE_MARGIN`` times: one recompute per returning call, the
evictions that cascade unseen), less the call's wait while the engine had room.

Switching is a test, not a threshold crossing: the means are exponentially weighted (about
the last 64 calls) and a switch needs the difference to exceed ``Z`` standard errors, so noise
near the threshold switches nothing, and each switch (pausing or resuming many programs at
once) waits for evidence.

- After ``MIN_CALLS`` calls, holding stops when not holding is measured cheaper (``off``
  below ``on``) or, before it has been, when ``gain`` is below zero.
- Holding comes back only after ``MIN_CALLS_OFF`` calls without it, and when they cost more
  (``off`` above ``on``): where releasing it made calls recompute more than holding made them
  wait.

Until ``MIN_CALLS`` calls have been seen, or while no prefill has been measured, holding is
on: tr's default.

Holding keeps caches for programs that come back within the horizon, and only those. The
ledger also counts, per backend, the programs whose call ended that were seen back within it
(``returned``) and those that were not (``gone``: back later, or released or retired between
calls), and tr holds programs back there only once at least half of them came back
(``seen_returns``, with a prior of ``PRIOR_GONE`` programs not back: nothing is held before the
first return). On the Mooncake quarter trace at 216K no session comes back before 66 s into
the run and fewer than a quarter ever do within the horizon; holding until the ledger had seen
enough calls to stop it made the median call 3% slower than default's, a delay an engine at
capacity never worked off. On the SWE-agent trace programs come back within a second, and
holding starts with the second return.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..config import PolicyConfig
from .learners import moving_mean

#: Weight of a new observation in the moving means (about the last 64 observations).
ALPHA = 1.0 / 64
#: Calls seen before holding may stop. Few, because the test is strict: holding that does not
#: pay delays calls while the ledger learns, and where the engine runs at capacity the backlog
#: those delays make is never worked off (the Mooncake quarter trace at 216K: with at least 64
#: calls, median call 155 s against default's 138 s; with at least 16, holding stopped after 32
#: calls and the median was 143 s).
MIN_CALLS = 16
#: Calls without holding before the ledger trusts what they cost (and holding may come back).
MIN_CALLS_OFF = 64
#: The estimate counts one recompute per returning call, no cascade: the recompute it sees
#: counts this many times.
ESTIMATE_MARGIN = 2.0
#: Standard errors by which one mean must exceed the other for holding to switch. The test is
#: repeated at every call on overlapping means, so a bound that would be strict once is crossed
#: by noise alone far more often: with the gain exactly at break-even (held calls waiting 0 or
#: 20 s, saving 10 s), 2 standard errors switched within 3,000 calls in 195 seeds of 200, 3 in
#: 85, 4 in 9.
Z = 4.0
#: A call that waited less than this in the proxy was not held (the time to reach the
#: scheduler is not a wait).
HELD_S = 0.01
#: Calls with fewer uncached prompt tokens than this say more about overheads than prefill.
MIN_PREFILL_TOKENS = 1024
#: Prefill lengths are told apart in doublings from ``MIN_PREFILL_TOKENS``, this many (the
#: last takes everything longer): 1K, 2K, ... 128K tokens and up.
PREFILL_LENGTHS = 8
#: Programs counted as not back before any is seen: the share back is
#: ``returned / (returned + gone + PRIOR_GONE)``, nothing until one is seen back.
PRIOR_GONE = 2.0
#: Returns and departures are counted with this memory (observations), so that the share
#: follows a backend whose traffic changes.
RETURN_MEMORY = 256
#: The share of programs whose call ended seen back within the horizon from which tr holds
#: programs back at all (``seen_returns``). Below it a hold mostly protects caches nobody comes
#: back for: on the Mooncake quarter trace at 216K the share stays under 0.25 all hour, and
#: holding from the first return (84 s in, share 0.04) marked 14 running calls at once and
#: held calls until the ledger stopped it at 145 s (median call 138.39 s against default's
#: 138.09 s); on the SWE-agent trace the share is a half at the second return.
RETURNS_TO_HOLD = 0.5


def _length_index(tokens: int) -> int:
    """Which of the ``PREFILL_LENGTHS`` doublings ``tokens`` falls in."""
    doublings = max(0, tokens) // MIN_PREFILL_TOKENS
    return min(PREFILL_LENGTHS - 1, doublings.bit_length() - 1) if doublings else 0


def horizon_s(cfg: PolicyConfig) -> float:
    """How long after its call ends a program's cache still counts in tr's capacity model:
    four half-lives (its claim is then a sixteenth); without decay, the idle lease."""
    if cfg.acting_half_life_s > 0:
        return 4 * cfg.acting_half_life_s
    return cfg.idle_lease_s


def _ewma(old: float | None, new: float) -> float:
    return moving_mean(old, new, ALPHA)


@dataclass(frozen=True)
class Mean:
    """An exponentially weighted mean and variance: the plain ones over the first
    ``1/ALPHA`` observations, then weighted towards the last ``1/ALPHA`` or so."""

    n: int = 0
    mean: float = 0.0
    var: float = 0.0

    def add(self, x: float) -> Mean:
        a = max(ALPHA, 1.0 / (self.n + 1))
        d = x - self.mean
        return Mean(self.n + 1, self.mean + a * d, (1 - a) * (self.var + a * d * d))

    @property
    def weight(self) -> float:
        """Observations the mean effectively rests on (an EWMA's: (2 - α) / α at most)."""
        return float(min(self.n, (2 - ALPHA) / ALPHA))

    @property
    def se2(self) -> float:
        """Squared standard error of the mean."""
        return self.var / max(1.0, self.weight)


def exceeds(high: Mean, low: Mean) -> bool:
    """Whether ``high``'s mean is above ``low``'s by more than ``Z`` standard errors of the
    difference (both measured)."""
    if not high.n or not low.n:
        return False
    return high.mean - low.mean > Z * math.sqrt(high.se2 + low.se2)


@dataclass(frozen=True)
class HoldLedger:
    calls: int = 0
    #: The decision: whether tr holds programs back on this backend.
    holding: bool = True
    #: Programs whose call ended seen back within the horizon, and not (back later, released
    #: or retired), both forgetting with RETURN_MEMORY.
    returned: float = 0.0
    gone: float = 0.0
    reuse_tokens: float | None = None
    in_flight: float | None = None
    #: Cost of a call (wait + recompute of its own evicted history) while holding.
    on: Mean = Mean()
    #: The same while not holding.
    off: Mean = Mean()
    #: While holding, per call: what not holding would have cost more (its cached history
    #: recomputed, ESTIMATE_MARGIN times) less its wait.
    gain: Mean = Mean()
    #: Calls since holding last stopped.
    calls_off: int = 0
    #: The fastest prefill seen, seconds per uncached token: the engine's own speed.
    prefill_s_per_token: float | None = None
    #: The same for prefills mostly from scratch, per length (doublings from
    #: ``MIN_PREFILL_TOKENS``; None: none seen): what recomputing a history of that length
    #: costs per token (``recompute_s_per_token``).
    prefill_by_length: tuple[float | None, ...] = (None,) * PREFILL_LENGTHS
    #: Moving mean of the calls' waits in the engine's queue, and of the share of held calls'
    #: waits the engine was seen full (for the decision log).
    queued_s: float | None = None
    displaced: float | None = None

    def observe_call(
        self,
        *,
        waited_s: float,
        in_flight: int,
        reuse_tokens: int,
        missed_tokens: int,
        holding: bool,
        first_token_s: float | None = None,
        uncached_tokens: int = 0,
        displaced_s: float = 0.0,
    ) -> HoldLedger:
        """A call went out after ``waited_s`` in the proxy, with ``in_flight`` other calls on
        (or held for) its backend, carrying ``reuse_tokens`` of its own history that holding
        could have kept (0 for a first call, or a program back after the horizon) of which
        ``missed_tokens`` were not in the cache; ``holding``: whether tr held programs back
        there when it went out. Its first token came ``first_token_s`` after it was sent
        (None: not seen), for ``uncached_tokens`` of prefill; ``displaced_s`` of its wait in
        the proxy the engine was seen full (learners.Saturation). Returns the ledger with its
        decision taken anew."""
        busy = max(1, in_flight + 1)
        rate = self.recompute_s_per_token(reuse_tokens)
        waited = max(0.0, waited_s)
        missed = min(max(0, missed_tokens), max(0, reuse_tokens))
        # Of a held call's wait, what the engine would have made it wait anyway is no cost of
        # holding: released into a full engine, the call waits in its queue instead. For the
        # same reason a call's wait in the engine's queue is no cost of not holding: held, it
        # would have waited in the proxy (measured at another time, under another load, the
        # engine's queue made not holding look dear where it was not: module docstring).
        lost = waited - min(waited, max(0.0, displaced_s))
        queued = self.engine_wait(first_token_s, uncached_tokens)
        cost = lost + missed * rate * busy
        held = holding or waited >= HELD_S
        reuse = self.reuse_tokens
        if reuse_tokens > 0:
            reuse = _ewma(reuse, reuse_tokens)
        kept = (max(0, reuse_tokens) - missed) * rate * busy
        ledger = replace(
            self,
            calls=self.calls + 1,
            reuse_tokens=reuse,
            in_flight=_ewma(self.in_flight, busy),
            on=self.on.add(cost) if held else self.on,
            off=self.off if held else self.off.add(cost),
            gain=self.gain.add(ESTIMATE_MARGIN * kept - lost) if held else self.gain,
            calls_off=self.calls_off + (not self.holding),
            queued_s=_ewma(self.queued_s, queued),
            displaced=_ewma(self.displaced, 1 - lost / waited)
            if waited >= HELD_S
            else self.displaced,
        )
        return ledger._decide()

    def engine_wait(self, first_token_s: float | None, uncached_tokens: int) -> float:
        """A call's wait in the engine's queue: its time to first token less its prefill at
        the engine's own speed (0 where either is unknown)."""
        if first_token_s is None or self.prefill_s_per_token is None:
            return 0.0
        uncached = max(0, uncached_tokens)
        return max(0.0, first_token_s - uncached * self.recompute_s_per_token(uncached))

    def _decide(self) -> HoldLedger:
        if self.holding:
            if self.stops:
                return replace(self, holding=False, calls_off=0)
        elif self.resumes:
            return replace(self, holding=True)
        return self

    @property
    def stops(self) -> bool:
        """While holding: whether the measurements say to stop."""
        if self.calls < MIN_CALLS or self.prefill_s_per_token is None or not self.on.n:
            return False
        if self.off.n >= MIN_CALLS_OFF:
            return exceeds(self.on, self.off)
        if self.gain.n < MIN_CALLS:
            return False
        return self.gain.mean + Z * math.sqrt(self.gain.se2) < 0

    @property
    def resumes(self) -> bool:
        """While not holding: whether the calls made since say to hold again."""
        return self.calls_off >= MIN_CALLS_OFF and exceeds(self.off, self.on)

    def observe_return(self, returned: bool) -> HoldLedger:
        """A program's next call arrived within the horizon (True), or later or never."""
        keep = 1.0 - 1.0 / RETURN_MEMORY
        return replace(
            self,
            returned=self.returned * keep + returned,
            gone=self.gone * keep + (not returned),
        )

    @property
    def returns(self) -> float:
        """The share of programs whose call ended seen back within the horizon here, nothing
        before the first (``PRIOR_GONE``)."""
        return self.returned / (self.returned + self.gone + PRIOR_GONE)

    @property
    def seen_returns(self) -> bool:
        """Whether at least ``RETURNS_TO_HOLD`` of the programs whose call ended came back
        within the horizon here: only then does holding keep caches worth keeping."""
        return self.returns >= RETURNS_TO_HOLD

    def observe_prefill(
        self, uncached_tokens: int, seconds: float, cached_tokens: int = 0
    ) -> HoldLedger:
        """A call's first token came ``seconds`` after it was sent, for ``uncached_tokens`` of
        prefill after ``cached_tokens`` found in the cache."""
        if uncached_tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return self
        rate = seconds / uncached_tokens
        ledger = self
        if self.prefill_s_per_token is None or rate < self.prefill_s_per_token:
            ledger = replace(ledger, prefill_s_per_token=rate)
        # A prefill after a long cached context spends its time attending to it: it says what
        # a short prompt costs there, not what recomputing a history of its length does.
        if max(0, cached_tokens) <= uncached_tokens:
            k = _length_index(uncached_tokens)
            fastest = ledger.prefill_by_length[k]
            if fastest is None or rate < fastest:
                lengths = list(ledger.prefill_by_length)
                lengths[k] = rate
                ledger = replace(ledger, prefill_by_length=tuple(lengths))
        return ledger

    def recompute_s_per_token(self, tokens: int) -> float:
        """Seconds per token to prefill ``tokens`` of history again (0 before any prefill was
        seen). Attention makes a long prefill dearer per token than a short one: on vLLM's CPU
        build with a 4-layer model, 90 µs per token at 1K tokens, 274 at 8K and 511 at 16K.
        Priced at the fastest rate seen (119.5 µs, from short prompts), the 14K histories of
        the demo's workload replayed on that engine's profile looked a third of what the
        prefills of 8K to 16K tokens took there (389 µs a token), and the ledger stopped
        holding 1,354 s in where holding paid (12.8 steps/min against 14.6 holding
        throughout). The rate is the fastest seen at that length, at least that of any shorter
        length (the cost per token does not fall as prompts grow) and at most twice that of
        the next shorter length seen (at worst it grows with the length: quadratic work), so
        that one slow observation, a call that also waited in the engine's queue, cannot price
        a length on its own."""
        rate = self.prefill_s_per_token
        if rate is None:
            return 0.0
        for fastest in self.prefill_by_length[: _length_index(tokens) + 1]:
            if fastest is not None:
                rate = min(max(rate, fastest), 2 * rate)
        return rate

    @property
    def cost_on(self) -> float | None:
        return self.on.mean if self.on.n else None

    @property
    def cost_off(self) -> float | None:
        return self.off.mean if self.off.n else None

    @property
    def estimate_off(self) -> float | None:
        """What a call would cost without holding, before that has been measured: its cost
        with holding, plus the gain holding was measured to bring."""
        if not self.on.n or not self.gain.n:
            return None
        return self.on.mean + self.gain.mean

    def inputs(self) -> dict[str, float]:
        """What the decision rests on, for the decision log."""

        def r(value: float | None, digits: int = 3) -> float:
            return -1.0 if value is None else round(value, digits)

        return {
            "calls": self.calls,
            "calls_off": self.calls_off,
            "returns": r(self.returns, 4),
            "returned": r(self.returned, 1),
            "gone": r(self.gone, 1),
            "reuse_tokens": r(self.reuse_tokens, 0),
            "prefill_us_per_token": r((self.prefill_s_per_token or 0.0) * 1e6),
            "in_flight": r(self.in_flight, 2),
            "cost_on_s": r(self.cost_on),
            "cost_on_se_s": r(math.sqrt(self.on.se2) if self.on.n else None),
            "cost_off_s": r(self.cost_off),
            "cost_off_se_s": r(math.sqrt(self.off.se2) if self.off.n else None),
            "gain_s": r(self.gain.mean if self.gain.n else None),
            "gain_se_s": r(math.sqrt(self.gain.se2) if self.gain.n else None),
            "engine_queue_s": r(self.queued_s),
            "displaced": r(self.displaced),
        }
