"""The gateway's admission stage: limits per model and program class, the wait queue, and
fallback chains, around the pure :class:`~.limiter.Limiter`.

A call is admitted at once when it fits and nobody of its class waits ahead of it on that model;
otherwise it waits in its class's FIFO queue (calls of programs that already ran go ahead of
newcomers) for at most the class's ``max_wait``. A program whose model is an alias with
fallbacks (``[aliases] coder = ["qwen-32b", "qwen-8b"]``) is pinned to a model of the chain at
its first admission and keeps it; it moves down the chain only when its model's backends are all
down or its wait ran out, and each move is a ``fallback`` decision. Every outcome is a
``decisions`` row with the inputs it was made on.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from ..audit import AuditLog
from ..audit.records import DecisionRecord
from ..backends import BackendPool
from ..config import Settings
from ..config.limits import ClassSpec, LimitsSpec
from ..errors import InvalidRequest, RateLimited
from ..gateway import Admitted, Call
from ..programs import StepUsage
from ..scheduling.classes import named_class
from ..scheduling.learners import PromptSizer
from .limiter import DIMENSIONS, WINDOWED, Limiter, Reservation, Verdict, window_end
from .shared import SharedLimits

log = logging.getLogger("thunderproxy.admission")

#: Programs remembered for their pinned model; the oldest are forgotten past this.
PINNED_PROGRAMS = 100_000
#: Weight of the newest completion in a model's learned completion length.
COMPLETION_ALPHA = 0.2
#: Seconds between the log's summaries of refused calls (the first refusal is logged at once).
REFUSALS_EVERY_S = 60.0


@dataclass
class Ticket(Admitted):
    """An admitted call: what it reserved, to be settled once when it ends."""

    program_id: str = ""
    klass: str = ""
    reservation: Reservation | None = None
    context_chars: int = 0
    settled: bool = False


@dataclass
class Waiter:
    program_id: str
    returning: bool
    tokens: int
    event: trio.Event = field(default_factory=trio.Event)


def program_class(call: Call) -> str | None:
    """The class a call names: ``program_class`` in its body or ``extra_body``, else the
    ``X-Program-Class`` header (the same name the scheduler reads its latency class from)."""
    return named_class(call.body, call.headers)


def requested_completion(body: Mapping[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


class AdmissionService:
    """Implements the gateway's ``Admission``: ``admit`` before the lease, ``done`` once after."""

    def __init__(
        self,
        spec: LimitsSpec,
        *,
        pool: BackendPool,
        audit: AuditLog,
        instance: str = "local",
        offset: float = 0.0,
        shared: SharedLimits | None = None,
        place: Callable[[str, str], str | None] | None = None,
    ) -> None:
        self.spec = spec
        #: Unix time minus trio time: windows are aligned on the wall clock's minutes and days,
        #: so that every instance (and a reader of the audit db) agrees where they start.
        self.offset = offset
        self.pool = pool
        self.audit = audit
        self.instance = instance
        self.limiter = Limiter(spec)
        #: Redis counters shared with the other instances (None: this instance alone).
        self.shared = shared
        #: The backend the scheduler will give a program's call of a model (its current one
        #: while healthy, else the least loaded), for backends with limits of their own.
        self.place = place
        #: Waiting calls by (model, class, client): the client only for a client with limits of
        #: its own, whose calls wait apart so that a client over its limit holds up no other's.
        self.queues: dict[tuple[str, str, str | None], deque[Waiter]] = {}
        #: program -> index in its model's chain it was admitted on (kept while it runs).
        self.pinned: OrderedDict[str, int] = OrderedDict()
        self.sizers: dict[str, PromptSizer] = {}
        self.completions: dict[str, float] = {}
        self.counts: dict[str, int] = {"admit": 0, "queue": 0, "reject": 0, "fallback": 0}
        #: Refusals not logged yet, by (model, class, limit), and when the last summary was.
        self._refused: dict[tuple[str, str, str], int] = {}
        self._refusals_logged_at: float | None = None

    # -- the gateway's two calls ----------------------------------------------------------------

    async def admit(self, call: Call, now: float) -> Admitted:
        self._summarise(now)
        klass = self._class(call)
        chain = self._chain(call.model)
        index = self.pinned.get(call.program_id, 0)
        returning = call.program_id in self.pinned
        client = call.client
        while True:
            served = chain[index] if chain else None
            if served is not None and index + 1 < len(chain) and not self._healthy(served):
                index = self._fall_back(call, klass, chain, index, "backends down", now)
                continue
            tokens = self._estimate(served, call)
            reservation = None
            refusal = Verdict(False)
            if served is not None and self._limited(served, client):
                outcome = await self._wait(call, served, klass, tokens, returning, now)
                now = trio.current_time()
                if isinstance(outcome, Verdict):
                    refusal = outcome
                else:
                    reservation = outcome
            if reservation is not None or served is None or not self._limited(served, client):
                self._pin(call.program_id, index)
                return Ticket(
                    served=None if served == call.model else served,
                    program_id=call.program_id,
                    klass=klass.name,
                    reservation=reservation,
                    context_chars=call.context_chars,
                )
            if index + 1 < len(chain) and refusal.scope != "client":
                # A client's own limit counts every model: another link would not help.
                index = self._fall_back(call, klass, chain, index, "wait budget spent", now)
                continue
            raise self._refuse(call, served, klass, tokens, refusal, now)

    def done(self, admitted: Admitted, usage: StepUsage | None, status: int, now: float) -> None:
        self._summarise(now)
        if not isinstance(admitted, Ticket) or admitted.settled:
            return
        admitted.settled = True
        reservation = admitted.reservation
        if reservation is None:
            return
        tokens = None
        if usage is not None and usage.prompt_tokens is not None:
            tokens = usage.prompt_tokens + (usage.completion_tokens or 0)
            self._learn(reservation.model, admitted.context_chars, usage)
        settlement = self.limiter.settle(reservation, tokens, now + self.offset)
        if self.shared is not None and tokens is not None:
            delta = tokens - reservation.tokens
            if self.limiter.limits(reservation.model) is not None:
                self.shared.settle(reservation, delta, now + self.offset)
            if reservation.backend is not None:
                on_backend = replace(reservation, model=backend_key(reservation.backend))
                self.shared.settle(on_backend, delta, now + self.offset)
            if reservation.client is not None:
                by_client = replace(reservation, model=client_key(reservation.client))
                self.shared.settle(by_client, delta, now + self.offset)
        for action, amount in (("refund", settlement.refund), ("overage", settlement.overage)):
            if amount:
                self._decide(
                    now,
                    admitted.program_id,
                    action,
                    "admission.settle",
                    model=reservation.model,
                    klass=reservation.klass,
                    reserved=reservation.tokens,
                    extra={"reported_tokens": tokens, "tokens": amount, "status": status},
                    client=reservation.client,
                )
        self._wake(reservation.model, reservation.client)

    # -- the queue ------------------------------------------------------------------------------

    async def _wait(
        self, call: Call, model: str, klass: ClassSpec, tokens: int, returning: bool, now: float
    ) -> Reservation | Verdict:
        """The call's reservation, or the verdict that kept it out past its wait."""
        client = call.client
        own = client if self.limiter.client_limits(client) is not None else None
        queue = self.queues.setdefault((model, klass.name, own), deque())
        waiter = Waiter(call.program_id, returning, tokens)
        if not queue:
            reservation, verdict = await self._try(
                call.program_id, model, klass, tokens, now, 0.0, client
            )
            if reservation is not None:
                return reservation
        else:
            verdict = Verdict(False, retry_at=None)
        if verdict.never or klass.max_wait_s <= 0:
            # A class that may not wait is refused on this one check: no queue entry, no queue
            # row for a call that never waited, no second and third check of the same limits.
            return verdict
        position = self._enqueue(queue, waiter)
        self.counts["queue"] += 1
        self._decide(
            now,
            call.program_id,
            "queue",
            f"admission.{verdict.dimension or 'fifo'}",
            model=model,
            klass=klass.name,
            reserved=tokens,
            verdict=verdict,
            position=position,
            client=client,
        )
        deadline = now + klass.max_wait_s
        try:
            while True:
                now = trio.current_time()
                if queue[0] is waiter:
                    waited = now - (deadline - klass.max_wait_s)
                    reservation, verdict = await self._try(
                        call.program_id, model, klass, tokens, now, waited, client
                    )
                    if reservation is not None:
                        return reservation
                    if verdict.never:
                        return verdict
                if now >= deadline:
                    return verdict
                retry_at = None if verdict.retry_at is None else verdict.retry_at - self.offset
                wake_at = min(deadline, retry_at or deadline)
                with trio.move_on_at(wake_at):
                    await waiter.event.wait()
                waiter.event = trio.Event()
        finally:
            # Admitted, timed out or cancelled (the client left): out of the queue at once,
            # and whoever is now at the head may go.
            if waiter in queue:
                queue.remove(waiter)
            self._wake(model, client)

    async def _try(
        self,
        program_id: str,
        model: str,
        klass: ClassSpec,
        tokens: int,
        now: float,
        waited: float,
        client: str | None = None,
    ) -> tuple[Reservation | None, Verdict]:
        """Reserve locally if the call fits this instance's share, then in the shared windows;
        a refusal there takes the local reservation back."""
        backend = None if self.place is None else self.place(program_id, model)
        verdict = self._check(model, klass, tokens, now, backend, client)
        if not verdict.admitted:
            return None, verdict
        reservation = self.limiter.reserve(
            model, klass.name, tokens, now + self.offset, backend, client
        )
        # The model's global windows, then the backend's and the client's (each keyed apart
        # from any model's).
        counted = [("model", model, self.limiter.limits(model))]
        if reservation.backend is not None:
            counted.append(
                ("backend", backend_key(reservation.backend), self.limiter.backend_limits(backend))
            )
        if reservation.client is not None:
            counted.append(
                ("client", client_key(reservation.client), self.limiter.client_limits(client))
            )
        taken: list[str] = []
        for scope, key, limits in counted if self.shared is not None else ():
            if limits is None or self.shared is None:
                continue
            answer = await self.shared.reserve(key, limits, tokens, now + self.offset)
            if not answer.admitted:
                unix = trio.current_time() + self.offset
                self.limiter.cancel(reservation, unix)
                for earlier in taken:
                    # An earlier key's windows counted this call already: give it back.
                    self.shared.settle(replace(reservation, model=earlier), -tokens, unix)
                size = WINDOWED[answer.dimension or "rpm"][0]
                limit = getattr(limits, answer.dimension or "rpm")
                return None, Verdict(
                    False,
                    answer.dimension,
                    limit,
                    answer.used,
                    tokens,
                    window_end(unix, size),
                    scope=scope,
                )
            taken.append(key)
        self._admitted(program_id, model, klass, tokens, now, waited, client)
        return reservation, verdict

    def _enqueue(self, queue: deque[Waiter], waiter: Waiter) -> int:
        """FIFO, except that a program that already ran goes ahead of newcomers."""
        if waiter.returning:
            for position, other in enumerate(queue):
                if not other.returning and position > 0:
                    queue.insert(position, waiter)
                    return position
        queue.append(waiter)
        return len(queue) - 1

    def _wake(self, model: str, client: str | None = None) -> None:
        """Wake the head of every queue on ``model``, and of ``client``'s own queues on any
        model (a call of its that ended may be what their heads wait for)."""
        for (queued_model, _, owner), queue in self.queues.items():
            if queue and (queued_model == model or (client is not None and owner == client)):
                queue[0].event.set()

    def _hungry(self, model: str) -> set[str]:
        return {k for (m, k, _), queue in self.queues.items() if m == model and queue}

    def _check(
        self,
        model: str,
        klass: ClassSpec,
        tokens: int,
        now: float,
        backend: str | None = None,
        client: str | None = None,
    ) -> Verdict:
        """The client's own limits first (what it alone can do something about), then the
        model's split among classes, then the backend's."""
        on_client = self.limiter.check_client(client, tokens, now + self.offset)
        if not on_client.admitted:
            return on_client
        hungry = self._hungry(model) - {klass.name}
        verdict = self.limiter.check(model, klass, tokens, now + self.offset, hungry)
        if not verdict.admitted:
            return verdict
        on_backend = self.limiter.check_backend(backend, tokens, now + self.offset)
        return verdict if on_backend.admitted else on_backend

    def _limited(self, model: str, client: str | None = None) -> bool:
        """Whether calls of ``model`` pass the limiter: it, a backend serving it, or the
        calling client has limits."""
        if self.limiter.limits(model) is not None:
            return True
        if self.limiter.client_limits(client) is not None:
            return True
        return any(
            self.limiter.backend_limits(n.url) is not None for n in self.pool if n.serves(model)
        )

    def _admitted(
        self,
        program_id: str,
        model: str,
        klass: ClassSpec,
        tokens: int,
        now: float,
        waited: float,
        client: str | None = None,
    ) -> None:
        self.counts["admit"] += 1
        self._decide(
            now,
            program_id,
            "admit",
            "admission.within_limits",
            model=model,
            klass=klass.name,
            reserved=tokens,
            waited=waited,
            client=client,
        )

    # -- fallbacks and refusals -----------------------------------------------------------------

    def _fall_back(
        self, call: Call, klass: ClassSpec, chain: tuple[str, ...], index: int, why: str, now: float
    ) -> int:
        self.counts["fallback"] += 1
        log.info(
            "program %s moves from %s to %s (%s; alias %s)",
            call.program_id,
            chain[index],
            chain[index + 1],
            why,
            call.model,
        )
        self._decide(
            now,
            call.program_id,
            "fallback",
            "admission.fallback",
            model=chain[index],
            klass=klass.name,
            reserved=None,
            extra={"to": chain[index + 1], "alias": call.model, "why": why},
            client=call.client,
        )
        return index + 1

    def _refuse(
        self, call: Call, model: str, klass: ClassSpec, tokens: int, refusal: Verdict, now: float
    ) -> RateLimited:
        # The verdict that held it; one still behind others of its class is measured now.
        client = call.client
        verdict = (
            refusal if refusal.dimension else self._check(model, klass, tokens, now, None, client)
        )
        if verdict.admitted:
            verdict = Verdict(False, retry_at=now + self.offset + 1.0)
        self.counts["reject"] += 1
        self._decide(
            now,
            call.program_id,
            "reject",
            f"admission.{verdict.dimension or 'fifo'}",
            model=model,
            klass=klass.name,
            reserved=tokens,
            verdict=verdict,
            client=client,
        )
        dimension = verdict.dimension or "queue"
        shown = f"client {client}'s {dimension}" if verdict.scope == "client" else dimension
        key = (model, klass.name, shown)
        self._refused[key] = self._refused.get(key, 0) + 1
        self._summarise(now)
        if verdict.scope == "client" and client is not None:
            unix = now + self.offset
            retry = 60.0 if verdict.never else max(1.0, (verdict.retry_at or unix + 1.0) - unix)
            message = self._client_message(client, dimension, verdict, klass, retry)
        elif verdict.never:
            retry = 60.0
            message = self._never_message(model, klass, dimension, verdict)
        elif verdict.limit is None:
            retry = 1.0
            message = (
                f"Rate limit reached for {model}: calls of class {klass.name!r} queued ahead of "
                f"this one for its whole {klass.max_wait_s:g}s wait; retry after {retry:.0f}s."
            )
        else:
            unix = now + self.offset
            retry = max(1.0, (verdict.retry_at or unix + 1.0) - unix)
            message = (
                f"Rate limit reached for {model} ({dimension}: {verdict.used} used of "
                f"{verdict.limit:g} for class {klass.name!r}) after waiting "
                f"{klass.max_wait_s:g}s; retry after {retry:.0f}s."
            )
        return RateLimited(message, retry_after_s=retry, program_id=call.program_id)

    def _summarise(self, now: float) -> None:
        """Log the refusals not logged yet, at most once every ``REFUSALS_EVERY_S``: one line
        for a minute of 429s, not one per call (the decisions rows keep each)."""
        if not self._refused:
            return
        since = self._refusals_logged_at
        if since is not None and now - since < REFUSALS_EVERY_S:
            return
        refused = sorted(self._refused.items(), key=lambda item: -item[1])
        total = sum(n for _, n in refused)
        log.warning(
            "admission refused %d call%s%s: %s (429 by [limits]; a summary at most every %g s)",
            total,
            "" if total == 1 else "s",
            "" if since is None else f" in the last {now - since:.0f} s",
            ", ".join(
                f"{n} of {model} class {klass!r} on {dimension}"
                for (model, klass, dimension), n in refused
            ),
            REFUSALS_EVERY_S,
        )
        self._refused.clear()
        self._refusals_logged_at = now

    def _client_message(
        self, client: str, dimension: str, verdict: Verdict, klass: ClassSpec, retry: float
    ) -> str:
        """A call over its client's own limit: the client's, not the model's, and what helps."""
        share = self.limiter.share
        split = f" (this instance's share is 1/{round(1 / share)})" if share < 1 else ""
        limit = f"{verdict.used} used of {verdict.limit:g}{split}"
        if verdict.never:
            unit = "tokens" if WINDOWED.get(dimension, (0.0, False))[1] else "calls"
            return (
                f"This call needs {verdict.need} {unit} of client {client}'s {dimension} limit "
                f"({limit}); send a smaller call, or ask the operator to raise "
                f"limits.clients.{client}.{dimension} in [limits]."
            )
        waited = f" after waiting {klass.max_wait_s:g}s" if klass.max_wait_s > 0 else ""
        until = "one of its calls ends" if dimension == "concurrent" else "its window closes"
        return (
            f"Rate limit reached for client {client} ({dimension}: {limit}){waited}; retry "
            f"after {retry:.0f}s, when {until}, or ask the operator to raise "
            f"limits.clients.{client}.{dimension} in [limits]."
        )

    def _never_message(self, model: str, klass: ClassSpec, dimension: str, verdict: Verdict) -> str:
        """Why a call can never be admitted, and the one remedy that helps: a smaller call
        for a token limit; for a count of requests, only a larger limit or part."""
        most = verdict.limit or 0.0
        share = self.limiter.share
        split = f" (this instance's share is 1/{round(1 / share)})" if share < 1 else ""
        if WINDOWED.get(dimension, (0.0, False))[1]:
            return (
                f"This call needs {verdict.need} tokens of {model}'s {dimension} but class "
                f"{klass.name!r} can have at most {most:g}{split}; send a shorter prompt or a "
                f"smaller max_tokens, or raise limits.models.{model}.{dimension} in [limits]."
            )
        return (
            f"Class {klass.name!r} can never run a call of {model}: its part of {model}'s "
            f"{dimension} limit is {most:g}, less than one call{split}; raise "
            f"limits.models.{model}.{dimension} or limits.classes.{klass.name}.ratio in "
            "[limits], or send the call with another program_class."
        )

    # -- helpers --------------------------------------------------------------------------------

    def _class(self, call: Call) -> ClassSpec:
        name = program_class(call) or self.spec.default_class
        klass = self.spec.klass(name)
        if klass is None:
            raise InvalidRequest(
                f"Unknown program class {name!r}; use one of: "
                + ", ".join(c.name for c in self.spec.classes)
                + " (program_class in the body or the X-Program-Class header).",
                param="program_class",
                program_id=call.program_id,
            )
        return klass

    def _chain(self, model: str | None) -> tuple[str, ...]:
        if model is None:
            return ()
        return self.pool.chain(model)

    def _healthy(self, model: str) -> bool:
        return any(n.healthy for n in self.pool if n.serves(model))

    def _pin(self, program_id: str, index: int) -> None:
        self.pinned[program_id] = index
        self.pinned.move_to_end(program_id)
        while len(self.pinned) > PINNED_PROGRAMS:
            self.pinned.popitem(last=False)

    def _estimate(self, model: str | None, call: Call) -> int:
        """Prompt tokens from the call's characters (the model's learned sizer) plus the
        completion it may produce: its max_tokens, else what the model's completions measured."""
        key = model or ""
        prompt = self.sizers.get(key, PromptSizer()).estimate(call.context_chars)
        completion = requested_completion(call.body)
        if completion is None:
            completion = round(self.completions.get(key, self.spec.completion_tokens))
        return max(1, prompt + completion)

    def _learn(self, model: str, chars: int, usage: StepUsage) -> None:
        if usage.prompt_tokens is not None:
            self.sizers[model] = self.sizers.get(model, PromptSizer()).observe(
                chars, usage.prompt_tokens
            )
        if usage.completion_tokens is not None:
            old = self.completions.get(model, float(self.spec.completion_tokens))
            self.completions[model] = old + COMPLETION_ALPHA * (usage.completion_tokens - old)

    def _decide(
        self,
        now: float,
        program_id: str,
        action: str,
        rule: str,
        *,
        model: str,
        klass: str,
        reserved: int | None,
        verdict: Verdict | None = None,
        waited: float | None = None,
        position: int | None = None,
        extra: Mapping[str, Any] | None = None,
        client: str | None = None,
    ) -> None:
        detail: dict[str, Any] = {
            "model": model,
            "class": klass,
            "instance": self.instance,
            "share": self.limiter.share,
        }
        if client is not None:
            detail["client"] = client
        if verdict is not None and verdict.dimension is not None:
            size = WINDOWED.get(verdict.dimension, (None, False))[0]
            detail.update(
                limited_by=verdict.scope,
                dimension=verdict.dimension,
                window_s=size,
                window_start=None
                if size is None or verdict.retry_at is None
                else verdict.retry_at - size,
                limit=verdict.limit,
                used=verdict.used,
            )
        limits = self.limiter.limits(model)
        if limits is not None:
            # The capacity this instance enforced, so a reader compares usage with it per row.
            detail["limits"] = {
                d: getattr(limits, d) * self.limiter.share
                for d in DIMENSIONS
                if getattr(limits, d) is not None
            }
        if extra:
            detail.update(extra)
        self.audit.record(
            DecisionRecord(
                at=now,
                program_id=program_id,
                action=action,
                rule=rule,
                backend=None,
                target_backend=None,
                capacity_tokens=None
                if verdict is None or verdict.limit is None
                else int(verdict.limit),
                used_tokens=None if verdict is None else verdict.used,
                program_tokens=reserved,
                idle_s=None,
                waited_s=waited,
                queue_position=position,
                detail=json.dumps(detail),
            )
        )

    # -- what /health and /metrics show ---------------------------------------------------------

    def statistics(self, now: float) -> dict[str, Any]:
        self._summarise(now)  # a quiet proxy's last refusals are still logged when read
        now += self.offset
        models: dict[str, Any] = {}
        for model, limits in self.spec.models.items():
            classes: dict[str, Any] = {}
            for klass in self.spec.classes:
                usage = self.limiter.usage(model, klass.name)
                classes[klass.name] = {
                    "ratio": klass.ratio,
                    "flexible": klass.flexible,
                    **{d: usage.used(d, now) for d in DIMENSIONS},
                    "waiting": sum(
                        len(queue)
                        for (m, k, _), queue in self.queues.items()
                        if m == model and k == klass.name
                    ),
                }
            models[model] = {
                "limits": {d: getattr(limits, d) for d in DIMENSIONS},
                "capacity": {
                    d: None
                    if getattr(limits, d) is None
                    else getattr(limits, d) * self.limiter.share
                    for d in DIMENSIONS
                },
                "classes": classes,
            }
        clients: dict[str, Any] = {}
        for name, limits in self.spec.clients.items():
            usage = self.limiter.client_usage(name)
            clients[name] = {
                "limits": {d: getattr(limits, d) for d in DIMENSIONS},
                "used": {d: usage.used(d, now) for d in DIMENSIONS},
                "waiting": sum(len(q) for (_, _, c), q in self.queues.items() if c == name),
            }
        return {
            "instance": self.instance,
            "share": self.limiter.share,
            "redis": None if self.shared is None else self.shared.statistics(),
            "counts": dict(self.counts),
            "models": models,
            "clients": clients,
        }


def backend_key(url: str) -> str:
    """A backend's name among the Redis window keys (apart from every model's)."""
    return f"backend={url}"


def client_key(name: str) -> str:
    """A client's name among the Redis window keys (apart from every model's and backend's:
    a client's name holds no ``=``)."""
    return f"client={name}"


def instance_name(settings: Settings) -> str:
    """How this instance is named in decisions rows and /health: host, port and process id, so
    that instances on one machine are told apart."""
    return f"{socket.gethostname()}:{settings.port}:{os.getpid()}"


__all__ = ["AdmissionService", "Ticket", "instance_name", "program_class"]
