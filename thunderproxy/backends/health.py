"""Backend health, decided in one place from what was observed: polls and request outcomes.

A refused connection or a failed health check takes a backend out of placement at once; a
timeout, which one slow request can explain, does so only when repeated; any success brings it
back.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BackendError, BackendUnavailable

#: Consecutive timeouts after which a backend is treated as down until it answers again.
FAILURES_BEFORE_UNHEALTHY = 3


@dataclass
class Health:
    #: Optimistic until a poll or a request says otherwise, so the first request is not refused.
    healthy: bool = True
    #: Consecutive failures; reset by any success.
    failures: int = 0
    last_error: str | None = None

    def ok(self) -> None:
        self.healthy = True
        self.failures = 0
        self.last_error = None

    def down(self, error: str) -> None:
        """The backend is down: it refused a connection or failed its health check."""
        self.healthy = False
        self.failures += 1
        self.last_error = error

    def slow(self, error: str) -> None:
        """A probe or request timed out: only several in a row take the backend out."""
        self.failures += 1
        self.last_error = error
        if self.failures >= FAILURES_BEFORE_UNHEALTHY:
            self.healthy = False

    def answered(self, status: int) -> None:
        """A request got an HTTP answer: below 500 the backend works."""
        if status < 500:
            self.failures = 0

    def failed(self, error: BackendError) -> None:
        """A request or probe failed with ``error`` before the backend answered it: a refused
        or dropped connection means down, anything else (a timeout) may be one slow answer."""
        if isinstance(error, BackendUnavailable):
            self.down(error.message)
        else:
            self.slow(error.message)
