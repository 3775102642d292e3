"""What the policy sees: frozen views of the programs and backends, built from the registry,
the pool and what the scheduler learned about each backend; and placement within a group."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..backends import BackendNode, BackendPool, Route
from ..errors import ModelNotFound, NoBackendAvailable
from ..programs import Program, ProgramRegistry, ProgramStatus
from .claims import holds
from .costs import HoldLedger
from .learners import CallTime, CapacityFactor, Saturation, SharedPrefix
from .placement import Candidate, choose_backend
from .policies import Views
from .tiers import Tiers
from .tiers import gate as tier_gate
from .tr import MAX_KEEP_S, BackendView, PolicyConfig, ProgramView, decay, used_tokens


@dataclass
class BackendSchedule:
    """What the scheduler learns about one backend beyond its metrics."""

    shared_prefix: SharedPrefix = SharedPrefix()
    capacity: CapacityFactor = CapacityFactor()
    last_pause_at: float | None = None
    last_resume_at: float | None = None
    #: The last capacity seen, kept when a poll fails so scheduling does not stop.
    capacity_tokens: int | None = None
    #: Whether holding programs back pays here (costs.py).
    hold: HoldLedger = HoldLedger()
    #: The backend's KV tiers as its polls showed them (tiers.py).
    tiers: Tiers = Tiers()
    #: How long its engine was seen full: what of a held call's wait it would have spent in the
    #: engine's queue without holding (learners.Saturation, costs.HoldLedger).
    saturation: Saturation = Saturation()
    #: How long its calls take (tr.resume_cooldown spaces resume rounds by it).
    call_time: CallTime = CallTime()


class ViewSource:
    def __init__(
        self,
        registry: ProgramRegistry,
        pool: BackendPool,
        config: PolicyConfig,
        *,
        others: Callable[[str], int] | None = None,
        shared: Callable[[], bool] | None = None,
    ) -> None:
        self.registry = registry
        self.pool = pool
        self.config = config
        #: Tokens other instances' programs claim on a backend (shared through Redis); they
        #: come off its capacity (tr.limit), so tr admits here only what fits beside them.
        self.others = others
        #: Whether other live instances share the backends (Redis); where they do, tr holds
        #: whatever the hold ledger says (claims.holds).
        self.shared = shared
        self._schedules: dict[str, BackendSchedule] = {}
        #: Seconds each program's sent calls waited in the proxy (``note_wait``).
        self._waited: dict[str, float] = {}
        #: Backends serving each model; cleared by ``refresh`` (after each metrics poll).
        self._eligible: dict[str | None, frozenset[str] | None] = {}
        #: ProgramViews built so far: what a call costs grows with them (tests bound it).
        self.programs_viewed = 0
        #: Programs a call of which is held until one more context fits (tr.on_call).
        self.held: set[str] = set()

    def refresh(self) -> None:
        self._eligible.clear()

    def schedule_of(self, url: str) -> BackendSchedule:
        schedule = self._schedules.get(url)
        if schedule is None:
            schedule = self._schedules[url] = BackendSchedule()
        return schedule

    def backend_views(self) -> list[BackendView]:
        views = []
        for node in self.pool:
            schedule = self.schedule_of(node.url)
            capacity = node.capacity_tokens
            if capacity is not None:
                schedule.capacity_tokens = capacity
            hold, inputs = self.holding(schedule)
            # Not holding because too few programs come back, or because it was measured not
            # to pay: the decisions say which.
            unheld = "few_returns" if self.awaiting_returns(schedule) else "hold_does_not_pay"
            gate = tier_gate(
                schedule.capacity_tokens, schedule.tiers, schedule.capacity.factor, self.config
            )
            views.append(
                BackendView(
                    url=node.url,
                    healthy=node.healthy,
                    capacity_tokens=gate.capacity_tokens,
                    shared_prefix_tokens=schedule.shared_prefix.tokens,
                    capacity_factor=schedule.capacity.factor,
                    last_pause_at=schedule.last_pause_at,
                    last_resume_at=schedule.last_resume_at,
                    others_tokens=0 if self.others is None else self.others(node.url),
                    hold=hold,
                    hold_inputs=inputs,
                    unheld_rule=unheld,
                    gpu_tokens=schedule.capacity_tokens if gate.spill_tokens else None,
                    prefill_s_per_token=schedule.hold.prefill_s_per_token,
                    call_s=schedule.call_time.seconds,
                )
            )
        return views

    def holding(self, schedule: BackendSchedule) -> tuple[bool, dict[str, float]]:
        """Whether tr holds programs back on a backend (the ``hold`` setting, or in ``auto``
        what its ledger measured, and always while other instances share the backends:
        claims.holds), and the measurements behind it."""
        mode = self.config.hold
        if mode == "auto":
            shared = self.shared is not None and self.shared()
            held = schedule.hold.holding and not self.awaiting_returns(schedule)
            return holds(held, shared), schedule.hold.inputs()
        return mode == "always", {}

    def awaiting_returns(self, schedule: BackendSchedule) -> bool:
        """Whether the ledger holds on a backend but too few programs came back there yet.
        Holding keeps caches for programs that come back: until most idle programs are seen
        back, it has little to keep (costs.HoldLedger.seen_returns, ``--return-evidence``)."""
        ledger = schedule.hold
        return self.config.return_evidence and ledger.holding and not ledger.seen_returns

    def used_by_backend(self, now: float) -> dict[str, int]:
        """The KV tokens this instance's programs claim on each backend at ``now``, as tr's
        capacity model counts them (what other instances subtract from its capacity)."""
        views = self.views(now)
        programs = views.programs
        return {b.url: used_tokens(b, programs, self.config, now) for b in views.backends}

    def eligible(self, model: str | None) -> frozenset[str] | None:
        """The backends a program of ``model`` may use (None: any of them)."""
        if model not in self._eligible:
            try:
                urls = self.pool.route(model).urls
            except ModelNotFound:
                return None  # no backend serves it now: nothing to keep it to
            self._eligible[model] = None if urls == frozenset(self.pool.urls) else urls
        return self._eligible[model]

    def note_wait(self, program_id: str, seconds: float) -> None:
        """A call of ``program_id`` goes out after ``seconds`` in the proxy. What a program has
        waited in all orders the resumes (tr.priority), so that waits are spread over the
        programs instead of piling up on the same ones."""
        if seconds > 0:
            self._waited[program_id] = self._waited.get(program_id, 0.0) + seconds
        if len(self._waited) > 2 * len(self.registry) + 64:
            # Released programs' totals go in one pass now and then, not on every release.
            self._waited = {k: v for k, v in self._waited.items() if k in self.registry}

    def used_bound(self, b: BackendView) -> int:
        """At least what ``tr.used_tokens`` counts on ``b`` over the programs ``views``
        sees, at any time, from the registry's index: it walks the calls in flight and the
        waiting requests, not the programs tracked.

        ``used_tokens`` sums each counted program's ``weight`` and takes the shared prefix
        off for every counted context past the first. Here: a REASONING program (each of its
        calls in flight a context of its own, ``tr.contexts``), or an
        ACTING one whose request waits, weighs its tokens and the decode buffer, as there; an
        ACTING program weighs at most its tokens times the tool coefficient (its claim only
        decays, or is whole or nothing with a keep horizon), summed over the backend's
        acting programs in one product (the index keeps their tokens' sum), plus one token
        for the product's rounding against the per-program ones; PAUSED programs weigh
        nothing. The prefix is taken off only for the calls of the REASONING programs not
        marked, which every such sum counts. Terms that could be negative are left out, so the
        bound holds over any subset of the programs that keeps those REASONING ones:
        ``on_return``'s, which leaves out the returning (ACTING) program."""
        cfg = self.config
        buffer = cfg.decode_buffer
        index = self.registry.backend_index(b.url)
        if index is None:
            return 0
        total = 0
        reasoning = 0
        for p in index.reasoning.values():
            if not p.marked_for_pause:
                calls = max(1, p.in_flight + p.granted_calls)
                total += calls * max(0, p.total_tokens + buffer)
                reasoning += calls
                # The contexts its ended calls left weigh at most an idle program's claim.
                coefficient = max(0.0, cfg.tool_coefficient)
                total += math.ceil(coefficient * p.total_tokens * len(p.ended_contexts))
        total += math.ceil(max(0.0, cfg.tool_coefficient) * index.acting_tokens) + 1
        for p in self.registry.waiting():
            if p.status is ProgramStatus.ACTING and p.backend == b.url and not p.marked_for_pause:
                total += max(0, p.total_tokens + buffer)
        return max(0, total - max(0, reasoning - 1) * b.shared_prefix_tokens)

    def paused(self) -> bool:
        return self.registry.counts()[ProgramStatus.PAUSED] > 0

    def program_view(self, p: Program) -> ProgramView:
        self.programs_viewed += 1
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
            in_flight=p.in_flight + p.granted_calls,
            eligible=self.eligible(p.model),
            steps=p.step_count,
            tool_s=p.last_tool_s,
            waited_total_s=self._waited.get(p.program_id, 0.0),
            program_class=p.program_class or self.config.default_program_class,
            client=p.client,
            held=p.held_calls,
            ended=tuple(p.ended_contexts),
        )

    def views(self, now: float) -> Views:
        """What the policy sees at ``now``: the programs a decision can involve (an idle
        program whose claim on KV has decayed to nothing cannot change one), and on demand the
        programs idle for a while (for retiring)."""
        config = self.config

        def claims(p: Program) -> bool:
            idle = 0.0 if p.acting_since is None else now - p.acting_since
            tokens = p.total_tokens * config.tool_coefficient
            return (
                p.waiting_since is not None
                or int(tokens * decay(idle, config.acting_half_life_s)) > 0
                or (config.idle_claims == "break_even" and idle <= MAX_KEEP_S)
            )

        def programs() -> list[ProgramView]:
            return [self.program_view(p) for p in self.registry.relevant(claims)]

        def idle(seconds: float) -> list[ProgramView]:
            return [self.program_view(p) for p in self.registry.idle_since(now - seconds)]

        return Views(
            programs,
            self.backend_views,
            idle,
            bound=self.used_bound,
            paused=self.paused,
            waiting=self.registry.waiting_count,
            held=lambda: bool(self.held),
        )

    def choose(self, program_id: str, current: str | None, route: Route) -> BackendNode:
        """The backend of ``route`` a program goes to: sticky while healthy, else the least
        loaded (placement.py); raises NoBackendAvailable when none of the group is healthy."""
        if current is not None:
            # placement's first rule, taken here without the per-backend loads it does not
            # need: the common case, a program's every call after its first.
            for n in route.nodes:
                if n.url == current and n.healthy:
                    return n
        loads = self.registry.load_by_backend()
        candidates = [
            Candidate(
                url=n.url,
                healthy=n.healthy,
                active_tokens=loads[n.url].active_tokens if n.url in loads else 0,
                programs=loads[n.url].total if n.url in loads else 0,
            )
            for n in route.nodes
        ]
        node = self.pool.get(choose_backend(current, candidates))
        if node is None:
            group = "" if route.requested is None else f" serving {route.requested!r}"
            raise NoBackendAvailable(
                f"No healthy backend{group} for program {program_id!r}: all of "
                f"{', '.join(n.url for n in route.nodes) or 'none'} failed their last health "
                "check; check that they are running."
            )
        return node
