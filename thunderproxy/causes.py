"""When a refusal is worth a log line: once per cause, then at most once a minute. Pure: the
caller passes the time in (trio's clock), so MockClock drives it in tests.

A client that fails (a model nobody serves, a request its backend refuses) usually retries, or
sends the same mistake on every call: one line per call would bury everything else, and no line
leaves the user with only the client's own error. So the first refusal of a cause is told at
once, and later ones of that cause are counted and told together with the next one that comes
a minute or more after the last line (every refusal is still a row in the audit db).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

#: Seconds between two lines about one cause.
EVERY_S = 60.0
#: Causes remembered; the one told longest ago goes first (a client inventing a new cause with
#: every call cannot grow this, and at worst earns a line per cause it invents).
MAX_CAUSES = 256
#: Distinct details (model names, messages) counted per cause between two lines.
MAX_DETAILS = 16


@dataclass(frozen=True)
class Told:
    """A line due about one cause: how many refusals it covers, since when, and its details
    (most frequent first, each with its count)."""

    cause: Hashable
    count: int
    #: Seconds since the previous line about this cause; None for the first.
    since_s: float | None
    details: tuple[tuple[str, int], ...]


@dataclass
class _Pending:
    told_at: float
    count: int
    details: Counter[str]


class CauseLog:
    """Which refusals to log: :meth:`note` each one; it returns the line's contents when one is
    due, else None."""

    def __init__(self, *, every_s: float = EVERY_S, max_causes: int = MAX_CAUSES) -> None:
        self.every_s = every_s
        self.max_causes = max_causes
        self._causes: OrderedDict[Hashable, _Pending] = OrderedDict()

    def note(self, cause: Hashable, detail: str, now: float) -> Told | None:
        """One refusal of ``cause`` (with ``detail``, e.g. the model name asked for) at ``now``."""
        pending = self._causes.get(cause)
        if pending is None:
            self._causes[cause] = _Pending(now, 0, Counter())
            while len(self._causes) > self.max_causes:
                self._causes.popitem(last=False)
            return Told(cause, 1, None, ((detail, 1),))
        pending.count += 1
        if detail in pending.details or len(pending.details) < MAX_DETAILS:
            pending.details[detail] += 1
        if now - pending.told_at < self.every_s:
            return None
        told = Told(
            cause, pending.count, now - pending.told_at, tuple(pending.details.most_common())
        )
        self._causes[cause] = _Pending(now, 0, Counter())
        self._causes.move_to_end(cause)
        return told
