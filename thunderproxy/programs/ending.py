"""When a program nobody released has ended, as far as capacity goes: a pure rule.

Most agent frameworks never call ``/programs/release``: the proxy learns that a program ended
only from its silence, and the idle lease (``idle_lease``, 600 s by default) is a bound for
forgetting it, not for counting it. Until the lease ran out, a finished program would still
count as an acting program holding its whole context on its backend, and new programs would be
placed away from the backend it finished on: the one where room was just made.

A program is presumed ended when it has been acting (waiting for its tool, no call in flight,
no request waiting) for longer than any tool gap it has shown would explain:
``ENDED_GAP_FACTOR`` times its longest, and never less than ``ENDED_FLOOR_S``. It stays tracked:
a call of it takes it back as it was (its backend, its history), and only the idle lease
retires it.
"""

from __future__ import annotations

#: Silence (seconds) that never by itself presumes a program ended: a program's first tool
#: call has no gap to go by, and tool calls of a minute are common.
ENDED_FLOOR_S = 60.0
#: How many times its longest tool gap a program must be silent to be presumed ended.
ENDED_GAP_FACTOR = 4.0


def ended_after(longest_tool_s: float) -> float:
    """Seconds of silence after which a program whose longest tool gap was
    ``longest_tool_s`` is presumed ended."""
    return max(ENDED_FLOOR_S, ENDED_GAP_FACTOR * max(0.0, longest_tool_s))


def presumed_ended(
    *, acting_since: float | None, longest_tool_s: float, in_flight: int, waiting: bool, now: float
) -> bool:
    """Whether an acting program has been silent long enough to be presumed ended at ``now``."""
    if acting_since is None or in_flight or waiting:
        return False
    return now - acting_since >= ended_after(longest_tool_s)
