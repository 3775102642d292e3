"""Backend health, decided in one place from what was observed: polls and request outcomes.

A refused connection or a failed health check takes a backend out of placement at once; a
timeout, which one slow request can explain, does so only when repeated; any success brings it
back. The proxy's own lack of file descriptors (``OutOfDescriptors``) is none of the backend's
doing and counts for nothing here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..errors import BackendError, BackendUnavailable, OutOfDescriptors

log = logging.getLogger("thunderproxy.backends")

#: Consecutive timeouts after which a backend is treated as down until it answers again.
FAILURES_BEFORE_UNHEALTHY = 3


@dataclass
class Health:
    """One backend's health. Each change of ``healthy`` is logged once, here: a WARNING with
    the cause when the backend is taken out, an INFO when it is back; the failures between
    (every call refused while it is down, every failed poll) log nothing more."""

    #: Optimistic until a poll or a request says otherwise, so the first request is not refused.
    healthy: bool = True
    #: Consecutive failures; reset by any success.
    failures: int = 0
    last_error: str | None = None
    #: The backend's URL (credentials removed), for the log.
    backend: str = ""
    #: What took it out, kept for the line that says it is back.
    cause: str | None = None

    def ok(self) -> None:
        if not self.healthy:
            log.info(
                "backend %s is healthy again; it had been taken out by: %s",
                self.backend,
                self.cause,
            )
            self.cause = None
        self.healthy = True
        self.failures = 0
        self.last_error = None

    def down(self, error: str) -> None:
        """The backend is down: it refused a connection or failed its health check."""
        self.failures += 1
        self.last_error = error
        self._out(error)

    def slow(self, error: str) -> None:
        """A probe or request timed out: only several in a row take the backend out."""
        self.failures += 1
        self.last_error = error
        if self.failures >= FAILURES_BEFORE_UNHEALTHY:
            self._out(f"{self.failures} timeouts in a row, the last: {error}")

    def _out(self, cause: str) -> None:
        if self.healthy:
            log.warning(
                "backend %s is unhealthy; no call is placed on it until it answers again: %s",
                self.backend,
                cause,
            )
            self.cause = cause
        self.healthy = False

    def answered(self, status: int) -> None:
        """A request got an HTTP answer: below 500 the backend works."""
        if status < 500:
            self.failures = 0

    def failed(self, error: BackendError) -> None:
        """A request or probe failed with ``error`` before the backend answered it: a refused
        or dropped connection means down, anything else (a timeout) may be one slow answer.
        A connection the proxy could not open for want of a file descriptor says nothing
        about the backend: 1,100 idle client connections under ``ulimit -n 1024`` once took a
        healthy backend out for every call of the next seconds."""
        if isinstance(error, OutOfDescriptors):
            return
        if isinstance(error, BackendUnavailable):
            self.down(error.message)
        else:
            self.slow(error.message)
