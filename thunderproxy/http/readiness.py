"""Whether the proxy serves LLM calls yet. The port opens at once; until the backends have
answered /health (or --ready-timeout has passed) calls that need a backend are refused with
:class:`NotReady` (503 and Retry-After), so clients retry instead of failing on a cold start."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import NotReady

#: What a refused client is told to wait: the start-up wait polls /health twice a second.
RETRY_AFTER_S = 1.0


class Readiness:
    """Not ready while ``waiting_for`` is set: it names the backends still waited on. Built
    ready (no argument) for code that starts its backends itself."""

    def __init__(self, waiting_for: Callable[[], Sequence[str]] | None = None) -> None:
        self._waiting_for = waiting_for

    @property
    def ready(self) -> bool:
        return self._waiting_for is None

    def set_ready(self) -> None:
        self._waiting_for = None

    def reason(self) -> str | None:
        """Why LLM calls are refused, or None when they are not."""
        if self._waiting_for is None:
            return None
        waiting = list(self._waiting_for())
        if not waiting:
            return "thunderproxy is starting: reading the backends' metrics; retry in a moment."
        return (
            "thunderproxy is starting: waiting for backends to answer /health: "
            f"{', '.join(waiting)} (at most --ready-timeout seconds); retry in a moment."
        )

    def check(self) -> None:
        """Raise :class:`NotReady` while not ready."""
        reason = self.reason()
        if reason is not None:
            raise NotReady(reason, retry_after_s=RETRY_AFTER_S)
