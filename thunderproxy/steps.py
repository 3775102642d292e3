"""The values a program's steps are told in: its status, one call's token counts, one state
change. Below programs/ (which makes them) and audit/ (which records them), so the audit rows
need nothing of the registry or the state machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ProgramStatus(StrEnum):
    REASONING = "reasoning"
    ACTING = "acting"
    PAUSED = "paused"
    STOPPED = "stopped"

    @property
    def lifecycle(self) -> str:
        """The ``state`` field ``/programs`` shows: active, paused or terminated."""
        if self is ProgramStatus.PAUSED:
            return "paused"
        if self is ProgramStatus.STOPPED:
            return "terminated"
        return "active"


@dataclass(frozen=True)
class StepUsage:
    """Token counts of one finished LLM call, as the backend reported them (None: not reported)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def known(self) -> bool:
        return self.prompt_tokens is not None


@dataclass(frozen=True)
class Transition:
    """One state change, as it goes to the ``transitions`` table."""

    program_id: str
    from_status: ProgramStatus | None
    to_status: ProgramStatus
    reason: str
    backend: str | None
    step: int
    at: float
    #: How the program was recognised (recognition's Source); only on its first transition.
    source: str | None = None
