"""ProgramRegistry: the programs the proxy tracks, and the one place their state changes.

Every change goes through here so that each one is also handed to the audit sink; the registry
itself does no I/O and reads no clock (callers pass ``now``).

It also keeps an index per backend (programs by status, the acting programs' tokens, the
programs that became acting recently, the programs whose request waits), updated on every
change, so that nothing on a request's path walks every tracked program: the cost of a call is
flat in the number of idle programs the proxy tracks.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType

from ..errors import ProgramUnknown
from . import state
from .ending import ENDED_FLOOR_S, presumed_ended
from .state import Program, ProgramStatus, StepUsage, Transition

TransitionSink = Callable[[Transition], None]


@dataclass(frozen=True)
class BackendLoad:
    """Programs and tokens one backend carries, split as ``/health`` reports them per backend."""

    total: int = 0
    reasoning: int = 0
    acting: int = 0
    paused: int = 0
    marked_for_pause: int = 0
    reasoning_tokens: int = 0
    acting_tokens: int = 0
    future_paused_tokens: int = 0
    #: Acting programs presumed ended (``ending.py``): in none of the counts above.
    presumed_ended: int = 0

    @property
    def active_tokens(self) -> int:
        return self.reasoning_tokens + self.acting_tokens

    @property
    def active_count(self) -> int:
        return self.reasoning + self.acting


@dataclass
class BackendIndex:
    """One backend's programs by status; the acting ones with the tokens they entered with."""

    reasoning: dict[str, Program] = field(default_factory=dict)
    acting: dict[str, int] = field(default_factory=dict)
    paused: dict[str, Program] = field(default_factory=dict)
    #: Acting programs that became acting lately (pruned by the reader, see ``recent``).
    recent: dict[str, Program] = field(default_factory=dict)
    acting_tokens: int = 0
    #: Acting programs presumed ended: tracked, but counted as released for capacity.
    ended: dict[str, Program] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return len(self.reasoning) + len(self.acting) + len(self.paused)


class ProgramRegistry:
    def __init__(self, sink: TransitionSink | None = None) -> None:
        self._programs: dict[str, Program] = {}
        self._sink = sink or (lambda _t: None)
        self._index: dict[str | None, BackendIndex] = {}
        self._counts = dict.fromkeys(ProgramStatus, 0)
        #: Programs a request of which waits for a resume (``Program.waiting_since`` set).
        self._waiting: dict[str, Program] = {}
        #: Every program, in the order of its last activity (oldest first).
        self._by_activity: dict[str, Program] = {}
        #: The same, less the programs presumed ended: what ``presume_ended`` walks.
        self._not_ended: dict[str, Program] = {}
        # Creation order for paging (/programs?after=): (sequence, id) ascending, so a cursor is
        # found by bisection. Released programs leave holes, compacted once they are half.
        self._next_seq = 0
        self._order: list[tuple[int, str]] = []
        self._seq: dict[str, int] = {}

    # -- the index ------------------------------------------------------------------------------

    def _unindex(self, program: Program) -> None:
        index = self._index.get(program.backend)
        self._counts[program.status] -= 1
        if index is None:
            return
        pid = program.program_id
        index.reasoning.pop(pid, None)
        index.paused.pop(pid, None)
        index.recent.pop(pid, None)
        index.ended.pop(pid, None)
        tokens = index.acting.pop(pid, None)
        if tokens is not None:
            index.acting_tokens -= tokens

    def _reindex(self, program: Program) -> None:
        self._counts[program.status] += 1
        index = self._index.get(program.backend)
        if index is None:
            index = self._index[program.backend] = BackendIndex()
        pid = program.program_id
        if program.status is ProgramStatus.REASONING:
            program.presumed_ended = False  # a call of it went out: it had not ended
            index.reasoning[pid] = program
        elif program.status is ProgramStatus.ACTING and program.presumed_ended:
            # Paused and resumed in between or not, it is still silent.
            index.ended[pid] = program
        elif program.status is ProgramStatus.ACTING:
            index.acting[pid] = program.total_tokens
            index.acting_tokens += program.total_tokens
            index.recent[pid] = program
        elif program.status is ProgramStatus.PAUSED:
            index.paused[pid] = program

    def _changing(self, program: Program) -> _Reindex:
        return _Reindex(self, program)

    def set_waiting(self, program: Program, since: float | None) -> None:
        """A request of ``program`` waits for its resume since ``since`` (None: no longer)."""
        if since is not None and program.presumed_ended:
            # A request of it arrived: it had not ended after all.
            with self._changing(program):
                program.presumed_ended = False
            self._not_ended[program.program_id] = program
        program.waiting_since = since
        if since is None:
            self._waiting.pop(program.program_id, None)
        elif program.program_id in self._programs:
            self._waiting[program.program_id] = program

    def relevant(self, claims: Callable[[Program], bool]) -> list[Program]:
        """The programs a scheduling decision can involve: every REASONING or PAUSED program,
        every one whose request waits, and the ACTING ones that still ``claims`` KV (an idle
        program's claim decays to nothing, and once it has it is not looked at again until it
        changes). Cost: those programs, not every tracked one."""
        out: dict[str, Program] = dict(self._waiting)
        for index in self._index.values():
            out.update(index.reasoning)
            out.update(index.paused)
            kept = {pid: p for pid, p in index.recent.items() if claims(p)}
            if len(kept) != len(index.recent):
                # A new dict, not deletions: a dict keeps its size after deletions, and
                # iterating one emptied of 50,000 programs would still cost 50,000 slots.
                index.recent = kept
            out.update(kept)
        return list(out.values())

    def backend_index(self, backend: str) -> BackendIndex | None:
        """One backend's index, to read (scheduling's bound on a backend's use: views.py)."""
        return self._index.get(backend)

    def waiting(self) -> list[Program]:
        """The programs a request of which waits for a resume."""
        return list(self._waiting.values())

    def waiting_count(self) -> int:
        """How many programs have a request waiting for a resume."""
        return len(self._waiting)

    def idle_since(self, cutoff: float) -> list[Program]:
        """The programs whose last activity was at or before ``cutoff``, oldest first; walks
        only those (the index is kept in order of last activity)."""
        out = []
        for program in self._by_activity.values():
            if program.last_activity > cutoff:
                break
            out.append(program)
        return out

    def presume_ended(self, now: float) -> list[Program]:
        """Mark the acting programs silent for longer than their tool gaps explain as ended for
        capacity (``ending.py``); a call of one takes it back. Walks only the programs idle
        past ``ENDED_FLOOR_S`` that are not presumed ended already. Returns those it marked."""
        cutoff = now - ENDED_FLOOR_S
        marked = []
        for program in list(self._not_ended.values()):
            if program.last_activity > cutoff:
                break
            if program.status is not ProgramStatus.ACTING or not presumed_ended(
                acting_since=program.acting_since,
                longest_tool_s=program.longest_tool_s,
                in_flight=program.in_flight,
                waiting=program.waiting_since is not None,
                now=now,
            ):
                continue
            with self._changing(program):
                program.presumed_ended = True
            del self._not_ended[program.program_id]
            marked.append(program)
        return marked

    def _order_add(self, program_id: str) -> None:
        if program_id not in self._seq:
            self._seq[program_id] = self._next_seq
            self._order.append((self._next_seq, program_id))
            self._next_seq += 1

    def _order_remove(self, program_id: str) -> None:
        self._seq.pop(program_id, None)
        if len(self._order) > 2 * len(self._seq) + 64:
            self._order = [(n, pid) for n, pid in self._order if self._seq.get(pid) == n]

    def after(self, cursor: int | None) -> Iterator[tuple[int, Program]]:
        """(sequence, program) in creation order, starting after sequence ``cursor``; finding
        the start costs a bisection, each step one program (or one hole left by a release)."""
        order = self._order
        start = 0 if cursor is None else bisect.bisect_right(order, cursor, key=lambda e: e[0])
        for index in range(start, len(order)):
            seq, program_id = order[index]
            program = self._programs.get(program_id)
            if program is not None and self._seq.get(program_id) == seq:
                yield seq, program

    def _touch(self, program: Program) -> None:
        self._by_activity.pop(program.program_id, None)
        self._by_activity[program.program_id] = program
        self._not_ended.pop(program.program_id, None)
        self._not_ended[program.program_id] = program

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
        source: str | None = None,
    ) -> tuple[Program, bool]:
        """The program with this id, created (and logged, with how it was recognised) on first
        sight."""
        program = self._programs.get(program_id)
        if program is not None:
            return program, False
        program, first = state.create(program_id, now, status=status, reason=reason, source=source)
        self._programs[program_id] = program
        self._order_add(program_id)
        self._reindex(program)
        self._touch(program)
        self._emit(first)
        return program, True

    def adopt(self, program: Program, *, previous: ProgramStatus, reason: str) -> None:
        """Track a program restored from the audit log after a restart."""
        self._programs[program.program_id] = program
        self._order_add(program.program_id)
        self._reindex(program)
        self._touch(program)
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
        with self._changing(program):
            program.backend = backend

    def set_tokens(self, program: Program, tokens: int) -> None:
        with self._changing(program):
            program.total_tokens = tokens

    def begin_step(
        self, program: Program, now: float, *, context_chars: int, arrived_at: float | None = None
    ) -> None:
        with self._changing(program):
            moved = state.begin_step(
                program, now, context_chars=context_chars, arrived_at=arrived_at
            )
        self._emit(moved)

    def end_step(self, program: Program, now: float, usage: StepUsage, *, reason: str) -> None:
        with self._changing(program):
            moved = state.end_step(program, now, usage, reason=reason)
        self._emit(moved)

    def pause(self, program: Program, now: float, *, reason: str) -> None:
        with self._changing(program):
            moved = state.pause(program, now, reason=reason)
        self._emit(moved)

    def resume(self, program: Program, now: float, *, backend: str | None, reason: str) -> None:
        with self._changing(program):
            moved = state.resume(program, now, backend=backend, reason=reason)
        self._emit(moved)

    def release(
        self, program_id: str, now: float, *, reason: str = "released by client"
    ) -> Program:
        """Stop tracking a program; raises ProgramUnknown for an id never seen (or already gone)."""
        program = self.get(program_id)
        self._unindex(program)
        self._waiting.pop(program_id, None)
        self._by_activity.pop(program_id, None)
        self._not_ended.pop(program_id, None)
        stopped = state.stop(program, now, reason=reason)
        del self._programs[program_id]
        self._order_remove(program_id)
        self._emit(stopped)
        return program

    def counts(self) -> dict[ProgramStatus, int]:
        return dict(self._counts)

    def sample_loads(self) -> dict[str, tuple[int, int]]:
        """Programs and active tokens per backend, for the metrics poller's samples."""
        loads = self.load_by_backend()
        return {url: (load.total, load.active_tokens) for url, load in loads.items()}

    def load_by_backend(self) -> dict[str, BackendLoad]:
        """Per-backend program counts and token sums, for placement and /health. Walks only the
        reasoning programs (the calls in flight); the rest is kept up to date as it changes."""
        out = {}
        for url, index in self._index.items():
            if url is None or not (index.total or index.ended):
                continue
            marked = [p for p in index.reasoning.values() if p.marked_for_pause]
            out[url] = BackendLoad(
                total=index.total,
                reasoning=len(index.reasoning),
                acting=len(index.acting),
                paused=len(index.paused),
                marked_for_pause=len(marked),
                reasoning_tokens=sum(p.total_tokens for p in index.reasoning.values()),
                acting_tokens=index.acting_tokens,
                future_paused_tokens=sum(p.total_tokens for p in marked),
                presumed_ended=len(index.ended),
            )
        return out


class _Reindex:
    """``with registry._changing(program):`` the program leaves the index before the change and
    re-enters it after, so the index always matches the programs' state."""

    def __init__(self, registry: ProgramRegistry, program: Program) -> None:
        self.registry = registry
        self.program = program
        self.activity = program.last_activity

    def __enter__(self) -> None:
        self.registry._unindex(self.program)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.registry._reindex(self.program)
        if self.program.last_activity != self.activity:
            self.registry._touch(self.program)
