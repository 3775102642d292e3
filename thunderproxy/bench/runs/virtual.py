"""Virtual time: the real gateway, scheduler and poller over the simulator in one trio run on
a MockClock.

No sockets and no threads, so ``MockClock(autojump_threshold=0)`` jumps straight to the next
thing that happens: an hour of trace replays in seconds, identically every time. The pieces are
the production ones, only wired without sockets:

- a ``BackendPool`` of ``EngineBackend``s: each simulator engine behind its own HTTP face,
  called in-process, so the same requests, answers and /metrics text flow as over HTTP;
- the real metrics poller, ``ProgramRegistry``, ``Scheduler`` (policy ``default`` or ``tr``),
  resume monitor and call gateway, assembled as the proxy assembles them (``core.build_core``),
  and an ``AuditLog`` whose channel nobody writes to SQLite during the run (its records are
  kept and stored afterwards).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio
from trio.testing import MockClock

from ...audit import AuditLog
from ...audit.records import AuditRecord, StepRecord, TransitionRecord
from ...backends import BackendPool
from ...backends.asgi import EngineBackend
from ...core import build_core
from ...gateway import Gateway
from ...programs import ProgramStatus
from ...sim import Engine, truth
from ..agents.agent import Agents, Progress, RunLog, sticky_round_robin, ungrouped_errors
from ..agents.transport import InProcessTransport
from ..config import PROXY_ROUTERS, BenchConfig
from ..report import figures
from ..workloads.workload import Workload


@dataclass
class TargetResult:
    """One target measured once: its figures and what they were computed from."""

    target: str
    concurrency: int
    kv_tokens: int
    figures: dict[str, Any]
    log: RunLog
    truth: dict[str, float]
    clock: str
    #: thunderproxy targets: the audit rows of the run (virtual) and its ``runs`` id once stored.
    audit_records: list[AuditRecord] = field(default_factory=list)
    proxy_settings: dict[str, Any] = field(default_factory=dict)
    proxy_run_id: int | None = None
    proxy_cpu_s: float | None = None
    wall_s: float = 0.0
    #: What served the target when a run compares two: "engine" or "sim" ("" otherwise).
    side: str = ""
    #: Which of ``--repeat``'s rounds it is (0: the only one).
    run: int = 0
    #: One of ``--conformance``'s simulator draws: its timing scale (None: not a draw).
    timing_scale: float | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "label": self.label,
            "side": self.side,
            "run": self.run,
            "timing_scale": self.timing_scale,
            "concurrency": self.concurrency,
            "kv_tokens": self.kv_tokens,
            "clock": self.clock,
            **self.figures,
            "proxy_cpu_s": self.proxy_cpu_s,
            "wall_s": self.wall_s,
        }

    @property
    def label(self) -> str:
        return result_label(self.target, self.side, self.timing_scale, self.run)


def result_label(
    target: str, side: str = "", timing_scale: float | None = None, run: int = 0
) -> str:
    """How a result is named in tables and progress lines: ``tr``, ``tr (engine) #2``,
    ``tr (sim x0.95)``."""
    if timing_scale is not None:
        side = f"{side} x{timing_scale:g}"
    label = f"{target} ({side})" if side else target
    return f"{label} #{run}" if run else label


def backend_urls(n: int) -> list[str]:
    # Names only: nothing ever connects to them (".invalid" cannot resolve, by RFC 2606).
    return [f"http://sim-{i}.invalid" for i in range(n)]


def drain(receive: trio.MemoryReceiveChannel[AuditRecord]) -> list[AuditRecord]:
    records = []
    while True:
        try:
            records.append(receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return records


async def run_target(
    workload: Workload,
    config: BenchConfig,
    target: str,
    *,
    concurrency: int | None = None,
    progress: Progress | None = None,
) -> TargetResult:
    """Measure one target on the virtual clock (call inside ``trio.run`` with a MockClock)."""
    sim_config = config.sim_config(workload, target, time_scale=1.0)
    urls = backend_urls(config.backends)
    engines = {url: Engine(sim_config, epoch=0.0) for url in urls}
    schedule = config.schedule(workload, concurrency)
    router = PROXY_ROUTERS.get(target)
    settings = config.settings(target) if router is not None else None
    classes = config.program_classes(workload)
    send, receive = trio.open_memory_channel[AuditRecord](math.inf)
    audit = AuditLog(send, run_id=0)
    pool = BackendPool()
    async with trio.open_nursery() as nursery:
        for url, engine in engines.items():
            await nursery.start(engine.run)
            pool.attach(url, EngineBackend(engine, nursery, name=url))
        gateway: Gateway | None = None
        if settings is not None:
            # This instance alone: virtual time has no Redis to share through.
            core = build_core(settings, pool, audit, redis=False)
            gateway = core.gateway
            await nursery.start(core.metrics_poller())
            await nursery.start(core.resume_monitor())
        transport = InProcessTransport(
            {node.url: node.backend for node in pool},
            gateway=gateway,
            place=sticky_round_robin(urls),
            model=config.model,
            classes=classes,
        )
        agents = Agents(workload, transport, schedule, time_scale=1.0, progress=progress)
        log = await agents.run()
        states = [truth.state(engine) for engine in engines.values()]
        nursery.cancel_scope.cancel()
    records = drain(receive)
    pause = 0.0
    pauses = None
    waits = None
    class_waits: dict[str, list[float]] | None = None
    if router is not None:
        waits = [(r.step, r.queue_s) for r in records if isinstance(r, StepRecord)]
        class_waits = {}
        for r in records:
            # The class the proxy itself resolved and recorded, not the one the agent sent.
            if isinstance(r, StepRecord) and r.program_class is not None:
                class_waits.setdefault(r.program_class, []).append(r.queue_s)
        pause = sum(r.queue_s for r in records if isinstance(r, StepRecord))
        pauses = sum(
            1
            for r in records
            if isinstance(r, TransitionRecord) and r.transition.to_status is ProgramStatus.PAUSED
        )
    totals = figures.sum_truth(states)
    return TargetResult(
        target=target,
        concurrency=schedule.concurrency,
        kv_tokens=sim_config.resolved_num_gpu_blocks() * sim_config.resolved_block_size(),
        figures=figures.compute(
            log,
            totals,
            pause_time_s=pause,
            pauses=pauses,
            waits=waits,
            classes=classes,
            class_waits=class_waits,
        ),
        log=log,
        truth=totals,
        clock="virtual",
        audit_records=records,
        proxy_settings={} if settings is None else dataclasses.asdict(settings),
    )


@contextmanager
def repeatable_trio(seed: int) -> Iterator[bool]:
    """Make trio's choices between tasks that wake at the same instant reproducible, for the
    duration of one virtual run; yields whether it could.

    trio leaves two such choices to chance, so that no code relies on an order: it reverses
    each batch of runnable tasks at random, and it breaks ties between equal deadlines by the
    cancel scopes' ``id()``, which differs with everything else the process allocated. Under
    the virtual clock many tasks wake at the same instant (all the arrivals of one Mooncake
    timestamp, a monitor tick and a tool gap's end), and these choices decide which request
    reaches the engine or the scheduler first. Seeded, and with deadlines tied in the order
    they were set, a virtual run repeats exactly from any entry point. trio has no public knob
    for either (only its Hypothesis plugin seeds the first), hence the private names, checked.
    """
    from trio._core import _run as trio_run

    rng = getattr(trio_run, "_r", None)
    deadlines = getattr(trio_run, "Deadlines", None)
    original = getattr(deadlines, "add", None)
    if not isinstance(rng, random.Random) or original is None:
        yield False  # a trio without them: runs stay valid, only not bit-for-bit repeatable
        return
    rng.seed(f"thunderproxy-bench:{seed}")
    order = itertools.count()

    def add(self: Any, deadline: float, cancel_scope: Any) -> None:
        heapq.heappush(self._heap, (deadline, next(order), cancel_scope))
        self._active += 1

    deadlines.add = add  # type: ignore[union-attr]
    try:
        yield True
    finally:
        deadlines.add = original  # type: ignore[union-attr]


def run(
    workload: Workload,
    config: BenchConfig,
    target: str,
    *,
    concurrency: int | None = None,
    progress: Progress | None = None,
) -> TargetResult:
    """Run one target in its own trio run on a fresh virtual clock."""
    with repeatable_trio(config.seed), ungrouped_errors():
        result: TargetResult = trio.run(
            partial(
                run_target, workload, config, target, concurrency=concurrency, progress=progress
            ),
            clock=MockClock(autojump_threshold=0),
        )
    return result
