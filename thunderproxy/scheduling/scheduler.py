"""The scheduler's trio glue: every LLM call begins and ends here.

``begin_step`` registers the call with its program, waits while the policy keeps the program
off the GPU (``tr`` mode), places it on a backend and hands back a lease; ``end_step`` closes the
lease exactly once, whatever the outcome, so no program is ever left counted as REASONING.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import trio

from ..audit import AuditLog, StepRecord
from ..backends import Backend, BackendPool
from ..errors import NoBackendAvailable
from ..programs import Program, ProgramRegistry, StepUsage
from ..programs.profile import Profiles
from .placement import Candidate, choose_backend


@dataclass
class StepLease:
    """One LLM call in flight: which program, which step, which backend, since when."""

    program: Program
    backend: Backend
    step: int
    request_id: str
    arrived_at: float
    sent_at: float
    tool_s: float | None
    closed: bool = False


@dataclass(frozen=True)
class StepOutcome:
    status: int
    usage: StepUsage
    endpoint: str
    model: str | None
    stream: bool
    first_token_at: float | None = None
    error: str | None = None

    @property
    def reason(self) -> str:
        if self.status == 499:
            return "client disconnected"
        if self.status >= 400:
            return f"request failed ({self.status})"
        return "response complete"


class Scheduler:
    def __init__(
        self,
        *,
        mode: str,
        registry: ProgramRegistry,
        pool: BackendPool,
        audit: AuditLog,
        profiles: Profiles,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.mode = mode
        self.registry = registry
        self.pool = pool
        self.audit = audit
        self.profiles = profiles
        self._now = clock

    @property
    def scheduling_enabled(self) -> bool:
        return self.mode == "tr"

    def place(self, program: Program) -> Backend:
        loads = self.registry.load_by_backend()
        candidates = [
            Candidate(
                url=b.url,
                healthy=b.healthy,
                active_tokens=loads[b.url].active_tokens if b.url in loads else 0,
                programs=loads[b.url].total if b.url in loads else 0,
            )
            for b in self.pool
        ]
        url = choose_backend(program.backend, candidates)
        backend = self.pool.get(url)
        if backend is None:
            raise NoBackendAvailable(
                f"No healthy backend for program {program.program_id!r}: all of "
                f"{', '.join(self.pool.urls)} failed their last health check."
            )
        if program.backend != backend.url:
            self.registry.assign(program, backend.url)
        return backend

    async def begin_step(
        self, program_id: str, *, arrived_at: float, context_chars: int
    ) -> StepLease:
        program, _ = self.registry.get_or_create(program_id, arrived_at)
        backend = self.place(program)
        now = self._now()
        self.registry.begin_step(program, now, context_chars=context_chars, arrived_at=arrived_at)
        backend.in_flight += 1
        step = program.step_count
        return StepLease(
            program=program,
            backend=backend,
            step=step,
            request_id=f"{program_id}-{step}",
            arrived_at=arrived_at,
            sent_at=now,
            tool_s=program.last_tool_s,
        )

    def end_step(self, lease: StepLease, outcome: StepOutcome) -> None:
        """Close the lease (idempotent): program state, audit row and profile, in one place."""
        if lease.closed:
            return
        lease.closed = True
        now = self._now()
        lease.backend.in_flight -= 1
        program = lease.program
        if program.program_id in self.registry:
            self.registry.end_step(program, now, outcome.usage, reason=outcome.reason)
        usage = outcome.usage
        record = StepRecord(
            request_id=lease.request_id,
            program_id=program.program_id,
            step=lease.step,
            backend=lease.backend.url,
            endpoint=outcome.endpoint,
            model=outcome.model,
            stream=outcome.stream,
            arrived_at=lease.arrived_at,
            sent_at=lease.sent_at,
            first_token_at=outcome.first_token_at,
            finished_at=now,
            tool_s=lease.tool_s,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            status=outcome.status,
            error=outcome.error,
        )
        self.audit.record(record)
        first = outcome.first_token_at
        self.profiles.add_step(
            program.program_id,
            prefill_s=None if first is None else first - lease.sent_at,
            decode_s=None if first is None else now - first,
            pause_s=record.queue_s,
            tool_s=lease.tool_s,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
        )

    def release(self, program_id: str) -> Program:
        return self.registry.release(program_id, self._now())

    def tick(self) -> None:
        """Periodic housekeeping, driven by the resume monitor."""


async def serve_resume_monitor(
    scheduler: Scheduler,
    *,
    interval: float,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the scheduler's periodic work (resumes, leases) every ``interval`` seconds."""
    task_status.started()
    while True:
        scheduler.tick()
        await trio.sleep(interval)
