"""Workload accounting: what the worker received, served, lost and refused, in the autoscaler's
workload units (``auth_data.cost``, 1 per unsigned request), and the wait it implies.

Counters come in two copies: ``totals`` since start, and ``window``, what the next load report
carries. A report takes a snapshot of the window; only once the autoscaler accepted it is that
snapshot subtracted, so what arrived meanwhile, or during failed reports, is never lost.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from enum import StrEnum


class Outcome(StrEnum):
    SERVED = "served"
    CANCELLED = "cancelled"
    ERRORED = "errored"


@dataclass(frozen=True)
class Counters:
    received: float = 0.0
    served: float = 0.0
    cancelled: float = 0.0
    errored: float = 0.0
    rejected: float = 0.0
    #: Requests (not workload) received, for the report's num_requests_recieved.
    requests: int = 0

    def __add__(self, other: Counters) -> Counters:
        return _combine(self, other, 1)

    def __sub__(self, other: Counters) -> Counters:
        return _combine(self, other, -1)


def _combine(a: Counters, b: Counters, sign: int) -> Counters:
    pairs = zip(dataclasses.astuple(a), dataclasses.astuple(b), strict=True)
    return Counters(*(x + sign * y for x, y in pairs))


@dataclass(frozen=True)
class Ticket:
    key: int
    request_idx: int
    workload: float


class Ledger:
    def __init__(self) -> None:
        self.totals = Counters()
        self.window = Counters()
        #: Workload admitted and not finished (queued behind --no-parallel included).
        self.pending = 0.0
        self.working: dict[int, Ticket] = {}
        #: Workload per second the backend sustains, from the benchmark; None until measured.
        self.max_throughput: float | None = None
        #: Something a report should carry happened since the last accepted report.
        self.changed = False
        self._keys = itertools.count()

    def _count(self, delta: Counters) -> None:
        self.totals = self.totals + delta
        self.window = self.window + delta
        self.changed = True

    def wait_estimate(self) -> float | None:
        """Seconds the pending workload takes at the measured throughput (None: unmeasured)."""
        if not self.max_throughput:
            return None
        return self.pending / self.max_throughput

    def would_wait_too_long(self, max_wait: float) -> float | None:
        """The estimated wait if it exceeds ``max_wait`` (the request should get 429), else
        None. Before the benchmark there is no estimate, and nothing is refused."""
        wait = self.wait_estimate()
        return wait if wait is not None and wait > max_wait else None

    def reject(self, workload: float) -> None:
        """Refused before any work: bad signature, replay, queue too long."""
        self._count(Counters(rejected=workload, requests=1))

    def start(self, workload: float, request_idx: int = 0) -> Ticket:
        ticket = Ticket(next(self._keys), request_idx, workload)
        self.working[ticket.key] = ticket
        self.pending += workload
        self._count(Counters(received=workload, requests=1))
        return ticket

    def finish(self, ticket: Ticket, outcome: Outcome) -> None:
        if self.working.pop(ticket.key, None) is None:
            return
        self.pending -= ticket.workload
        if not self.working:
            self.pending = 0.0  # no float dust once idle
        w = ticket.workload
        if outcome is Outcome.SERVED:
            self._count(Counters(served=w))
        elif outcome is Outcome.CANCELLED:
            self._count(Counters(cancelled=w))
        else:
            self._count(Counters(errored=w))

    @property
    def current_load(self) -> float:
        return sum(t.workload for t in self.working.values())

    def working_request_idxs(self) -> list[int]:
        return [t.request_idx for t in self.working.values()]

    def commit(self, reported: Counters) -> None:
        """The autoscaler accepted a report carrying ``reported``: take it off the window."""
        self.window = self.window - reported
        if self.window == Counters():
            # Exact zero once everything was reported, whatever float rounding left.
            self.window = Counters()
