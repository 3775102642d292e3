"""The proxy's core, assembled in one place: the programs' registry, the scheduler over the
backend pool (its policy named by ``--router``), admission (``[limits]``) and the gateway that
owns every LLM call, with the parts the instances share through Redis.

``runtime.run`` serves this core; the bench drives the very same assembly in process (virtual
time, the CPU a call costs, the scheduler's cost with many programs), and the tests build it
from the settings they need. What runs beside it (the metrics poller, the resume monitor, the
Redis heartbeats) is handed out as services for the caller to start its own way: supervised in
the runtime, plainly on the bench's mock clock.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from .admission.service import AdmissionService, instance_name
from .admission.shared import RedisLink, SharedLimits
from .admission.shared_kv import SharedBackends
from .audit import AuditLog
from .audit.records import TransitionRecord
from .backends import BackendPool
from .backends.poller import serve_metrics_poller
from .config import Settings
from .gateway import Gateway
from .programs import ProgramRegistry
from .programs.profile import Profiles
from .scheduling import Scheduler, policy_named, serve_resume_monitor

#: A long-lived task as ``nursery.start`` takes it (it reports ``task_status.started()``).
Service = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class Core:
    """The assembled parts; ``build_core`` makes them."""

    settings: Settings
    pool: BackendPool
    audit: AuditLog
    registry: ProgramRegistry
    scheduler: Scheduler
    gateway: Gateway
    profiles: Profiles
    #: ``[limits]``' service; None without limits (the gateway admits every call).
    admission: AdmissionService | None = None
    #: With Redis, the heartbeats of what the instances share, as (component name, service),
    #: in the order they start: each is ready after its first beat, before any call is admitted.
    shared: tuple[tuple[str, Service], ...] = ()

    def metrics_poller(self) -> Service:
        """The backends' health, capacity and served models, polled every
        ``--metrics-interval``; ready after its first round."""
        return partial(
            serve_metrics_poller,
            self.pool,
            self.audit,
            interval=self.settings.metrics_interval,
            loads=self.registry.sample_loads,
            metrics=self.settings.metrics,
        )

    def resume_monitor(self) -> Service:
        """The scheduler's periodic work (resumes, forced resumes, idle leases)."""
        return partial(
            serve_resume_monitor, self.scheduler, interval=self.settings.monitor_interval
        )


def recording_registry(audit: AuditLog) -> ProgramRegistry:
    """A registry whose every transition becomes a ``transitions`` row of ``audit``."""
    return ProgramRegistry(lambda t: audit.record(TransitionRecord(t)))


def build_core(
    settings: Settings,
    pool: BackendPool,
    audit: AuditLog,
    *,
    registry: ProgramRegistry | None = None,
    offset: float = 0.0,
    redis: bool = True,
) -> Core:
    """The core over ``pool``, recording into ``audit``, as ``settings`` configure it.

    ``registry``: the programs (a recording one if None; the runtime's is restored from the db
    first). ``offset``: Unix time minus trio time, where limits' windows and the heartbeats
    align on the wall clock. ``redis=False``: this instance alone even where the settings name
    a Redis (virtual time, where nothing may wait on a socket)."""
    if registry is None:
        registry = recording_registry(audit)
    shared_url = settings.redis if redis else ""
    # One line when Redis is lost and one when it is back, for the parts together.
    link = RedisLink(shared_url) if shared_url else None
    # With Redis, tr subtracts what the other instances' programs claim on each backend from
    # its capacity, and publishes its own claim.
    kv = (
        SharedBackends(
            shared_url,
            instance_name(settings),
            heartbeat_s=settings.redis_heartbeat,
            link=link,
            # 0 (never retired): a day, so Redis does not keep every program for ever.
            affinity_ttl_s=settings.policy.idle_lease_s or 86_400.0,
        )
        if shared_url
        else None
    )
    scheduler = Scheduler(
        policy=policy_named(settings.router, settings.policy),
        registry=registry,
        pool=pool,
        audit=audit,
        other_tokens=None if kv is None else kv.others,
        affinity=kv,
        # tr's fit test made again in Redis for calls that were not running.
        claims=kv if settings.router == "tr" else None,
    )
    shared: list[tuple[str, Service]] = []
    if kv is not None:
        shared.append(("shared_kv", partial(kv.serve, offset, scheduler.used_by_backend)))
    admission = _admission(settings, pool, audit, scheduler, offset, shared_url, link, shared)
    gateway = Gateway(
        pool=pool,
        scheduler=scheduler,
        audit=audit,
        profiles=Profiles(),
        first_byte_timeout=settings.first_byte_timeout,
        read_timeout=settings.read_timeout,
        admission=admission,
        key_receivers=frozenset()
        if settings.clients is None
        else settings.clients.receiving([(b.url, b.name) for b in settings.backend_specs]),
    )
    return Core(
        settings=settings,
        pool=pool,
        audit=audit,
        registry=registry,
        scheduler=scheduler,
        gateway=gateway,
        profiles=gateway.profiles,
        admission=admission,
        shared=tuple(shared),
    )


def _admission(
    settings: Settings,
    pool: BackendPool,
    audit: AuditLog,
    scheduler: Scheduler,
    offset: float,
    shared_url: str,
    link: RedisLink | None,
    shared: list[tuple[str, Service]],
) -> AdmissionService | None:
    """``[limits]``' service, None without limits; with Redis its heartbeat joins ``shared``
    (the first beat sets this instance's share)."""
    if settings.limits is None:
        return None
    instance = instance_name(settings)
    limits = (
        SharedLimits(shared_url, instance, heartbeat_s=settings.redis_heartbeat, link=link)
        if shared_url
        else None
    )
    admission = AdmissionService(
        settings.limits,
        pool=pool,
        audit=audit,
        instance=instance,
        offset=offset,
        shared=limits,
        place=scheduler.predict,
    )
    for spec in settings.backend_specs:
        admission.limiter.name_backend(spec.url, spec.name)
    if limits is not None:
        shared.append(("shared_limits", partial(limits.serve, offset, admission.limiter.set_share)))
    return admission
