"""Restoring the program registry from the audit log after a restart.

Every program whose last logged transition is not ``stopped`` comes back with its backend,
step count and KV footprint, as ACTING (a call in flight died with the old process) or PAUSED,
and with its idle time carried over so the idle lease keeps counting.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..audit.history import LiveProgram, live_programs
from .state import Program, ProgramStatus


@dataclass(frozen=True)
class RestoredProgram:
    """A program live at the end of the db's history (``row``, as recorded) and the status it
    comes back in."""

    row: LiveProgram
    status: ProgramStatus
    previous_status: ProgramStatus


def load(path: str) -> list[RestoredProgram]:
    """Programs still live at the end of the db's history: ACTING (a call in flight died with
    the old process) or PAUSED."""
    return [restored(row) for row in live_programs(path)]


def restored(row: LiveProgram) -> RestoredProgram:
    previous = ProgramStatus(row.status)
    status = ProgramStatus.PAUSED if previous is ProgramStatus.PAUSED else ProgramStatus.ACTING
    return RestoredProgram(row, status, previous)


def rebuild(item: RestoredProgram, *, now: float, wall_now: float) -> Program:
    """The in-memory Program for a restored row, its times mapped onto this run's clock."""
    row = item.row
    last = now - max(0.0, wall_now - row.last_at_unix)
    program = Program(
        program_id=row.program_id,
        created_at=now - max(0.0, wall_now - row.created_at_unix),
        status=item.status,
        backend=row.backend,
        model=row.model,
        step_count=row.step_count,
        total_tokens=row.tokens,
        last_activity=last,
        source=row.source,
    )
    if item.status is ProgramStatus.PAUSED:
        program.paused_since = last
    else:
        program.acting_since = last
    return program
