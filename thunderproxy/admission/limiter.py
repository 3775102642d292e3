"""The limiter, pure: fixed windows per model and program class, reservations made at
admission and settled with the reported usage at completion, and the class shares.

Nothing here reads a clock or does I/O: every method takes ``now``. Windows are fixed and
aligned on ``now`` (minute ``floor(now / 60)``, day ``floor(now / 86400)``), so instances that
pass the same clock agree on them; a limit therefore holds in every window, and a burst at a
boundary can use two windows' worth across it (the price of O(1) counters that one Redis
round trip can update).

Capacity: a model's limit times this instance's ``share`` (1 alone; 1/n of n live instances),
then each class's ``ratio`` of that. A fixed class keeps exactly its part. A flexible class may
also use what other flexible classes leave unused, except a class that has callers waiting:
a lender with demand takes its part back at once (what was lent inside the current window stays
spent until the window closes; concurrency comes back as calls end).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..config.limits import ClassSpec, LimitsSpec, ModelLimits, most_of

MINUTE = 60.0
DAY = 86_400.0

#: Dimension -> (window size, counts tokens). ``concurrent`` has no window.
WINDOWED: Mapping[str, tuple[float, bool]] = {
    "rpm": (MINUTE, False),
    "tpm": (MINUTE, True),
    "rpd": (DAY, False),
    "tpd": (DAY, True),
}
DIMENSIONS = (*WINDOWED, "concurrent")


def window_index(now: float, size: float) -> int:
    return math.floor(now / size)


def window_end(now: float, size: float) -> float:
    return (window_index(now, size) + 1) * size


@dataclass
class Counter:
    """Requests and tokens counted in one fixed window; a new window starts from zero."""

    size: float
    index: int = -1
    requests: int = 0
    tokens: int = 0

    def at(self, now: float) -> Counter:
        index = window_index(now, self.size)
        if index != self.index:
            self.index, self.requests, self.tokens = index, 0, 0
        return self


@dataclass
class ClassUsage:
    """One class's use of one model on this instance."""

    minute: Counter = field(default_factory=lambda: Counter(MINUTE))
    day: Counter = field(default_factory=lambda: Counter(DAY))
    concurrent: int = 0

    def used(self, dimension: str, now: float) -> int:
        if dimension == "concurrent":
            return self.concurrent
        size, tokens = WINDOWED[dimension]
        counter = (self.minute if size == MINUTE else self.day).at(now)
        return counter.tokens if tokens else counter.requests


@dataclass(frozen=True)
class Verdict:
    """Whether a call fits now and, when not, which limit stops it and when it may fit."""

    admitted: bool
    dimension: str | None = None
    #: The capacity the call was measured against (the model's, or its class's with loans).
    limit: float | None = None
    used: int | None = None
    need: int = 0
    #: When the binding window closes (None: when a running call ends).
    retry_at: float | None = None
    #: The call can never fit: it alone needs more than the whole capacity.
    never: bool = False
    #: Whose limit held it: ``model`` (the model's, split among classes), ``backend`` or
    #: ``client`` (limits of their own, for every model and class together).
    scope: str = "model"


@dataclass(frozen=True)
class Reservation:
    """What an admitted call holds: its model, class, tokens and the windows it counted in."""

    model: str
    klass: str
    tokens: int
    minute: int
    day: int
    #: The backend it was also counted on (one with limits of its own), else None.
    backend: str | None = None
    #: The client it was also counted on (one with limits of its own), else None.
    client: str | None = None


@dataclass(frozen=True)
class Settlement:
    """How a finished call's reservation was settled: tokens given back, tokens added."""

    refund: int = 0
    overage: int = 0
    #: True when the call ended in a later minute than it started: no refund possible.
    late: bool = False


class Limiter:
    """Counters for every limited model and class of one instance."""

    def __init__(self, spec: LimitsSpec) -> None:
        self.spec = spec
        #: This instance's part of every model's capacity (1/n of n live instances).
        self.share = 1.0
        self._usage: dict[tuple[str, str], ClassUsage] = {}
        #: Per backend with limits of its own: its use by every model and class together.
        self._backends: dict[str, ClassUsage] = {}
        #: A backend's URL and name both find its limits.
        self._backend_limits = dict(spec.backends)
        #: Per client with limits of its own: its use of every model and class together.
        self._clients: dict[str, ClassUsage] = {}

    def set_share(self, share: float) -> None:
        self.share = share

    def limits(self, model: str) -> ModelLimits | None:
        return self.spec.models.get(model)

    def backend_limits(self, backend: str | None) -> ModelLimits | None:
        return None if backend is None else self._backend_limits.get(backend)

    def name_backend(self, url: str, name: str | None) -> None:
        """Let limits written under a backend's name apply to its URL (what placement gives)."""
        if name is not None and name in self.spec.backends:
            self._backend_limits[url] = self.spec.backends[name]

    def backend_usage(self, backend: str) -> ClassUsage:
        if backend not in self._backends:
            self._backends[backend] = ClassUsage()
        return self._backends[backend]

    def client_limits(self, client: str | None) -> ModelLimits | None:
        return None if client is None else self.spec.clients.get(client)

    def client_usage(self, client: str) -> ClassUsage:
        if client not in self._clients:
            self._clients[client] = ClassUsage()
        return self._clients[client]

    def check_backend(self, backend: str | None, tokens: int, now: float) -> Verdict:
        """Whether a call needing ``tokens`` fits ``backend``'s own limits (this instance's
        share of them) now; a backend without limits always fits."""
        limits = self.backend_limits(backend)
        if backend is None or limits is None:
            return Verdict(True)
        return self._check_own(limits, self.backend_usage(backend), tokens, now, "backend")

    def check_client(self, client: str | None, tokens: int, now: float) -> Verdict:
        """Whether a call needing ``tokens`` fits its ``client``'s own limits (this instance's
        share of them) now, for every model and class together; a client without limits (or
        no client) always fits."""
        limits = self.client_limits(client)
        if client is None or limits is None:
            return Verdict(True)
        return self._check_own(limits, self.client_usage(client), tokens, now, "client")

    def _check_own(
        self, limits: ModelLimits, usage: ClassUsage, tokens: int, now: float, scope: str
    ) -> Verdict:
        """Limits not split among classes (a backend's, a client's) against their one usage."""
        for dimension in DIMENSIONS:
            limit = getattr(limits, dimension)
            if limit is None:
                continue
            size = WINDOWED[dimension][0] if dimension in WINDOWED else None
            need = tokens if WINDOWED.get(dimension, (0, False))[1] else 1
            capacity = self._capacity(limit)
            used = usage.used(dimension, now)
            if used + need > capacity:
                retry_at = None if size is None else window_end(now, size)
                never = need > capacity
                return Verdict(False, dimension, capacity, used, need, retry_at, never, scope)
        return Verdict(True)

    def usage(self, model: str, klass: str) -> ClassUsage:
        key = (model, klass)
        if key not in self._usage:
            self._usage[key] = ClassUsage()
        return self._usage[key]

    def _capacity(self, limit: int) -> float:
        return limit * self.share

    def check(
        self, model: str, klass: ClassSpec, tokens: int, now: float, hungry: Iterable[str] = ()
    ) -> Verdict:
        """Whether a call of ``klass`` needing ``tokens`` fits ``model`` now. ``hungry``: the
        classes with callers waiting on this model (they lend nothing)."""
        limits = self.limits(model)
        if limits is None:
            return Verdict(True)
        hungry = frozenset(hungry)
        for dimension in DIMENSIONS:
            limit = getattr(limits, dimension)
            if limit is None:
                continue
            need = tokens if WINDOWED.get(dimension, (0, False))[1] else 1
            verdict = self._fits(model, klass, dimension, self._capacity(limit), need, now, hungry)
            if not verdict.admitted:
                return verdict
        return Verdict(True)

    def _fits(
        self,
        model: str,
        klass: ClassSpec,
        dimension: str,
        capacity: float,
        need: int,
        now: float,
        hungry: frozenset[str],
    ) -> Verdict:
        retry_at = window_end(now, WINDOWED[dimension][0]) if dimension in WINDOWED else None
        used = {c.name: self.usage(model, c.name).used(dimension, now) for c in self.spec.classes}
        total = sum(used.values())
        part = capacity * klass.ratio
        allowed = part
        if klass.flexible:
            allowed += sum(
                max(0.0, capacity * c.ratio - used[c.name])
                for c in self.spec.classes
                if c.flexible and c.name != klass.name and c.name not in hungry
            )
        # The whole model's capacity bounds every class, loans included.
        if total + need > capacity:
            never = need > capacity
            return Verdict(False, dimension, capacity, total, need, retry_at, never)
        if used[klass.name] + need > allowed:
            # The most the class can ever have: its part, plus, when flexible, every other
            # flexible class's part lent whole. A call past that waits for nothing.
            most = capacity * most_of(klass, self.spec.classes)
            if need > most + 1e-9:
                return Verdict(False, dimension, most, used[klass.name], need, retry_at, True)
            return Verdict(False, dimension, allowed, used[klass.name], need, retry_at)
        return Verdict(True, dimension, allowed, used[klass.name], need)

    def reserve(
        self,
        model: str,
        klass: str,
        tokens: int,
        now: float,
        backend: str | None = None,
        client: str | None = None,
    ) -> Reservation:
        """Count an admitted call: one request and its estimated tokens, one running call; on
        ``backend`` and on ``client`` too when they have limits of their own."""
        counted = None if self.backend_limits(backend) is None else backend
        by = None if self.client_limits(client) is None else client
        usages = [self.usage(model, klass)]
        if counted is not None:
            usages.append(self.backend_usage(counted))
        if by is not None:
            usages.append(self.client_usage(by))
        for usage in usages:
            minute, day = usage.minute.at(now), usage.day.at(now)
            minute.requests += 1
            minute.tokens += tokens
            day.requests += 1
            day.tokens += tokens
            usage.concurrent += 1
        return Reservation(model, klass, tokens, minute.index, day.index, counted, by)

    def _usages(self, reservation: Reservation) -> list[ClassUsage]:
        usages = [self.usage(reservation.model, reservation.klass)]
        if reservation.backend is not None:
            usages.append(self.backend_usage(reservation.backend))
        if reservation.client is not None:
            usages.append(self.client_usage(reservation.client))
        return usages

    def cancel(self, reservation: Reservation, now: float) -> None:
        """Take back a reservation that was never used (the shared counters refused it)."""
        for usage in self._usages(reservation):
            usage.concurrent = max(0, usage.concurrent - 1)
            for counter, index in (
                (usage.minute, reservation.minute),
                (usage.day, reservation.day),
            ):
                if counter.at(now).index == index:
                    counter.requests = max(0, counter.requests - 1)
                    counter.tokens = max(0, counter.tokens - reservation.tokens)

    def settle(self, reservation: Reservation, tokens: int | None, now: float) -> Settlement:
        """The call ended: it no longer runs, and its reported ``tokens`` (prompt + completion)
        replace the estimate. A window already closed keeps what it counted (no refund); an
        overage is always counted, in the window that is open now. Without a report (a failed
        call) the reservation stands: it may have used what it reserved."""
        usages = self._usages(reservation)
        for usage in usages:
            usage.concurrent = max(0, usage.concurrent - 1)
        if tokens is None:
            return Settlement()
        delta = tokens - reservation.tokens
        late = False
        for usage in usages:
            for counter, index in (
                (usage.minute, reservation.minute),
                (usage.day, reservation.day),
            ):
                same = counter.at(now).index == index
                if same or delta > 0:
                    counter.tokens = max(0, counter.tokens + delta)
                if counter is usage.minute:
                    late = not same
        if delta > 0:
            return Settlement(overage=delta, late=late)
        return Settlement(refund=0 if late else -delta, late=late)


__all__ = [
    "DAY",
    "DIMENSIONS",
    "MINUTE",
    "ClassUsage",
    "Counter",
    "Limiter",
    "Reservation",
    "Settlement",
    "Verdict",
    "window_end",
    "window_index",
]
