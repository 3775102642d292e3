"""Whether holding programs back pays on a backend, learned from what its calls show: a pure,
frozen value with ``observe_*`` methods that return the next one (no clock, no I/O).

tr holds a call back (a newcomer queued, a returning program paused) so that the programs
already running keep their KV cache. That saves recompute only when those programs come back
while their cache is still worth keeping; and it costs the held call its wait. The two are
measured in seconds of latency per call:

    recompute_s = returns · reuse_tokens · prefill_s_per_token · in_flight
    wait_s      = the mean wait a call had in the proxy while holding was on (0 for calls not held)

- ``returns``: the fraction of finished calls whose program called again within the
  protection horizon (``horizon_s``, after which tr no longer counts an idle program's cache).
  A program released without calling again counts as not returning.
- ``reuse_tokens``: the history a returning call carries (its program's previous prompt and
  answer): what it recomputes if its cache was evicted.
- ``prefill_s_per_token``: the fastest prefill seen recently per uncached prompt token (the
  least queued calls say most about the engine's own speed).
- ``in_flight``: calls in flight on the backend when a call goes out, plus the calls held back
  for it (without holding they would be in flight too): a second of recompute is a second
  every one of them waits for the engine.

Holding pays while ``recompute_s >= wait_s``. ``wait_s`` is learned only while holding is on
(what holding costs cannot be seen while it is off); the recompute side keeps learning, so a
backend whose programs start coming back turns holding on again. Until ``MIN_CALLS`` calls
have been seen, or while no prefill has been measured, holding is on: tr's default.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import PolicyConfig

#: Weight of a new observation in the moving averages (about the last 64 observations).
ALPHA = 1.0 / 64
#: Calls seen before the ledger may turn holding off.
MIN_CALLS = 64
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


def _ewma(old: float, new: float) -> float:
    return old + ALPHA * (new - old)


@dataclass(frozen=True)
class HoldLedger:
    calls: int = 0
    returns: float = 1.0
    reuse_tokens: float = 0.0
    in_flight: float = 1.0
    wait_s: float = 0.0
    prefill_samples: tuple[float, ...] = ()

    def observe_call(
        self, *, waited_s: float, in_flight: int, reuse_tokens: int, holding: bool
    ) -> HoldLedger:
        """A call goes out after ``waited_s`` in the proxy, with ``in_flight`` other calls on
        its backend and ``reuse_tokens`` of its own history (0 for a first call)."""
        first = self.calls == 0  # the first observation starts each average
        reuse = self.reuse_tokens
        if reuse_tokens > 0:
            reuse = reuse_tokens if reuse == 0 else _ewma(reuse, reuse_tokens)
        busy = max(1, in_flight + 1)
        wait = max(0.0, waited_s)
        return replace(
            self,
            calls=self.calls + 1,
            reuse_tokens=reuse,
            in_flight=busy if first else _ewma(self.in_flight, busy),
            wait_s=(wait if first else _ewma(self.wait_s, wait)) if holding else self.wait_s,
        )

    def observe_return(self, returned: bool) -> HoldLedger:
        """A program's next call arrived within the horizon (True), or later or never."""
        return replace(self, returns=_ewma(self.returns, 1.0 if returned else 0.0))

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
    def recompute_s(self) -> float | None:
        rate = self.prefill_s_per_token
        if rate is None:
            return None
        return self.returns * self.reuse_tokens * rate * self.in_flight

    @property
    def pays(self) -> bool:
        recompute = self.recompute_s
        if self.calls < MIN_CALLS or recompute is None:
            return True
        return recompute >= self.wait_s

    def inputs(self) -> dict[str, float]:
        """What the decision rests on, for the decision log."""
        recompute = self.recompute_s
        return {
            "calls": self.calls,
            "returns": round(self.returns, 4),
            "reuse_tokens": round(self.reuse_tokens),
            "prefill_us_per_token": round((self.prefill_s_per_token or 0.0) * 1e6, 3),
            "in_flight": round(self.in_flight, 2),
            "recompute_s": round(recompute, 3) if recompute is not None else -1.0,
            "wait_s": round(self.wait_s, 3),
        }
