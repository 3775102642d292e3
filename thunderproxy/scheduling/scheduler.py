"""The scheduler's trio glue: it leases each LLM call a backend and applies its policy.

``lease`` registers the call with its program, asks the policy whether it may go out now, waits
while the program is paused, places it on a backend of its model's group and hands back a
:class:`StepLease`; ``close`` ends the lease exactly once, whatever the outcome, so no program is
ever left counted as REASONING. Decisions come from the named policy (policies.py); this module
applies them and logs each one. The gateway owns the call around the lease and records it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Protocol

import trio

from ..audit import AuditLog, DecisionRecord
from ..backends import BackendNode, BackendPool, Route
from ..errors import ModelNotFound, NoBackendAvailable, ProgramReleased, QueueFull
from ..programs import Program, ProgramRegistry, ProgramStatus, StepUsage
from . import claims as shared_claims
from .classes import resolve
from .costs import horizon_s
from .learners import PromptSizer, program_estimate
from .policies import Policy, Views
from .tr import MAX_KEEP_S, Action, Decision, PolicyConfig, ProgramView, call_bound, used_tokens
from .tr import force_resume as policy_force_resume
from .views import BackendSchedule, ViewSource
from .waiters import Waiters

log = logging.getLogger("thunderproxy.scheduler")


@dataclass
class StepLease:
    """One LLM call in flight: which program, which step, which backend, since when."""

    program: Program
    node: BackendNode
    step: int
    request_id: str
    arrived_at: float
    sent_at: float
    tool_s: float | None
    context_chars: int
    closed: bool = False
    #: For the hold ledger (costs.py): the program's history the call carries, the calls on or
    #: held for its backend when it went out, and whether tr was holding there then.
    reuse_tokens: int = 0
    busy: int = 0
    holding: bool = True
    #: Of its wait in the proxy, the seconds its backend's engine was seen full.
    displaced_s: float = 0.0
    #: The program's latency class when the call went out (classes.py).
    program_class: str | None = None


class Affinity(Protocol):
    """Where other instances placed programs (shared through Redis)."""

    def backend_of(self, program_id: str) -> Awaitable[str | None]: ...

    def placed(self, program_id: str, backend: str) -> None: ...


class Claims(Protocol):
    """KV claims checked atomically with other instances' (Redis: ``SharedBackends.claim``)."""

    def claim(
        self, backend: str, demand: int, whole: int, *, alone: bool = False
    ) -> Awaitable[bool]: ...

    def others(self, backend: str) -> int: ...

    def shared(self) -> bool: ...


class Scheduler:
    def __init__(
        self,
        *,
        policy: Policy,
        registry: ProgramRegistry,
        pool: BackendPool,
        audit: AuditLog,
        clock: Callable[[], float] = trio.current_time,
        other_tokens: Callable[[str], int] | None = None,
        affinity: Affinity | None = None,
        claims: Claims | None = None,
    ) -> None:
        self.policy = policy
        self.registry = registry
        self.pool = pool
        self.audit = audit
        self._now = clock
        self.source = ViewSource(
            registry,
            pool,
            policy.config,
            others=other_tokens,
            shared=None if claims is None else claims.shared,
        )
        self.affinity = affinity
        #: With other instances in front of the same backends, tr's fit test is made again in
        #: Redis for every call that adds KV (``_claim``); None: this instance decides alone.
        self.claims = claims
        #: Per backend, the growth of returning calls whose claims are being checked.
        self._pending: dict[str, int] = {}
        self._waiters = Waiters()
        #: Calls held while other calls of their program are in flight (tr.on_call).
        self._held = Waiters()
        #: When recent resumes happened: the queue's drain rate, for Retry-After.
        self._resume_times: deque[float] = deque(maxlen=64)
        #: Prompt sizes learned per model; they size newcomers.
        self._sizers: dict[str | None, PromptSizer] = {}

    @property
    def config(self) -> PolicyConfig:
        return self.policy.config

    # -- views for the policy -------------------------------------------------------------------

    def schedule_of(self, url: str) -> BackendSchedule:
        return self.source.schedule_of(url)

    def views(self) -> Views:
        return self.source.views(self._now())

    def used_by_backend(self) -> dict[str, int]:
        """The KV tokens this instance's programs claim on each backend now."""
        used = self.source.used_by_backend(self._now())
        for url, growth in self._pending.items():
            if growth:
                used[url] = used.get(url, 0) + growth
        return used

    # -- placement ------------------------------------------------------------------------------

    def _choose(self, program_id: str, current: str | None, route: Route) -> BackendNode:
        return self.source.choose(program_id, current, route)

    def predict(self, program_id: str, model: str) -> str | None:
        """The backend a call of ``program_id`` to ``model`` would be leased now, without
        placing it (None: no healthy backend serves the model)."""
        program = self.registry.find(program_id)
        try:
            route = self.pool.route(model)
            current = None if program is None else program.backend
            return self._choose(program_id, current, route).url
        except (ModelNotFound, NoBackendAvailable):
            return None

    def place(self, program: Program, route: Route) -> BackendNode:
        """The program's backend: sticky while healthy, else the least loaded of its group."""
        node = self._choose(program.program_id, program.backend, route)
        if program.backend is not None and program.backend != node.url:
            self._log(
                Decision(
                    Action.MIGRATE,
                    program.program_id,
                    "backend_unhealthy",
                    program.backend,
                    target_backend=node.url,
                    program_tokens=program.total_tokens,
                ),
            )
        if program.backend != node.url:
            self.registry.assign(program, node.url)
        return node

    # -- the lease ------------------------------------------------------------------------------

    async def lease(
        self,
        program_id: str,
        route: Route,
        *,
        arrived_at: float,
        context_chars: int,
        source: str | None = None,
        program_class: str | None = None,
        client: str | None = None,
    ) -> StepLease:
        """Wait until ``program_id``'s call may go out, then lease it a backend of ``route``.
        ``source`` (how the program was recognised) is recorded if this call creates it;
        ``program_class`` is the class the call names, if any (classes.py resolves it);
        ``client`` the configured client that sent it (None without ``[clients]``)."""
        program = self.registry.find(program_id)
        known = None
        if program is None and self.affinity is not None:
            # New here, but another instance may have run it: its cache is on that backend.
            known = await self.affinity.backend_of(program_id)
            program = self.registry.find(program_id)  # another call may have created it meanwhile
        fresh = program is None  # a first call: its KV claim is new
        gate: Decision | None = None
        returned = True
        klass = resolve(
            program_class,
            source,
            None if program is None else program.program_class,
            self.config.default_program_class,
        )
        if program is None:
            program = self._admit(
                program_id, route, arrived_at, context_chars, source, known, klass, client
            )
        else:
            program.program_class = klass
            if program.client is None:
                program.client = client
            returned = self._observe_return(program, arrived_at)
            gate = self._gate_return(program, arrived_at, context_chars)
        # Where the engine was already full when the call came, and until it goes out.
        entered_on, full_s_before = program.backend, self._saturated_s(program.backend)
        # Whether it took over the context its program's last ended call left (each call
        # takes over one at most, when held or when it goes out, whichever comes first).
        taken = False
        while True:
            # A loop, not an if: between its resume and this task running again, a program
            # could be paused anew by another task's rebalance (the policy avoids it, this
            # makes it certain).
            while program.status is ProgramStatus.PAUSED:
                await self._wait_for_resume(program, arrived_at)
                fresh, gate = True, None
            # A returning call the gate let through grows the program's claim to its whole
            # context: checked too (against the whole capacity, as the gate does), also where
            # the gate let it through because holding does not pay (claims.holds).
            grows = None
            if gate is not None and gate.action is Action.ADMIT:
                grows = gate.program_tokens
            gate = None
            if (fresh or grows) and not await self._claim(
                program, route, arrived_at, context_chars, grows
            ):
                continue  # refused: it waits, as on a full backend
            # (Read again: another task's rebalance may have paused it while its claim was
            # checked, and then it waits too.)
            if program.status in (ProgramStatus.PAUSED,):
                continue
            # Another call of it in flight (or held): this one is one more context.
            if program.in_flight or program.held_calls:
                went = await self._hold(program, arrived_at, context_chars, take_over=not taken)
                taken = taken or went is not False  # held: it took over one then
                if went is None:
                    continue
            break
        if not program.held_calls:
            self.registry.set_waiting(program, None)
        node = self.place(program, route)
        if self.affinity is not None:
            self.affinity.placed(program_id, node.url)
        now = self._now()
        self.source.note_wait(program_id, now - arrived_at)
        # History back after the horizon is recomputed, held or not: holding keeps none of it.
        reuse = program.total_tokens if program.step_count and returned else 0
        busy = node.in_flight + self._held_on(node.url)
        holding = self.source.holding(self.schedule_of(node.url))[0]
        if program.in_flight and program.ended_contexts and not taken:
            # Come as soon as it could, it continues the context a call of it just left.
            program.ended_contexts.pop()
        self.registry.begin_step(program, now, context_chars=context_chars, arrived_at=arrived_at)
        node.in_flight += 1
        step = program.step_count
        lease = StepLease(
            program=program,
            node=node,
            step=step,
            request_id=f"{program_id}-{step}",
            arrived_at=arrived_at,
            sent_at=now,
            tool_s=program.last_tool_s,
            context_chars=context_chars,
            reuse_tokens=reuse,
            busy=busy,
            holding=holding,
            displaced_s=self._saturated_s(node.url) - full_s_before
            if entered_on == node.url
            else 0.0,
            program_class=program.program_class,
        )
        self.rebalance(now, backends=[node.url])
        return lease

    def _saturated_s(self, url: str | None) -> float:
        """Seconds the backend's engine was seen full so far (learners.Saturation)."""
        if url is None:
            return 0.0
        return self.schedule_of(url).saturation.seconds(self._now())

    async def _claim(
        self,
        program: Program,
        route: Route,
        arrived_at: float,
        context_chars: int,
        grows: int | None = None,
    ) -> bool:
        """A call that was not running is about to go out (or a returning call, whose whole
        context ``grows`` the program's claim): with other instances sharing the backends, make
        its KV claim in Redis, where the policy's fit test is made again against every
        instance's claims at once (claims.py). Refused, the backend is full as far as this
        instance is concerned: the program waits (False), and resumes where it fits, as if its
        own view had said so. A program forced back at its bound is not checked."""
        if self.claims is None or program.protected_until > self._now():
            return True
        node = self._choose(program.program_id, program.backend, route)
        if program.backend != node.url:
            return True  # its backend is gone: placement moves it, and the gate there follows
        if not program.step_count:
            # A first call that waited was sized when it arrived; what the prompts taught
            # since (calls of other programs) sizes it better now, before it is weighed.
            estimate = self._sizer(program.model).estimate(context_chars)
        else:
            # A later call is weighed at its whole context, as the gate sizes it and its step
            # will count it (state.begin_step), also after a wait: weighed at what its last
            # call left, a program paused for its growth would be resumed into room its call
            # does not fit, refused again, resumed again.
            estimate = self._call_tokens(program, context_chars)
        if estimate > program.total_tokens:
            self.registry.set_tokens(program, estimate)
        now = self._now()
        views = self.views()
        programs = views.programs
        if grows is not None:
            # Weighed as its call will be once out: its whole context, not its idle claim.
            me = replace(
                self.source.program_view(program), status=ProgramStatus.REASONING, tokens=grows
            )
            programs = [p for p in programs if p.program_id != program.program_id] + [me]
        b = views.backend(node.url)
        ask = shared_claims.ask(
            b,
            programs,
            self.config,
            now,
            first=not program.step_count,
            fill=None if grows is None else 1.0,
        )
        if ask is None:
            return True
        # Claims being checked for this instance's other calls (returning ones, not in the
        # registry's count yet) are part of what it claims.
        pending = self._pending.get(ask.backend, 0)
        growth = (
            0
            if grows is None
            else max(0, ask.demand - used_tokens(b, views.programs, self.config, now))
        )
        self._pending[ask.backend] = pending + growth
        try:
            granted = await self.claims.claim(
                ask.backend, ask.demand + pending, ask.whole, alone=ask.alone
            )
        finally:
            self._pending[ask.backend] -= growth
        if granted:
            return True
        if program.status is ProgramStatus.PAUSED or program.program_id not in self.registry:
            return program.status is not ProgramStatus.PAUSED  # changed meanwhile
        now = self._now()
        decision = shared_claims.refused(
            self.source.program_view(program), ask, self.claims.others(ask.backend)
        )
        self._log(decision, now)
        verb = "queued" if decision.action is Action.QUEUE else "paused"
        self.registry.pause(program, now, reason=f"{verb}: {decision.rule}")
        self.registry.set_waiting(program, program.waiting_since or arrived_at)
        return False

    async def _hold(
        self, program: Program, arrived_at: float, context_chars: int, *, take_over: bool
    ) -> bool | None:
        """A call of a program with calls in flight (or held): False where it may go out now;
        else it is held until the policy finds one more context room (``room_for_call``) or
        its class's bound passes (then it goes regardless: True), and None where the program
        was paused meanwhile (the caller waits for its resume). Held, it takes over the
        context its program's last ended call left, where ``take_over`` (not yet done)."""
        now = self._now()
        view = replace(
            self.source.program_view(program),
            tokens=max(program.total_tokens, self._call_tokens(program, context_chars)),
        )
        decision = self.policy.on_call(view, self.views(), now)
        if decision is None or decision.action is not Action.QUEUE:
            return False
        self._log(decision, now)
        if take_over and program.ended_contexts:
            # It came back: the room its last ended call left was kept for this call, which
            # waits now as a held call and claims room when it goes. Kept as well, each held
            # call's room counted twice: twelve threads of one program held all their calls
            # against the rooms their own ended calls had left, and made 27 calls in 40 s.
            program.ended_contexts.pop()
        program_id = program.program_id
        waiter = self._held.add(program_id)
        program.held_calls += 1
        self.source.held.add(program_id)
        if program.waiting_since is None:
            self.registry.set_waiting(program, arrived_at)
        bound = call_bound(program.program_class, program.created_at, arrived_at, self.config)
        try:
            with trio.move_on_at(arrived_at + bound):
                await waiter.wait()
            if not waiter.woken:
                self._log(
                    Decision(
                        Action.FORCE_RESUME,
                        program_id,
                        "max_wait",
                        program.backend,
                        waited_s=self._now() - arrived_at,
                        program_tokens=program.total_tokens,
                        detail={"held_call": True},
                    )
                )
            # Let go because it fits, or at its bound: it goes. Woken by its program's resume
            # (it had been paused meanwhile): it looks again, as one call among its others.
            return True if waiter.granted or not waiter.woken else None
        except BaseException:
            if not waiter.woken:
                self._log(
                    Decision(
                        Action.CANCEL,
                        program_id,
                        "client_disconnected",
                        program.backend,
                        waited_s=self._now() - arrived_at,
                        program_tokens=program.total_tokens,
                    )
                )
            raise
        finally:
            if waiter.granted:
                program.granted_calls -= 1  # it begins at once: in flight from now
            elif not waiter.woken:
                self._held.drop(program_id, waiter)
                self._unhold(program, 1)
            if (
                not program.held_calls
                and not self._waiters.has(program_id)
                and program.status is not ProgramStatus.PAUSED
            ):
                self.registry.set_waiting(program, None)

    def _unhold(self, program: Program, calls: int) -> None:
        """``calls`` of the program's held calls are no longer held (woken or gone)."""
        program.held_calls -= calls
        if not program.held_calls:
            self.source.held.discard(program.program_id)

    def _held_on(self, url: str) -> int:
        """Calls held back for a backend now: without holding they would be in flight there."""
        held = 0
        for program_id in {*self._waiters.programs(), *self._held.programs()}:
            program = self.registry.find(program_id)
            held += program is not None and program.backend == url
        return held

    def _observe_return(self, program: Program, arrived_at: float) -> bool:
        """Teach the backend's ledger whether the program came back while tr still counts its
        cache (costs.py), and say so (True where it was not idle)."""
        if program.acting_since is None or program.in_flight or program.backend is None:
            return True
        schedule = self.schedule_of(program.backend)
        returned = arrived_at - program.acting_since <= horizon_s(self.config)
        schedule.hold = schedule.hold.observe_return(returned)
        return returned

    def _gate_return(
        self, program: Program, arrived_at: float, context_chars: int
    ) -> Decision | None:
        """Pause a returning program now if the policy sees its call overflow its backend;
        the policy's decision (None: not gated)."""
        if program.status is not ProgramStatus.ACTING or program.in_flight or program.held_calls:
            return None
        node = self.pool.get(program.backend)
        if node is None or not node.healthy:
            return None  # placement moves it first; the new backend's own rebalance follows
        estimate = self._call_tokens(program, context_chars)
        view = replace(
            self.source.program_view(program), tokens=max(program.total_tokens, estimate)
        )
        now = self._now()
        decision = self.policy.on_return(view, self.views(), now)
        if decision is not None and decision.action is Action.PAUSE:
            self._log(decision, now)
            self.registry.pause(program, now, reason=f"paused: {decision.rule}")
            self.registry.set_waiting(program, arrived_at)
        return decision

    def _call_tokens(self, program: Program, context_chars: int) -> int:
        """A known program's next prompt, from its context: at its own measured rate once a
        call of it was measured, else at its model's."""
        if program.prompt_tokens_total:
            return program_estimate(context_chars, program.chars_per_token)
        return self._sizer(program.model).estimate(context_chars)

    def _sizer(self, model: str | None) -> PromptSizer:
        return self._sizers.get(model) or PromptSizer()

    def _admit(
        self,
        program_id: str,
        route: Route,
        arrived_at: float,
        context_chars: int,
        source: str | None = None,
        known: str | None = None,
        program_class: str | None = None,
        client: str | None = None,
    ) -> Program:
        """A program's first call: admitted as REASONING, or queued (PAUSED) by the policy;
        placed on ``known`` (where another instance ran it) while that backend is healthy."""
        klass = program_class or self.config.default_program_class
        estimate = self._sizer(route.requested).estimate(context_chars)
        node = self._choose(program_id, known, route)
        now = self._now()
        candidate = ProgramView(
            program_id,
            ProgramStatus.REASONING,
            node.url,
            estimate,
            created_at=now,
            eligible=self.source.eligible(route.requested),
            program_class=klass,
            client=client,
        )
        decision = self.policy.admit(candidate, self.views(), now)
        if decision is not None and decision.action is Action.QUEUE:
            bound = self.config.max_queue_wait_s
            wait = self.policy.expected_wait(decision.queue_position or 0, self._resume_times, now)
            if bound > 0 and wait > bound:
                self._log(replace(decision, action=Action.REJECT, detail={"expected_wait_s": wait}))
                raise QueueFull(
                    f"Program {program_id!r} would wait about {wait:.0f} s for KV capacity, more "
                    f"than --max-queue-wait {bound:g} s; retry later.",
                    retry_after_s=wait,
                    program_id=program_id,
                )
        if decision is not None:
            self._log(decision)
        if decision is not None and decision.action is Action.QUEUE:
            program, _ = self.registry.get_or_create(
                program_id,
                now,
                status=ProgramStatus.PAUSED,
                reason=f"queued: {decision.rule}",
                source=source,
            )
        else:
            created = arrived_at if decision is None else now
            program, _ = self.registry.get_or_create(program_id, created, source=source)
        program.model = route.requested
        program.program_class = klass
        program.client = client
        self.registry.assign(program, node.url)
        if decision is not None:
            self.registry.set_tokens(program, estimate)
        return program

    async def _wait_for_resume(self, program: Program, arrived_at: float) -> None:
        if program.waiting_since is None:
            self.registry.set_waiting(program, arrived_at)
        waiter = self._waiters.add(program.program_id)
        self.rebalance(self._now())
        since = program.waiting_since if program.waiting_since is not None else arrived_at
        bound = call_bound(program.program_class, program.created_at, since, self.config)
        try:
            # The bound is kept by the waiting request itself, at its own deadline, not by
            # the resume monitor's next tick.
            with trio.move_on_at(since + bound):
                await waiter.wait()
            if not waiter.woken:
                self._force_resume(program)
                if not waiter.woken:
                    await waiter.wait()  # no healthy backend serves it: it waits for one
        except BaseException:
            if self._waiters.drop(program.program_id, waiter):
                self.registry.set_waiting(program, None)
            if not waiter.woken:
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

    def _force_resume(self, program: Program) -> None:
        """The program's waiting request reached the bound: it goes back now (or, with no
        healthy backend for it, keeps waiting for one)."""
        if program.status is not ProgramStatus.PAUSED:
            return
        now = self._now()
        views = self.views()
        view = self.source.program_view(program)
        decision = policy_force_resume(view, views.backends, views.programs, self.config, now)
        if decision is not None:
            self._apply(decision, now)

    def _observe_costs(
        self, lease: StepLease, usage: StepUsage, first_token_at: float | None
    ) -> None:
        """What the call teaches the backend's hold ledger: the engine's prefill speed, and the
        call's cost (its wait, and the recompute of its own history it found evicted)."""
        schedule = self.schedule_of(lease.node.url)
        ledger = schedule.hold
        first_token_s = None if first_token_at is None else first_token_at - lease.sent_at
        uncached = (usage.prompt_tokens or 0) - (usage.cached_tokens or 0)
        if first_token_s is not None and usage.prompt_tokens:
            ledger = ledger.observe_prefill(uncached, first_token_s, usage.cached_tokens or 0)
        # A call let through only because too few programs had come back (the ledger itself
        # held: views.ViewSource.holding) is not what not holding costs: most such calls are
        # first calls, which cost nothing either way. Learnt as calls without holding, the 64
        # first calls of 64 agents made not holding look free, and holding stopped 239 s in
        # on the SWE-agent trace, where holding pays.
        learns = lease.holding or not ledger.holding
        if learns and (usage.cached_tokens is not None or not lease.reuse_tokens):
            ledger = ledger.observe_call(
                waited_s=lease.sent_at - lease.arrived_at,
                in_flight=lease.busy,
                reuse_tokens=lease.reuse_tokens,
                missed_tokens=max(0, lease.reuse_tokens - (usage.cached_tokens or 0)),
                holding=lease.holding,
                first_token_s=first_token_s,
                uncached_tokens=uncached,
                displaced_s=lease.displaced_s,
            )
        schedule.hold = ledger

    def close(
        self,
        lease: StepLease,
        usage: StepUsage,
        *,
        reason: str,
        first_token_at: float | None = None,
    ) -> bool:
        """End the lease (idempotent: False if it was already ended): the program's state, what
        the call teaches the learners, and the policy's reaction."""
        if lease.closed:
            return False
        lease.closed = True
        now = self._now()
        lease.node.in_flight -= 1
        program = lease.program
        self._observe_costs(lease, usage, first_token_at)
        schedule = self.schedule_of(lease.node.url)
        schedule.call_time = schedule.call_time.observe(now - lease.sent_at)
        tracked = program.program_id in self.registry
        if tracked:
            self.registry.end_step(program, now, usage, reason=reason)
            if program.in_flight or program.held_calls:
                # Its context stays cached for the program's next call (tr.weight).
                ended = program.ended_contexts
                ended[:] = [t for t in ended if now - t <= MAX_KEEP_S]
                ended.append(now)
        if usage.prompt_tokens:
            self._sizers[program.model] = self._sizer(program.model).observe(
                lease.context_chars, usage.prompt_tokens
            )
        if lease.step == 1 and usage.cached_tokens is not None:
            # A first call can only hit what other programs left: the shared prefix.
            schedule.shared_prefix = schedule.shared_prefix.observe(usage.cached_tokens)
        if not tracked:
            return True
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
        return True

    def _observe_gone(self, program: Program) -> None:
        """A program that ends between its calls never came back."""
        if program.acting_since is not None and not program.in_flight and program.backend:
            schedule = self.schedule_of(program.backend)
            schedule.hold = schedule.hold.observe_return(False)

    def release(self, program_id: str) -> Program:
        found = self.registry.find(program_id)
        if found is not None:
            self._observe_gone(found)
        program = self.registry.release(program_id, self._now())
        released = ProgramReleased(
            f"Program {program_id!r} was released while this request waited for capacity; "
            "the request was not sent. Send it again to start a new program.",
            program_id=program_id,
        )
        if found is not None:
            self._unhold(found, self._held.wake(program_id, released))
        self._waiters.wake(program_id, released)
        self.rebalance(self._now())
        return program

    # -- periodic and event-driven rebalancing ---------------------------------------------------

    def tick(self) -> None:
        """Periodic work (the resume monitor): learn from the engines, retire idle programs,
        force-resume programs that waited too long, rebalance."""
        now = self._now()
        self.source.refresh()  # served models may have changed with the last poll
        for node in self.pool:
            snapshot = node.snapshot
            if snapshot is not None and snapshot.preemptions_total is not None:
                schedule = self.schedule_of(node.url)
                schedule.capacity = schedule.capacity.observe(snapshot.preemptions_total)
            if node.last_poll_at is not None:
                schedule = self.schedule_of(node.url)
                schedule.tiers = schedule.tiers.observe(snapshot, node.last_poll_at)
                schedule.saturation = schedule.saturation.observe(
                    node.last_poll_at,
                    None if snapshot is None else snapshot.kv_usage,
                    None if snapshot is None else snapshot.waiting,
                )
        self.registry.presume_ended(now)  # programs never released stop holding capacity
        for decision in self.policy.retire(self.views(), now):
            self._apply(decision, now)
        self.rebalance(now)

    def rebalance(self, now: float, *, backends: Iterable[str] | None = None) -> None:
        """Apply the policy: pause or mark where over capacity, then resume where there is room."""
        wanted = None if backends is None else frozenset(backends)
        for decision in self.policy.rebalance(self.views(), now, backends=wanted):
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
            self._waiters.wake(program.program_id)
            # Its held calls, if it was paused with any: they look again.
            self._unhold(program, self._held.wake(program.program_id))
        elif action is Action.ADMIT and self._held.wake_one(program.program_id):
            # A held call that fits now: one more context from here on.
            self._unhold(program, 1)
            program.granted_calls += 1
        elif action is Action.RETIRE:
            self._observe_gone(program)
            self.registry.release(program.program_id, now, reason="retired: idle lease expired")
        self._log(decision, now)

    def _log(self, decision: Decision, now: float | None = None) -> None:
        at = self._now() if now is None else now
        self.audit.record(DecisionRecord.from_decision(decision, at))


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
