"""Whether holding programs back pays on a backend, learned from what its calls show: a pure,
frozen value with ``observe_*`` methods that return the next one (no clock, no I/O).

tr holds a call back (a newcomer queued, a returning program paused) so that the programs
already running keep their KV cache. That saves recompute only when those programs come back
while their cache is still kept; and it costs the held call its wait. Both are measured per
call, in seconds of latency:

    cost of a call = its wait in the proxy
                   + its own history it found evicted · prefill_s_per_token · in_flight

- ``prefill_s_per_token``: the fastest prefill seen recently per uncached prompt token (the
  least queued calls say most about the engine's own speed).
- ``in_flight``: calls on the backend when the call goes out, those held back for it included
  (without holding they would be in flight too): a second of recompute is a second every one
  of them waits for the engine.

The ledger keeps the mean cost of calls made while holding (``cost_on``) and while not
(``cost_off``), each learned only in its own state. Holding pays while ``cost_off >=
cost_on``. Before ``cost_off`` has been measured it is estimated from what holding protects:

    estimate = returns · reuse_tokens · prefill_s_per_token · in_flight

``returns`` is the share of finished calls whose program called again within the protection
horizon (``horizon_s``, after which tr no longer counts an idle program's cache; a program
released without calling again did not return), ``reuse_tokens`` the history a returning call
carries. The estimate counts one recompute per returning call; evictions that cascade (each
recompute evicting another program that comes back) it does not see. So it stops holding only
where holding costs ``ESTIMATE_MARGIN`` times more (64 short SWE-agent programs: 3.1 s estimated
against 3.8 s of waiting, and letting go of the hold there lowered the hit rate), and once
holding has stopped, it stays off for ``MIN_CALLS`` calls and the measured ``cost_off``
decides: after ``MIN_CALLS`` calls
without holding the ledger compares measured against measured, and so holding comes back
where releasing it made calls recompute more than holding made them wait.

Until ``MIN_CALLS`` calls have been seen, or while no prefill has been measured, holding is
on: tr's default.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import PolicyConfig

#: Weight of a new observation in the moving averages (about the last 64 observations).
ALPHA = 1.0 / 64
#: Calls seen (in all, and in the state without holding) before the ledger trusts its means.
MIN_CALLS = 64
#: The estimate is a lower bound (one recompute per returning call, no cascade): on its own it
#: stops holding only where holding costs this many times more.
ESTIMATE_MARGIN = 2.0
#: Recent prefill samples kept; the fastest of them is the engine's rate.
PREFILL_SAMPLES = 64
#: Calls with fewer uncached prompt tokens than this say more about overheads than prefill.
MIN_PREFILL_TOKENS = 1024


def horizon_s(cfg: PolicyConfig) -> float:
    """How long after its call ends a program's cache still counts in tr's capacity model:
    four half-lives (its claim is then a sixteenth); without decay, the idle lease."""
    if cfg.acting_half_life_s > 0:
        return 4 * cfg.acting_half_life_s
    return cfg.idle_lease_s


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


@dataclass(frozen=True)
class HoldLedger:
    calls: int = 0
    returns: float = 1.0
    reuse_tokens: float | None = None
    in_flight: float | None = None
    #: Mean cost of a call (wait + recompute of its own evicted history) while holding.
    cost_on: float | None = None
    #: The same while not holding, and how many calls it rests on.
    cost_off: float | None = None
    calls_off: int = 0
    prefill_samples: tuple[float, ...] = ()

    def observe_call(
        self,
        *,
        waited_s: float,
        in_flight: int,
        reuse_tokens: int,
        missed_tokens: int,
        holding: bool,
    ) -> HoldLedger:
        """A call went out after ``waited_s`` in the proxy, with ``in_flight`` other calls on
        (or held for) its backend, carrying ``reuse_tokens`` of its own history (0 for a first
        call) of which ``missed_tokens`` were not in the cache."""
        busy = max(1, in_flight + 1)
        rate = self.prefill_s_per_token or 0.0
        cost = max(0.0, waited_s) + max(0, missed_tokens) * rate * busy
        reuse = self.reuse_tokens
        if reuse_tokens > 0:
            reuse = _ewma(reuse, reuse_tokens)
        return replace(
            self,
            calls=self.calls + 1,
            reuse_tokens=reuse,
            in_flight=_ewma(self.in_flight, busy),
            cost_on=_ewma(self.cost_on, cost) if holding else self.cost_on,
            cost_off=self.cost_off if holding else _ewma(self.cost_off, cost),
            calls_off=self.calls_off + (not holding),
        )

    def observe_return(self, returned: bool) -> HoldLedger:
        """A program's next call arrived within the horizon (True), or later or never."""
        return replace(self, returns=self.returns + ALPHA * (float(returned) - self.returns))

    def observe_prefill(self, uncached_tokens: int, seconds: float) -> HoldLedger:
        """A call's first token came ``seconds`` after it was sent, for ``uncached_tokens``."""
        if uncached_tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return self
        rate = seconds / uncached_tokens
        return replace(
            self, prefill_samples=(*self.prefill_samples[-(PREFILL_SAMPLES - 1) :], rate)
        )

    @property
    def prefill_s_per_token(self) -> float | None:
        return min(self.prefill_samples) if self.prefill_samples else None

    @property
    def estimate_off(self) -> float | None:
        """What a call would cost without holding, before that has been measured."""
        rate = self.prefill_s_per_token
        if rate is None or self.in_flight is None:
            return None
        # No call has come back with history yet: there is nothing holding protects.
        return self.returns * (self.reuse_tokens or 0.0) * rate * self.in_flight

    @property
    def measured_off(self) -> bool:
        return self.cost_off is not None and self.calls_off >= MIN_CALLS

    @property
    def pays(self) -> bool:
        if self.calls < MIN_CALLS or self.cost_on is None:
            return True
        if self.measured_off:
            assert self.cost_off is not None
            return self.cost_off >= self.cost_on
        if self.calls_off:
            # Holding has stopped and calls are being measured without it: the estimate near
            # its threshold would otherwise turn it on and off call after call, each time
            # pausing and resuming many programs at once.
            return False
        estimate = self.estimate_off
        return estimate is None or estimate * ESTIMATE_MARGIN >= self.cost_on

    def inputs(self) -> dict[str, float]:
        """What the decision rests on, for the decision log."""

        def r(value: float | None, digits: int = 3) -> float:
            return -1.0 if value is None else round(value, digits)

        return {
            "calls": self.calls,
            "calls_off": self.calls_off,
            "returns": r(self.returns, 4),
            "reuse_tokens": r(self.reuse_tokens, 0),
            "prefill_us_per_token": r((self.prefill_s_per_token or 0.0) * 1e6),
            "in_flight": r(self.in_flight, 2),
            "cost_on_s": r(self.cost_on),
            "cost_off_s": r(self.cost_off),
            "estimate_off_s": r(self.estimate_off),
        }
