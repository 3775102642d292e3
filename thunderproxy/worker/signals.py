"""Program-level load signals the worker adds to its autoscaler reports.

The autoscaler's own fields count workload; an agent proxy also knows how many programs it
holds, how much KV cache they would need against what the backends have, and how long calls
wait for room. The core hands the worker a ``Callable[[], ProgramSignals]``;
:func:`signals_from_services` builds one from today's ``Services``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from ..http.app import Services


@dataclass(frozen=True)
class ProgramSignals:
    """A snapshot of the programs the proxy holds and the KV cache they ask for."""

    #: Programs with an LLM call in flight (REASONING).
    running: int = 0
    #: Programs between calls, running tools, their cache kept (ACTING).
    acting: int = 0
    #: Programs held off the GPU by the scheduler, queued newcomers included (PAUSED).
    paused: int = 0
    #: Tokens of KV cache all tracked programs would hold if all ran at once.
    kv_demand_tokens: int = 0
    #: KV cache the backends report (sum over backends); None until a /metrics poll read it.
    kv_capacity_tokens: int | None = None
    #: 90th percentile of how long the calls waiting right now have waited, in seconds.
    queue_wait_p90_s: float = 0.0

    @property
    def kv_demand_ratio(self) -> float | None:
        """Demand over capacity: above 1, programs must take turns on the cache."""
        if not self.kv_capacity_tokens:
            return None
        return self.kv_demand_tokens / self.kv_capacity_tokens

    def as_report(self) -> dict[str, Any]:
        return {
            "programs_running": self.running,
            "programs_acting": self.acting,
            "programs_paused": self.paused,
            "kv_demand_tokens": self.kv_demand_tokens,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "kv_demand_ratio": None
            if self.kv_demand_ratio is None
            else round(self.kv_demand_ratio, 4),
            "queue_wait_p90_s": round(self.queue_wait_p90_s, 3),
        }


SignalsProvider = Callable[[], ProgramSignals]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def signals_from_services(services: Services) -> SignalsProvider:
    """The default provider: counts and capacities from ``services.snapshot()``, the one
    snapshot /health and /metrics read; KV demand and waits from the scheduler's registry,
    which that snapshot does not carry per program."""
    from ..programs import ProgramStatus

    registry = services.scheduler.registry

    def read() -> ProgramSignals:
        now = trio.current_time()
        stats = services.snapshot()
        demand = 0
        waits = []
        for program in registry:
            demand += program.total_tokens
            if program.waiting_since is not None:
                waits.append(now - program.waiting_since)
        capacities = [b.capacity_tokens for b in stats.backends if b.capacity_tokens]
        return ProgramSignals(
            running=stats.by_status[ProgramStatus.REASONING],
            acting=stats.by_status[ProgramStatus.ACTING],
            paused=stats.by_status[ProgramStatus.PAUSED],
            kv_demand_tokens=demand,
            kv_capacity_tokens=sum(c for c in capacities if c) if capacities else None,
            queue_wait_p90_s=percentile(waits, 0.9),
        )

    return read
