"""Wall-clock stamps for the audit log, derived from trio's clock.

Scheduling reads only ``trio.current_time()`` (so MockClock can drive it); humans reading the
audit log want Unix times. The offset between the two is read once, when the run starts.
"""

from __future__ import annotations

import time

import trio


class WallClock:
    def __init__(self) -> None:
        self._offset = time.time() - trio.current_time()

    def unix(self, trio_time: float) -> float:
        return trio_time + self._offset

    def now(self) -> float:
        """The current trio time (not Unix); named so call sites read naturally."""
        return trio.current_time()
