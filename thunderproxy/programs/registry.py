"""ProgramRegistry: the programs the proxy tracks, and the one place their state changes.

Every change goes through here so that each one is also handed to the audit sink; the registry
itself does no I/O and reads no clock (callers pass ``now``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..errors import ProgramUnknown
from . import state
from .state import Program, ProgramStatus, StepUsage, Transition

TransitionSink = Callable[[Transition], None]


@dataclass(frozen=True)
class BackendLoad:
    """Programs and tokens one backend carries, split as the seed's /health reports them."""

    total: int = 0
    reasoning: int = 0
    acting: int = 0
    paused: int = 0
    marked_for_pause: int = 0
    reasoning_tokens: int = 0
    acting_tokens: int = 0
    future_paused_tokens: int = 0

    @property
    def active_tokens(self) -> int:
        return self.reasoning_tokens + self.acting_tokens

    @property
    def active_count(self) -> int:
        return self.reasoning + self.acting


class ProgramRegistry:
    def __init__(self, sink: TransitionSink | None = None) -> None:
        self._programs: dict[str, Program] = {}
        self._sink = sink or (lambda _t: None)

    def __len__(self) -> int:
        return len(self._programs)

    def __iter__(self) -> Iterator[Program]:
        return iter(list(self._programs.values()))

    def __contains__(self, program_id: object) -> bool:
        return program_id in self._programs

    def get(self, program_id: str) -> Program:
        try:
            return self._programs[program_id]
        except KeyError:
            raise ProgramUnknown(program_id) from None

    def find(self, program_id: str) -> Program | None:
        return self._programs.get(program_id)

    def _emit(self, transitions: list[Transition] | Transition) -> None:
        for transition in transitions if isinstance(transitions, list) else [transitions]:
            self._sink(transition)

    def get_or_create(
        self,
        program_id: str,
        now: float,
        *,
        status: ProgramStatus = ProgramStatus.REASONING,
        reason: str = "first request",
    ) -> tuple[Program, bool]:
        """The program with this id, created (and logged) on first sight."""
        program = self._programs.get(program_id)
        if program is not None:
            return program, False
        program, first = state.create(program_id, now, status=status, reason=reason)
        self._programs[program_id] = program
        self._emit(first)
        return program, True

    def adopt(self, program: Program, *, previous: ProgramStatus, reason: str) -> None:
        """Track a program restored from the audit log after a restart."""
        self._programs[program.program_id] = program
        self._emit(
            Transition(
                program.program_id,
                previous,
                program.status,
                reason,
                program.backend,
                program.step_count,
                program.last_activity,
            )
        )

    def assign(self, program: Program, backend: str) -> None:
        program.backend = backend

    def begin_step(
        self, program: Program, now: float, *, context_chars: int, arrived_at: float | None = None
    ) -> None:
        self._emit(
            state.begin_step(program, now, context_chars=context_chars, arrived_at=arrived_at)
        )

    def end_step(self, program: Program, now: float, usage: StepUsage, *, reason: str) -> None:
        self._emit(state.end_step(program, now, usage, reason=reason))

    def pause(self, program: Program, now: float, *, reason: str) -> None:
        self._emit(state.pause(program, now, reason=reason))

    def resume(self, program: Program, now: float, *, backend: str | None, reason: str) -> None:
        self._emit(state.resume(program, now, backend=backend, reason=reason))

    def release(
        self, program_id: str, now: float, *, reason: str = "released by client"
    ) -> Program:
        """Stop tracking a program; raises ProgramUnknown for an id never seen (or already gone)."""
        program = self.get(program_id)
        self._emit(state.stop(program, now, reason=reason))
        del self._programs[program_id]
        return program

    def counts(self) -> dict[ProgramStatus, int]:
        result = dict.fromkeys(ProgramStatus, 0)
        for program in self._programs.values():
            result[program.status] += 1
        return result

    def sample_loads(self) -> dict[str, tuple[int, int]]:
        """Programs and active tokens per backend, for the metrics poller's samples."""
        return {
            url: (load.total, load.active_tokens) for url, load in self.load_by_backend().items()
        }

    def load_by_backend(self) -> dict[str, BackendLoad]:
        """Per-backend program counts and token sums, for placement and /health."""
        acc: dict[str, dict[str, int]] = {}
        for program in self._programs.values():
            if program.backend is None:
                continue
            row = acc.setdefault(program.backend, dict.fromkeys(BackendLoad.__annotations__, 0))
            row["total"] += 1
            if program.status is ProgramStatus.REASONING:
                row["reasoning"] += 1
                row["reasoning_tokens"] += program.total_tokens
            elif program.status is ProgramStatus.ACTING:
                row["acting"] += 1
                row["acting_tokens"] += program.total_tokens
            elif program.status is ProgramStatus.PAUSED:
                row["paused"] += 1
            if program.marked_for_pause:
                row["marked_for_pause"] += 1
                row["future_paused_tokens"] += program.total_tokens
        return {url: BackendLoad(**row) for url, row in acc.items()}
