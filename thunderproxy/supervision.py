"""Components that fail alone: ``supervise`` runs one long-lived task of the runtime nursery so
that an exception in it ends that task only, is logged once with its cause, is shown in
``/health`` and ``/metrics`` (``Components``) and, where a restart makes sense, restarts it
after a backoff (trio time, so MockClock drives it in tests).

Only a signal or a fatal startup error stops the proxy: an exception before the component's
first ``task_status.started()`` is a startup error and propagates as before; one after it is the
component's own. Cancellation always propagates (that is how the runtime stops components).

The state of each component is a plain value read through ``Components.snapshot()``; the
backoff is a pure function of the failures in a row (``backoff_s``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import trio

log = logging.getLogger("thunderproxy.supervision")

#: A component that ran this long since its last start has its failures in a row forgotten,
#: so an occasional fault restarts it after the first, short backoff again.
STABLE_AFTER_S = 60.0


class State(Enum):
    STARTING = "starting"
    RUNNING = "running"
    #: Failed; waiting out its backoff before the next start.
    RESTARTING = "restarting"
    #: Failed and not restarted (``Restart(enabled=False)``): the proxy serves on without it.
    FAILED = "failed"
    #: Returned on its own (its work is done, e.g. the audit writer after its channel closed).
    STOPPED = "stopped"


@dataclass(frozen=True)
class Restart:
    """How a component is restarted: after ``initial_s``, doubling per failure in a row up to
    ``max_s``; ``enabled=False``: a failure ends it for this run."""

    enabled: bool = True
    initial_s: float = 0.5
    max_s: float = 30.0


#: The default: restart after 0.5 s, 1 s, 2 s, ... up to 30 s.
RESTART = Restart()


def backoff_s(policy: Restart, failures: int) -> float:
    """The wait before the next start after ``failures`` failures in a row (1 or more)."""
    return float(min(policy.max_s, policy.initial_s * 2 ** max(0, failures - 1)))


@dataclass(frozen=True)
class ComponentStatistics:
    """One component at one moment, as ``/health`` and ``/metrics`` show it."""

    name: str
    state: State
    restarts: int
    failures: int
    last_error: str | None
    #: Trio time of the last failure; None if it never failed.
    last_error_at: float | None
    #: What its own check finds wrong while it runs (``Component.check``), e.g. a child
    #: process that stopped answering; None when well.
    problem: str | None = None

    @property
    def up(self) -> bool:
        return self.state in (State.STARTING, State.RUNNING)

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "restarts": self.restarts,
            "failures": self.failures,
            "last_error": self.last_error,
            "problem": self.problem,
        }


@dataclass
class Component:
    """The live, mutable record of one supervised component (only ``supervise`` changes it)."""

    name: str
    state: State = State.STARTING
    restarts: int = 0
    failures: int = 0
    last_error: str | None = None
    last_error_at: float | None = None
    #: What is wrong with it at trio time ``now`` though it has not failed (None: nothing), set
    #: by a component that can tell: a process alive but not answering is no exception.
    check: Callable[[float], str | None] | None = None

    def snapshot(self, now: float | None = None) -> ComponentStatistics:
        problem = None
        if self.check is not None and now is not None and self.up:
            problem = self.check(now)
        return ComponentStatistics(
            self.name,
            self.state,
            self.restarts,
            self.failures,
            self.last_error,
            self.last_error_at,
            problem,
        )

    @property
    def up(self) -> bool:
        return self.state in (State.STARTING, State.RUNNING)


@dataclass
class Components:
    """Every supervised component of one proxy, by name (one registry per proxy: two proxies
    in one process never see each other's)."""

    _by_name: dict[str, Component] = field(default_factory=dict)

    def register(self, name: str) -> Component:
        component = self._by_name.get(name)
        if component is None:
            component = self._by_name[name] = Component(name)
        return component

    def snapshot(self) -> tuple[ComponentStatistics, ...]:
        try:
            now: float | None = trio.current_time()
        except RuntimeError:  # read outside a trio run (a report after it ended)
            now = None
        return tuple(c.snapshot(now) for c in self._by_name.values())


def describe_failure(exc: BaseException) -> str:
    """One line naming the error and its message; a nursery's group of one is unwrapped."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Forward:
    """The ``task_status`` a supervised service is given: its first ``started`` is passed on to
    the supervisor's caller; every start marks the component running."""

    def __init__(self, component: Component, outer: trio.TaskStatus[Any], first: bool) -> None:
        self._component = component
        self._outer = outer
        self._first = first
        self.started_at: float | None = None

    def started(self, value: Any = None) -> None:
        self._component.state = State.RUNNING
        self.started_at = trio.current_time()
        if self._first:
            self._first = False
            self._outer.started(value)


async def supervise(
    components: Components,
    name: str,
    service: Callable[..., Awaitable[Any]],
    *,
    restart: Restart = RESTART,
    task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run ``service(task_status=...)`` as the component ``name`` until it returns, is
    cancelled, or fails for good (``restart.enabled`` false); a failure after its first start
    never propagates. ``task_status.started`` is reported with the service's own first value."""
    component = components.register(name)
    first = True
    last_logged: str | None = None
    while True:
        status = _Forward(component, task_status, first)
        component.state = State.STARTING
        try:
            await service(task_status=status)
        except Exception as exc:
            if first and status.started_at is None:
                raise  # a fatal startup error: the proxy cannot run without it
            first = False
            now = trio.current_time()
            if status.started_at is not None and now - status.started_at >= STABLE_AFTER_S:
                component.failures = 0
                last_logged = None  # a fault after a stable run is news again
            component.failures += 1
            component.last_error = describe_failure(exc)
            component.last_error_at = now
            if not restart.enabled:
                component.state = State.FAILED
                log.error(
                    "component %s failed and is not restarted (the proxy serves on without it): %s",
                    name,
                    component.last_error,
                    exc_info=exc,
                )
                return
            delay = backoff_s(restart, component.failures)
            component.state = State.RESTARTING
            if component.last_error != last_logged:
                # Once per cause: a component failing the same way in a loop logs it once.
                last_logged = component.last_error
                log.error(
                    "component %s failed; restarting in %.1f s (failures in a row: %d): %s",
                    name,
                    delay,
                    component.failures,
                    component.last_error,
                    exc_info=exc,
                )
            await trio.sleep(delay)
            component.restarts += 1
        else:
            component.state = State.STOPPED
            return


def supervised(
    components: Components,
    name: str,
    service: Callable[..., Awaitable[Any]],
    *,
    restart: Restart = RESTART,
) -> Callable[..., Awaitable[None]]:
    """``service`` wrapped for ``nursery.start``: the seam for every long-lived task."""

    async def run(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await supervise(components, name, service, restart=restart, task_status=task_status)

    return run
