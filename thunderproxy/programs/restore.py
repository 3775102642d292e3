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
    program_id: str
    status: ProgramStatus
    previous_status: ProgramStatus
    backend: str | None
    step_count: int
    tokens: int
    model: str | None
    last_at_unix: float
    created_at_unix: float
    source: str | None = None


def load(path: str) -> list[RestoredProgram]:
    """Programs still live at the end of the db's history: ACTING (a call in flight died with
    the old process) or PAUSED."""
    return [restored(row) for row in live_programs(path)]


def restored(row: LiveProgram) -> RestoredProgram:
    previous = ProgramStatus(row.status)
    return RestoredProgram(
        program_id=row.program_id,
        status=ProgramStatus.PAUSED if previous is ProgramStatus.PAUSED else ProgramStatus.ACTING,
        previous_status=previous,
        backend=row.backend,
        step_count=row.step_count,
        tokens=row.tokens,
        model=row.model,
        last_at_unix=row.last_at_unix,
        created_at_unix=row.created_at_unix,
        source=row.source,
    )


def rebuild(item: RestoredProgram, *, now: float, wall_now: float) -> Program:
    """The in-memory Program for a restored row, its times mapped onto this run's clock."""
    last = now - max(0.0, wall_now - item.last_at_unix)
    program = Program(
        program_id=item.program_id,
        created_at=now - max(0.0, wall_now - item.created_at_unix),
        status=item.status,
        backend=item.backend,
        model=item.model,
        step_count=item.step_count,
        total_tokens=item.tokens,
        last_activity=last,
        source=item.source,
    )
    if item.status is ProgramStatus.PAUSED:
        program.paused_since = last
    else:
        program.acting_since = last
    return program
