"""The proxy's own file descriptors. Running out of them (``EMFILE``: the process's limit,
``ENFILE``: the system's) is the proxy's trouble, never a backend's: a connect that fails for
it says nothing about the backend, and an accept that fails for it nothing about the client.

Every place that meets it calls :func:`note_out`; it is counted, logged at most once a minute
(``causes.CauseLog``: a listener retrying ten times a second would otherwise write ten lines a
second), and makes ``/health`` say ``degraded`` for ``RECENT_S`` after the last time, or while
fewer than ``RESERVE`` descriptors are left under the limit. The record is per trio run (a
``RunVar``): descriptors are the process's, and trio's clock is the run's.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
from dataclasses import dataclass, field

import trio

from .causes import CauseLog

log = logging.getLogger("thunderproxy.descriptors")

#: The errors that mean the proxy itself has no descriptor to give.
OUT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})
#: ``/health`` says ``degraded`` this long after the proxy last failed to open a descriptor
#: (the accept loop retries every 0.1 s while it lasts, so a longer gap means it is over).
RECENT_S = 2.0
#: Fewer descriptors than this left under the limit is as good as out: the next burst of
#: connections fails.
RESERVE = 16
#: The one cause the log tells, once a minute at most, with the places it happened.
_CAUSE = "out of file descriptors"
_REMEDY = (
    "raise the proxy's limit (ulimit -n, systemd's LimitNOFILE=) or have clients hold fewer "
    "idle connections; no backend is taken out for it"
)


def out_error(exc: BaseException) -> OSError | None:
    """The OSError that says the proxy ran out of descriptors, if ``exc`` is one or was raised
    from one (httpx wraps it twice; trio's ``open_tcp_stream`` raises from a group of its
    attempts' errors); else None."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in OUT_ERRNOS:
            return current
        if isinstance(current, BaseExceptionGroup):
            todo.extend(current.exceptions)
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return None


@dataclass(frozen=True)
class Usage:
    """Descriptors open and the soft limit, as read from ``/proc/self/fd`` and getrlimit."""

    open: int
    limit: int

    @property
    def left(self) -> int:
        return self.limit - self.open


@dataclass
class Descriptors:
    """What the proxy met of its descriptor limit in this run."""

    #: When (trio time) an open, accept or connect last failed for want of a descriptor.
    last_out_at: float | None = None
    #: Where, and with which error.
    last_where: str = ""
    last_error: str = ""
    #: Every such failure, counted (also those the log leaves out).
    refused: int = 0
    _told: CauseLog = field(default_factory=CauseLog)

    def out(self, where: str, error: OSError, now: float) -> None:
        """One failure for want of a descriptor, at ``where`` (``accepting a connection``,
        ``connecting to http://b:8000``)."""
        self.refused += 1
        self.last_out_at = now
        self.last_where = where
        self.last_error = errno.errorcode.get(error.errno or 0, str(error.errno))
        told = self._told.note(_CAUSE, where, now)
        if told is None:
            return
        if told.since_s is None:
            log.error(
                "the proxy is out of file descriptors (%s) %s: %s. Further failures are "
                "counted and told once a minute.",
                self.last_error,
                where,
                _REMEDY,
            )
            return
        places = ", ".join(f"{detail} ({count})" for detail, count in told.details)
        log.error(
            "the proxy is still out of file descriptors (%s): %d failures in the last %.0f s, "
            "at %s; %s.",
            self.last_error,
            told.count,
            told.since_s,
            places,
            _REMEDY,
        )

    def problem(self, now: float, usage: Usage | None) -> str | None:
        """Why the proxy is degraded for its descriptors at ``now``, or None (pure)."""
        shown = "" if usage is None else f" ({usage.open} of {usage.limit} open)"
        since = None if self.last_out_at is None else now - self.last_out_at
        if since is not None and since < RECENT_S:
            return (
                f"the proxy is out of file descriptors{shown}: {self.last_error} {since:.1f} s "
                f"ago {self.last_where}; connections are refused meanwhile. To fix: {_REMEDY}."
            )
        if usage is not None and usage.left < RESERVE:
            return (
                f"the proxy is nearly out of file descriptors{shown}: the next connections "
                f"will be refused. To fix: {_REMEDY}."
            )
        return None

    def as_dict(self, now: float, usage: Usage | None) -> dict[str, object]:
        """What ``/health`` shows as ``descriptors``."""
        since = None if self.last_out_at is None else now - self.last_out_at
        return {
            "open": None if usage is None else usage.open,
            "limit": None if usage is None else usage.limit,
            "refused": self.refused,
            "last_refused_s": None if since is None else round(since, 1),
            "problem": self.problem(now, usage),
        }


_CURRENT: trio.lowlevel.RunVar[Descriptors] = trio.lowlevel.RunVar("descriptors")


def current() -> Descriptors:
    """This trio run's record."""
    try:
        return _CURRENT.get()
    except LookupError:
        record = Descriptors()
        _CURRENT.set(record)
        return record


def note_out(where: str, error: OSError) -> None:
    """Count and (once a minute) log a failure for want of a descriptor, at trio's now."""
    current().out(where, error, trio.current_time())


def usage() -> Usage | None:
    """Descriptors open now and the soft limit; None where ``/proc`` cannot tell (not Linux).
    Reading ``/proc/self/fd`` takes a descriptor itself: when none is left that is counted as
    a failure, and the count is the limit."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        found = len(os.listdir("/proc/self/fd")) - 1  # less the one listing it
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno not in OUT_ERRNOS:
            return None
        note_out("reading its own descriptor count", exc)
        return Usage(limit, limit)
    return Usage(found, limit)


class _AcceptLog(logging.Filter):
    """trio's ``serve_listeners`` (Hypercorn's accept loop) logs an ERROR, with a traceback,
    every 0.1 s while accept fails for want of a descriptor: each becomes a :func:`note_out`
    instead, told once a minute."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        name = args[0] if isinstance(args, tuple) and args else None
        code = getattr(errno, name, None) if isinstance(name, str) else None
        if code not in OUT_ERRNOS:
            return True
        try:
            note_out("accepting a connection", OSError(code, os.strerror(code)))
        except RuntimeError:  # logged outside a trio run: leave the line as it is
            return True
        return False


_ACCEPT_LOG = _AcceptLog()


def quiet_trio_accept_log() -> None:
    """Route trio's accept-loop errors for want of a descriptor through :func:`note_out`."""
    logging.getLogger("trio.serve_listeners").addFilter(_ACCEPT_LOG)
