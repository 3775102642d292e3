"""The scheduler's trio glue: every LLM call begins and ends here.

``begin_step`` registers the call with its program, waits while the policy keeps the program
off the GPU (``tr`` mode), places it on a backend and hands back a lease; ``end_step`` closes the
lease exactly once, whatever the outcome, so no program is ever left counted as REASONING.
Decisions come from the pure ``policy`` module; this module applies them and logs each one.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import trio

from ..audit import AuditLog, DecisionRecord, StepRecord
from ..backends import Backend, BackendPool
from ..errors import NoBackendAvailable, ProgramReleased, QueueFull
from ..programs import Program, ProgramRegistry, ProgramStatus, StepUsage
from ..programs.profile import Profiles
from . import policy
from .placement import Candidate, choose_backend
from .policy import Action, BackendView, Decision, PolicyConfig, ProgramView

log = logging.getLogger("thunderproxy.scheduler")

#: Until the backend has reported usage, prompts are sized at this many characters per token.
DEFAULT_CHARS_PER_TOKEN = 4.0
#: First-step cached-token samples kept per backend to estimate the shared system prefix.
SHARED_PREFIX_SAMPLES = 64
#: How the capacity factor reacts to engine preemptions (the model was too optimistic).
PREEMPTION_BACKOFF = 0.9
PREEMPTION_RECOVERY = 0.02
MIN_CAPACITY_FACTOR = 0.5


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


@dataclass
class BackendSchedule:
    """What the scheduler learns about one backend beyond its metrics."""

    shared_samples: deque[int] = field(default_factory=lambda: deque(maxlen=SHARED_PREFIX_SAMPLES))
    capacity_factor: float = 1.0
    last_pause_at: float | None = None
    last_resume_at: float | None = None
    last_preemptions: float | None = None
    #: The last capacity seen, kept when a poll fails so scheduling does not stop.
    capacity_tokens: int | None = None

    @property
    def shared_prefix_tokens(self) -> int:
        return int(statistics.median(self.shared_samples)) if self.shared_samples else 0


class Waiter:
    """A request waiting for its paused program to be resumed."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self.error: Exception | None = None


class Scheduler:
    def __init__(
        self,
        *,
        mode: str,
        registry: ProgramRegistry,
        pool: BackendPool,
        audit: AuditLog,
        profiles: Profiles,
        config: PolicyConfig | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.mode = mode
        self.registry = registry
        self.pool = pool
        self.audit = audit
        self.profiles = profiles
        self.config = config or PolicyConfig()
        self._now = clock
        self._backends: dict[str, BackendSchedule] = {}
        self._waiters: dict[str, list[Waiter]] = {}
        #: When recent resumes happened: the queue's drain rate, for Retry-After.
        self._resume_times: deque[float] = deque(maxlen=64)
        #: Characters per prompt token across programs, learned from usage; sizes newcomers.
        self._chars_per_token: float | None = None

    @property
    def scheduling_enabled(self) -> bool:
        return self.mode == "tr"

    # -- views for the pure policy -------------------------------------------------------------

    def schedule_of(self, url: str) -> BackendSchedule:
        schedule = self._backends.get(url)
        if schedule is None:
            schedule = self._backends[url] = BackendSchedule()
        return schedule

    def backend_views(self) -> list[BackendView]:
        views = []
        for backend in self.pool:
            schedule = self.schedule_of(backend.url)
            capacity = backend.capacity_tokens
            if capacity is not None:
                schedule.capacity_tokens = capacity
            views.append(
                BackendView(
                    url=backend.url,
                    healthy=backend.healthy,
                    capacity_tokens=schedule.capacity_tokens,
                    shared_prefix_tokens=schedule.shared_prefix_tokens,
                    capacity_factor=schedule.capacity_factor,
                    last_pause_at=schedule.last_pause_at,
                    last_resume_at=schedule.last_resume_at,
                )
            )
        return views

    @staticmethod
    def program_view(p: Program) -> ProgramView:
        return ProgramView(
            program_id=p.program_id,
            status=p.status,
            backend=p.backend,
            tokens=p.total_tokens,
            created_at=p.created_at,
            acting_since=p.acting_since,
            paused_since=p.paused_since,
            waiting_since=p.waiting_since,
            marked=p.marked_for_pause,
            protected_until=p.protected_until,
            last_activity=p.last_activity,
            in_flight=p.in_flight,
        )

    def program_views(self) -> list[ProgramView]:
        return [self.program_view(p) for p in self.registry]

    # -- placement ------------------------------------------------------------------------------

    def _choose(self, program_id: str, current: str | None) -> Backend:
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
        backend = self.pool.get(choose_backend(current, candidates))
        if backend is None:
            raise NoBackendAvailable(
                f"No healthy backend for program {program_id!r}: all of "
                f"{', '.join(self.pool.urls)} failed their last health check."
            )
        return backend

    def place(self, program: Program) -> Backend:
        """The program's backend: sticky while healthy, else the least loaded (logged)."""
        backend = self._choose(program.program_id, program.backend)
        if program.backend is not None and program.backend != backend.url:
            self._log(
                Decision(
                    Action.MIGRATE,
                    program.program_id,
                    "backend_unhealthy",
                    program.backend,
                    target_backend=backend.url,
                    program_tokens=program.total_tokens,
                ),
            )
        if program.backend != backend.url:
            self.registry.assign(program, backend.url)
        return backend

    # -- the step lifecycle ---------------------------------------------------------------------

    async def begin_step(
        self, program_id: str, *, arrived_at: float, context_chars: int
    ) -> StepLease:
        program = self.registry.find(program_id)
        if program is None:
            program = self._admit(program_id, arrived_at, context_chars)
        elif self.scheduling_enabled and self.config.gate_returns:
            self._gate_return(program, arrived_at, context_chars)
        # A loop, not an if: between its resume and this task running again, a program could be
        # paused anew by another task's rebalance (the policy avoids it, this makes it certain).
        while program.status is ProgramStatus.PAUSED:
            await self._wait_for_resume(program, arrived_at)
        program.waiting_since = None
        backend = self.place(program)
        now = self._now()
        self.registry.begin_step(program, now, context_chars=context_chars, arrived_at=arrived_at)
        backend.in_flight += 1
        step = program.step_count
        lease = StepLease(
            program=program,
            backend=backend,
            step=step,
            request_id=f"{program_id}-{step}",
            arrived_at=arrived_at,
            sent_at=now,
            tool_s=program.last_tool_s,
        )
        if self.scheduling_enabled:
            self.rebalance(now, backends=[backend.url])
        return lease

    def _gate_return(self, program: Program, arrived_at: float, context_chars: int) -> None:
        """Pause a returning program now if its call would overflow its backend."""
        if program.status is not ProgramStatus.ACTING or program.in_flight:
            return
        backend = self.pool.get(program.backend)
        if backend is None or not backend.healthy:
            return  # placement moves it first; the new backend's own rebalance follows
        cpt = program.chars_per_token if program.prompt_tokens_total else None
        estimate = int(context_chars / (cpt or self._chars_per_token or DEFAULT_CHARS_PER_TOKEN))
        view = replace(self.program_view(program), tokens=max(program.total_tokens, estimate))
        views = {v.url: v for v in self.backend_views()}
        now = self._now()
        decision = policy.on_return(
            view, views[backend.url], self.program_views(), self.config, now
        )
        if decision.action is Action.PAUSE:
            self._log(decision, now)
            self.registry.pause(program, now, reason=f"paused: {decision.rule}")
            program.waiting_since = arrived_at

    def _admit(self, program_id: str, arrived_at: float, context_chars: int) -> Program:
        """A program's first call: admitted as REASONING, or queued (PAUSED) in tr mode."""
        if not self.scheduling_enabled:
            program, _ = self.registry.get_or_create(program_id, arrived_at)
            return program
        estimate = int(context_chars / (self._chars_per_token or DEFAULT_CHARS_PER_TOKEN))
        backend = self._choose(program_id, None)
        now = self._now()
        candidate = ProgramView(
            program_id, ProgramStatus.REASONING, backend.url, estimate, created_at=now
        )
        views = {v.url: v for v in self.backend_views()}
        decision = policy.admit(
            candidate, views[backend.url], self.program_views(), self.config, now
        )
        if decision.action is Action.QUEUE and self.config.max_queue_wait_s > 0:
            wait = policy.expected_wait(
                decision.queue_position or 0, self._resume_times, self.config, now
            )
            if wait > self.config.max_queue_wait_s:
                self._log(replace(decision, action=Action.REJECT, detail={"expected_wait_s": wait}))
                error = QueueFull(
                    f"Program {program_id!r} would wait about {wait:.0f} s for KV capacity, more "
                    f"than --max-queue-wait {self.config.max_queue_wait_s:g} s; retry later.",
                    retry_after_s=wait,
                )
                error.program_id = program_id
                raise error
        self._log(decision)
        if decision.action is Action.QUEUE:
            program, _ = self.registry.get_or_create(
                program_id, now, status=ProgramStatus.PAUSED, reason=f"queued: {decision.rule}"
            )
        else:
            program, _ = self.registry.get_or_create(program_id, now)
        self.registry.assign(program, backend.url)
        program.total_tokens = estimate
        return program

    async def _wait_for_resume(self, program: Program, arrived_at: float) -> None:
        waiter = Waiter()
        if program.waiting_since is None:
            program.waiting_since = arrived_at
        self._waiters.setdefault(program.program_id, []).append(waiter)
        self.rebalance(self._now())
        try:
            await waiter.event.wait()
        except BaseException:
            self._drop_waiter(program, waiter)
            if not waiter.event.is_set():
                self._log(
                    Decision(
                        Action.CANCEL,
                        program.program_id,
                        "client_disconnected",
                        program.backend,
                        waited_s=self._now() - arrived_at,
                        program_tokens=program.total_tokens,
                    )
                )
            raise
        if waiter.error is not None:
            raise waiter.error

    def _drop_waiter(self, program: Program, waiter: Waiter) -> None:
        waiters = self._waiters.get(program.program_id, [])
        if waiter in waiters:
            waiters.remove(waiter)
        if not waiters:
            self._waiters.pop(program.program_id, None)
            program.waiting_since = None

    def _wake(self, program_id: str, error: Exception | None = None) -> None:
        for waiter in self._waiters.pop(program_id, []):
            waiter.error = error
            waiter.event.set()

    def record_cancelled_wait(
        self, program_id: str, *, arrived_at: float, endpoint: str, model: str | None, stream: bool
    ) -> None:
        """A request that gave up while queued: it never reached a backend (status 499)."""
        program = self.registry.find(program_id)
        now = self._now()
        self.audit.record(
            StepRecord(
                request_id=f"{program_id}-queued",
                program_id=program_id,
                step=0 if program is None else program.step_count + 1,
                backend=None,
                endpoint=endpoint,
                model=model,
                stream=stream,
                arrived_at=arrived_at,
                sent_at=None,
                first_token_at=None,
                finished_at=now,
                tool_s=None,
                prompt_tokens=None,
                completion_tokens=None,
                cached_tokens=None,
                status=499,
                error="client closed the connection while the program was paused",
            )
        )

    def end_step(self, lease: StepLease, outcome: StepOutcome) -> None:
        """Close the lease (idempotent): program state, audit row and profile, in one place."""
        if lease.closed:
            return
        lease.closed = True
        now = self._now()
        lease.backend.in_flight -= 1
        program = lease.program
        tracked = program.program_id in self.registry
        if tracked:
            self.registry.end_step(program, now, outcome.usage, reason=outcome.reason)
        usage = outcome.usage
        if usage.prompt_tokens and program.context_len:
            ratio = program.context_len / usage.prompt_tokens
            previous = self._chars_per_token
            self._chars_per_token = ratio if previous is None else 0.9 * previous + 0.1 * ratio
        if lease.step == 1 and usage.cached_tokens is not None:
            # A first call can only hit what other programs left: the shared prefix.
            self.schedule_of(lease.backend.url).shared_samples.append(usage.cached_tokens)
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
        if not (tracked and self.scheduling_enabled):
            return
        if program.marked_for_pause and program.in_flight == 0:
            self.registry.pause(program, now, reason="paused: marked while reasoning")
            self._log(
                Decision(
                    Action.PAUSE,
                    program.program_id,
                    "marked_step_end",
                    program.backend,
                    program_tokens=program.total_tokens,
                )
            )
        self.rebalance(now)

    def release(self, program_id: str) -> Program:
        program = self.registry.release(program_id, self._now())
        self._wake(
            program_id,
            ProgramReleased(
                f"Program {program_id!r} was released while this request waited for capacity; "
                "the request was not sent. Send it again to start a new program."
            ),
        )
        if self.scheduling_enabled:
            self.rebalance(self._now())
        return program

    # -- periodic and event-driven rebalancing ---------------------------------------------------

    def tick(self) -> None:
        """Periodic work (the resume monitor): learn from the engines, retire idle programs,
        force-resume programs that waited too long, rebalance."""
        now = self._now()
        self._learn_from_engines()
        for decision in policy.retire(self.program_views(), self.config, now):
            self._apply(decision, now)
        if self.scheduling_enabled:
            self.rebalance(now)

    def _learn_from_engines(self) -> None:
        for backend in self.pool:
            snapshot = backend.snapshot
            if snapshot is None or snapshot.preemptions_total is None:
                continue
            schedule = self.schedule_of(backend.url)
            previous = schedule.last_preemptions
            schedule.last_preemptions = snapshot.preemptions_total
            if previous is None or snapshot.preemptions_total < previous:
                continue  # first reading, or the engine restarted (its counter reset)
            if snapshot.preemptions_total > previous:
                schedule.capacity_factor = max(
                    MIN_CAPACITY_FACTOR, schedule.capacity_factor * PREEMPTION_BACKOFF
                )
            else:
                schedule.capacity_factor = min(1.0, schedule.capacity_factor + PREEMPTION_RECOVERY)

    def rebalance(self, now: float, *, backends: Iterable[str] | None = None) -> None:
        """Apply the policy: pause or mark where over capacity, then resume where there is room."""
        views = self.backend_views()
        programs = self.program_views()
        wanted = None if backends is None else set(backends)
        paused_any = False
        for view in views:
            if wanted is not None and view.url not in wanted:
                continue
            for decision in policy.enforce(view, programs, self.config, now):
                self._apply(decision, now)
                paused_any = True
        if paused_any:
            views = self.backend_views()
            programs = self.program_views()
        if any(p.status is ProgramStatus.PAUSED for p in programs):
            for decision in policy.resume(views, programs, self.config, now):
                self._apply(decision, now)

    def _apply(self, decision: Decision, now: float) -> None:
        program = self.registry.find(decision.program_id)
        if program is None:
            return
        action = decision.action
        if action is Action.PAUSE:
            self.registry.pause(program, now, reason=f"paused: {decision.rule}")
            self.schedule_of(decision.backend or "").last_pause_at = now
        elif action is Action.MARK:
            program.marked_for_pause = True
            self.schedule_of(decision.backend or "").last_pause_at = now
        elif action in (Action.RESUME, Action.MIGRATE, Action.FORCE_RESUME):
            # waiting_since stays set until the woken request's step begins: until then the
            # program is about to reason, so it is weighed as such and not paused again.
            self.registry.resume(
                program, now, backend=decision.target_backend, reason=f"resumed: {decision.rule}"
            )
            if action is Action.FORCE_RESUME:
                program.protected_until = now + self.config.resume_protection_s
            else:
                self.schedule_of(decision.target_backend or "").last_resume_at = now
            self._resume_times.append(now)
            self._wake(program.program_id)
        elif action is Action.RETIRE:
            self.registry.release(program.program_id, now, reason="retired: idle lease expired")
        self._log(decision, now)

    def _log(self, decision: Decision, now: float | None = None) -> None:
        self.audit.record(
            DecisionRecord(
                at=self._now() if now is None else now,
                program_id=decision.program_id,
                action=decision.action.value,
                rule=decision.rule,
                backend=decision.backend,
                target_backend=decision.target_backend,
                capacity_tokens=decision.capacity_tokens,
                used_tokens=decision.used_tokens,
                program_tokens=decision.program_tokens,
                idle_s=decision.idle_s,
                waited_s=decision.waited_s,
                queue_position=decision.queue_position,
                detail=json.dumps(decision.detail) if decision.detail else None,
            )
        )


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
