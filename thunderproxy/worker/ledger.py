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
    #: The autoscaler's index of a signed request; None for an unsigned one.
    request_idx: int | None
    workload: float


#: Ended requests kept for the autoscaler's cleanup when it cannot be reached (oldest dropped).
MAX_DONE = 100_000


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
        #: Signed requests that ended, (request_idx, success), until an autoscaler took them
        #: (``POST /delete_requests/``); ``done_dropped`` counts those dropped past MAX_DONE.
        self.done: list[tuple[int, bool]] = []
        self.done_dropped = 0
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

    def reject(self, workload: float, request_idx: int | None = None) -> None:
        """Refused before any work: bad signature, replay, queue too long. ``request_idx``
        only for a request whose signature was valid (a forged index is nobody's)."""
        self._count(Counters(rejected=workload, requests=1))
        if request_idx is not None:
            self._done(request_idx, success=False)

    def _done(self, request_idx: int, *, success: bool) -> None:
        self.done.append((request_idx, success))
        if len(self.done) > MAX_DONE:
            del self.done[0]
            self.done_dropped += 1

    def acknowledge(self, count: int, dropped_before: int) -> None:
        """An autoscaler took the first ``count`` entries of ``done`` as they were when
        ``done_dropped`` was ``dropped_before``; remove what is still there of them."""
        remaining = count - (self.done_dropped - dropped_before)
        if remaining > 0:
            del self.done[:remaining]

    def start(self, workload: float, request_idx: int | None = None) -> Ticket:
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
        if ticket.request_idx is not None:
            # The PyWorker's meaning of success: the client got its answer or left; not an error.
            self._done(ticket.request_idx, success=outcome is not Outcome.ERRORED)
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
        return [t.request_idx for t in self.working.values() if t.request_idx is not None]

    def commit(self, reported: Counters) -> None:
        """The autoscaler accepted a report carrying ``reported``: take it off the window."""
        self.window = self.window - reported
        if self.window == Counters():
            # Exact zero once everything was reported, whatever float rounding left.
            self.window = Counters()
