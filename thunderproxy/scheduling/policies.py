"""Scheduling policies by name: ``default`` and ``tr`` implement one protocol, and the
scheduler applies whatever decisions the chosen one returns.

A policy is pure: it reads the views it is given (built lazily, so a policy that never looks
costs nothing) and ``now``, and returns decisions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Protocol

from ..programs import ProgramStatus
from . import tr
from .tr import Action, BackendView, Decision, PolicyConfig, ProgramView


class Views:
    """The programs and backends as the policy sees them, built on first use.

    Building the programs' views costs every program still holding KV; ``bound`` and
    ``paused`` (where the source keeps them up to date as programs change: views.py) let tr
    see that a call changes nothing without building them, so that the cost of such a call
    is that of the calls in flight, not of the programs tracked."""

    def __init__(
        self,
        programs: Callable[[], list[ProgramView]],
        backends: Callable[[], list[BackendView]],
        idle: Callable[[float], list[ProgramView]] | None = None,
        *,
        bound: Callable[[BackendView], int] | None = None,
        paused: Callable[[], bool] | None = None,
        waiting: Callable[[], int] | None = None,
        held: Callable[[], bool] | None = None,
    ) -> None:
        self._programs = programs
        self._backends = backends
        self._idle = idle
        self._bound = bound
        self._paused = paused
        self._waiting = waiting
        self._held = held

    def bound(self, backend: BackendView) -> int | None:
        """At least what ``tr.used_tokens`` counts on ``backend`` over any of
        ``programs``, at any time (None: not kept)."""
        return None if self._bound is None else self._bound(backend)

    def any_paused(self) -> bool:
        """Whether any program is paused."""
        if self._paused is None:
            return any(p.status is ProgramStatus.PAUSED for p in self.programs)
        return self._paused()

    def any_held(self) -> bool:
        """Whether a call of a running program is held (``tr.on_call``)."""
        if self._held is None:
            return any(p.held for p in self.programs)
        return self._held()

    def waiting(self) -> int:
        """How many programs have a request waiting for a resume."""
        if self._waiting is None:
            return sum(p.waiting_since is not None for p in self.programs)
        return self._waiting()

    def idle(self, seconds: float) -> list[ProgramView]:
        """Programs without activity for ``seconds`` or more (all programs, if not narrowed)."""
        if self._idle is None:
            return self.programs
        return self._idle(seconds)

    @cached_property
    def programs(self) -> list[ProgramView]:
        return self._programs()

    @cached_property
    def backends(self) -> list[BackendView]:
        return self._backends()

    def backend(self, url: str) -> BackendView:
        return next(b for b in self.backends if b.url == url)


class Policy(Protocol):
    name: str
    config: PolicyConfig

    def admit(self, candidate: ProgramView, views: Views, now: float) -> Decision | None:
        """A new program's first call: ADMIT or QUEUE on ``candidate.backend`` (None: admit
        without a decision to log)."""
        ...

    def on_return(self, program: ProgramView, views: Views, now: float) -> Decision | None:
        """An acting program's next call arrived: ADMIT, or PAUSE until there is room."""
        ...

    def on_call(self, program: ProgramView, views: Views, now: float) -> Decision | None:
        """A call of a program that already has calls in flight (or held) arrived: ADMIT, or
        QUEUE it until one more context fits (None: it goes out)."""
        ...

    def rebalance(
        self, views: Views, now: float, *, backends: frozenset[str] | None = None
    ) -> list[Decision]:
        """Pauses and marks where a backend is over capacity, then resumes where there is room."""
        ...

    def retire(self, views: Views, now: float) -> list[Decision]: ...

    def expected_wait(self, position: int, resume_times: Sequence[float], now: float) -> float: ...


class DefaultPolicy:
    """Only proxies: every call goes out at once; idle programs are still retired."""

    name = "default"

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    def admit(self, candidate: ProgramView, views: Views, now: float) -> Decision | None:
        return None

    def on_return(self, program: ProgramView, views: Views, now: float) -> Decision | None:
        return None

    def on_call(self, program: ProgramView, views: Views, now: float) -> Decision | None:
        return None

    def rebalance(
        self, views: Views, now: float, *, backends: frozenset[str] | None = None
    ) -> list[Decision]:
        return []

    def retire(self, views: Views, now: float) -> list[Decision]:
        if self.config.idle_lease_s <= 0:
            return []
        return tr.retire(views.idle(self.config.idle_lease_s), self.config, now)

    def expected_wait(self, position: int, resume_times: Sequence[float], now: float) -> float:
        return 0.0


class TrPolicy(DefaultPolicy):
    """Pauses and resumes whole programs so the running ones keep their KV cache (tr.py)."""

    name = "tr"

    def admit(self, candidate: ProgramView, views: Views, now: float) -> Decision | None:
        assert candidate.backend is not None
        backend = views.backend(candidate.backend)
        # Most first calls are decided without the programs' views (tr.admit_without_sum):
        # what a first call costs is then that of the calls in flight and the waiting ones.
        bound = views.bound(backend)
        fast = tr.admit_without_sum(candidate, backend, bound, views.waiting(), self.config, now)
        if fast is not None:
            return fast
        return tr.admit(candidate, backend, views.programs, self.config, now)

    def on_return(self, program: ProgramView, views: Views, now: float) -> Decision | None:
        if not self.config.gate_returns or program.backend is None:
            return None
        backend = views.backend(program.backend)
        if not backend.hold:
            # on_return lets it through without the programs' views (tr.on_return).
            return tr.on_return(program, backend, (), self.config, now)
        bound = views.bound(backend)
        if bound is not None:
            fits = tr.fits_on_return(program, backend, bound, self.config, now)
            if fits is not None:
                return fits
        return tr.on_return(program, backend, views.programs, self.config, now)

    def on_call(self, program: ProgramView, views: Views, now: float) -> Decision | None:
        if program.backend is None:
            return None
        backend = views.backend(program.backend)
        # Most such calls fit, known from the bound without the programs' views.
        if tr.call_fits(program, backend, views.bound(backend), views.waiting(), self.config):
            return None
        return tr.on_call(program, backend, views.programs, self.config, now)

    def rebalance(
        self, views: Views, now: float, *, backends: frozenset[str] | None = None
    ) -> list[Decision]:
        # Nothing paused or held and every backend in bounds: enforce would pause and mark
        # nothing and there is nothing to resume, known without building the programs' views.
        if (
            not views.any_paused()
            and not views.any_held()
            and all(
                tr.settled(view, views.bound(view), self.config, now)
                for view in views.backends
                if backends is None or view.url in backends
            )
        ):
            return []
        programs = views.programs
        decisions: list[Decision] = []
        for view in views.backends:
            if backends is None or view.url in backends:
                decisions += tr.enforce(view, programs, self.config, now)
        if decisions:
            programs = after(programs, decisions, now)
        if any(p.status is ProgramStatus.PAUSED or p.held for p in programs):
            decisions += tr.resume(views.backends, programs, self.config, now)
        return decisions

    def expected_wait(self, position: int, resume_times: Sequence[float], now: float) -> float:
        return tr.expected_wait(position, resume_times, self.config, now)


def after(
    programs: Sequence[ProgramView], decisions: Sequence[Decision], now: float
) -> list[ProgramView]:
    """The programs as they will be once pauses and marks are applied."""
    changes = {d.program_id: d.action for d in decisions}
    out = []
    for p in programs:
        action = changes.get(p.program_id)
        if action is Action.PAUSE:
            p = dataclasses.replace(p, status=ProgramStatus.PAUSED, paused_since=now, marked=False)
        elif action is Action.MARK:
            p = dataclasses.replace(p, marked=True)
        out.append(p)
    return out


POLICIES: dict[str, Callable[[PolicyConfig], Policy]] = {
    DefaultPolicy.name: DefaultPolicy,
    TrPolicy.name: TrPolicy,
}


def policy_named(name: str, config: PolicyConfig) -> Policy:
    try:
        return POLICIES[name](config)
    except KeyError:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(POLICIES)}") from None
