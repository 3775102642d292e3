"""Restoring the program registry from the audit log after a restart.

Every program whose last logged transition is not ``stopped`` comes back with its backend,
step count and KV footprint, as ACTING (a call in flight died with the old process) or PAUSED,
and with its idle time carried over so the idle lease keeps counting.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from .state import Program, ProgramStatus

LATEST_STATE = """
SELECT t.program_id, t.to_status, t.backend, t.at,
       (SELECT MAX(step) FROM steps s WHERE s.program_id = t.program_id) AS steps,
       (SELECT MIN(at) FROM transitions f WHERE f.program_id = t.program_id) AS created_at,
       (SELECT COALESCE(s.prompt_tokens, 0) + COALESCE(s.completion_tokens, 0)
          FROM steps s
         WHERE s.program_id = t.program_id AND s.prompt_tokens IS NOT NULL
         ORDER BY s.id DESC LIMIT 1) AS tokens,
       (SELECT f.source FROM transitions f
         WHERE f.program_id = t.program_id AND f.source IS NOT NULL
         ORDER BY f.id LIMIT 1) AS source
  FROM transitions t
  JOIN (SELECT program_id, MAX(id) AS id FROM transitions GROUP BY program_id) last
    ON last.id = t.id
 WHERE t.to_status != 'stopped'
"""


@dataclass(frozen=True)
class RestoredProgram:
    program_id: str
    status: ProgramStatus
    previous_status: ProgramStatus
    backend: str | None
    step_count: int
    tokens: int
    last_at_unix: float
    created_at_unix: float
    source: str | None = None


def load(path: str) -> list[RestoredProgram]:
    """Programs still live at the end of the db's history (reads only)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = conn.execute(LATEST_STATE).fetchall()
    finally:
        conn.close()
    restored = []
    for program_id, status, backend, at, steps, created_at, tokens, source in rows:
        previous = ProgramStatus(status)
        restored.append(
            RestoredProgram(
                program_id=program_id,
                status=ProgramStatus.PAUSED
                if previous is ProgramStatus.PAUSED
                else ProgramStatus.ACTING,
                previous_status=previous,
                backend=backend,
                step_count=steps or 0,
                tokens=tokens or 0,
                last_at_unix=at,
                created_at_unix=created_at,
                source=source,
            )
        )
    return restored


def rebuild(item: RestoredProgram, *, now: float, wall_now: float) -> Program:
    """The in-memory Program for a restored row, its times mapped onto this run's clock."""
    last = now - max(0.0, wall_now - item.last_at_unix)
    program = Program(
        program_id=item.program_id,
        created_at=now - max(0.0, wall_now - item.created_at_unix),
        status=item.status,
        backend=item.backend,
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
