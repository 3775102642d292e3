"""A one-line progress bar on stderr while a target runs (only on a terminal, unless forced)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from ..agents.agent import RunLog

#: Least wall seconds between two redraws: a virtual run updates thousands of times a second.
REDRAW_S = 0.2
WIDTH = 24


class ProgressBar:
    def __init__(
        self,
        label: str,
        *,
        programs: int,
        steps: int,
        stream: TextIO | None = None,
        enabled: bool | None = None,
    ) -> None:
        self.label = label
        self.programs = max(1, programs)
        self.steps = max(1, steps)
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        # Wall time, not trio time: under the virtual clock trio time says nothing about when
        # a human last saw the bar.
        self._started = time.monotonic()
        self._last = 0.0
        self._shown = False

    def update(self, log: RunLog) -> None:
        if not self.enabled:
            return
        wall = time.monotonic()
        if wall - self._last < REDRAW_S:
            return
        self._last = wall
        self._draw(log, wall)

    def _draw(self, log: RunLog, wall: float) -> None:
        done = sum(1 for p in log.programs if p.finished_at is not None)
        steps = sum(1 for s in log.steps if s.ok)
        fraction = min(1.0, steps / self.steps)
        filled = int(fraction * WIDTH)
        bar = "#" * filled + "-" * (WIDTH - filled)
        errors = sum(1 for s in log.steps if not s.ok)
        line = (
            f"\r{self.label:<14} [{bar}] {done}/{self.programs} programs "
            f"{steps}/{self.steps} calls"
            + (f" {errors} errors" if errors else "")
            + f"  {wall - self._started:.0f}s"
        )
        self.stream.write(line)
        self.stream.flush()
        self._shown = True

    def close(self, log: RunLog | None = None) -> None:
        if not self.enabled:
            return
        if log is not None:
            self._draw(log, time.monotonic())
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
