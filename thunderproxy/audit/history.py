"""Reading the audit db's history back: what the registry needs to be restored after a restart.
The schema is the audit package's own; nothing else embeds its SQL."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

LATEST_STATE = """
SELECT t.program_id, t.to_status, t.backend, t.at,
       (SELECT MAX(step) FROM steps s WHERE s.program_id = t.program_id) AS steps,
       (SELECT MIN(at) FROM transitions f WHERE f.program_id = t.program_id) AS created_at,
       (SELECT COALESCE(s.prompt_tokens, 0) + COALESCE(s.completion_tokens, 0)
          FROM steps s
         WHERE s.program_id = t.program_id AND s.prompt_tokens IS NOT NULL
         ORDER BY s.id DESC LIMIT 1) AS tokens,
       (SELECT s.model FROM steps s WHERE s.program_id = t.program_id
         ORDER BY s.id DESC LIMIT 1) AS model,
       (SELECT f.source FROM transitions f
         WHERE f.program_id = t.program_id AND f.source IS NOT NULL
         ORDER BY f.id LIMIT 1) AS source
  FROM transitions t
  JOIN (SELECT program_id, MAX(id) AS id FROM transitions GROUP BY program_id) last
    ON last.id = t.id
 WHERE t.to_status != 'stopped'
"""


@dataclass(frozen=True)
class LiveProgram:
    """A program still live at the end of the history, as the db recorded it."""

    program_id: str
    status: str
    backend: str | None
    step_count: int
    tokens: int
    model: str | None
    last_at_unix: float
    created_at_unix: float
    #: How the program was recognised (program_id, a client's session id, a prefix, …).
    source: str | None = None


def live_programs(path: str) -> list[LiveProgram]:
    """Programs whose last recorded transition is not ``stopped`` (reads only)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = conn.execute(LATEST_STATE).fetchall()
    finally:
        conn.close()
    return [
        LiveProgram(
            program_id=program_id,
            status=status,
            backend=backend,
            step_count=steps or 0,
            tokens=tokens or 0,
            model=model,
            last_at_unix=at,
            created_at_unix=created_at,
            source=source,
        )
        for program_id, status, backend, at, steps, created_at, tokens, model, source in rows
    ]
