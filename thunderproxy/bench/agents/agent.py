"""The agents: replay a workload's programs through a transport, closed or open loop.

This is the one agent loop of the bench. Real-time runs give it an HTTP transport (a backend,
thunderproxy or any other proxy); virtual-time runs give it the in-process transport (the
scheduler and the simulator engine called directly). Everything else is the same: how programs
arrive, how prompts grow, how tool time passes, what is recorded.

Time is trio's clock. ``time_scale`` is trio seconds per simulated second (below 1 when the
simulator runs faster than real time); tool gaps and arrivals are scaled by it here, and the
figures divide it out again, so every reported duration is in simulated seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import trio

from ...errors import ThunderproxyError
from ..workloads.prompts import BlockText, Conversation, Vocabulary, system_prompt
from ..workloads.workload import ProgramSpec, Workload, poisson_arrivals

ARRIVALS = ("closed", "poisson", "trace")
#: Attempts per call before the program is abandoned, and the pause between them (simulated s).
MAX_ATTEMPTS = 3
RETRY_BACKOFF_S = 1.0
#: A run in which no call ends for this many simulated seconds is stuck: it is stopped and
#: reported rather than left to spin (under the virtual clock it would never end).
STALL_S = 4 * 3600.0


class BenchError(ThunderproxyError):
    """A benchmark could not run: a process did not start, a target stopped making progress."""

    error_type = "bench_error"


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


@contextmanager
def ungrouped_errors() -> Iterator[None]:
    """Nurseries wrap errors in exception groups; callers of the bench want the one
    ThunderproxyError that stopped the run (for its message), not the group around it."""
    try:
        yield
    except BaseExceptionGroup as group:
        ours = [e for e in _leaves(group) if isinstance(e, ThunderproxyError)]
        if ours:
            raise ours[0] from group
        raise


@dataclass
class CallResult:
    """What one LLM call returned, as the client saw it."""

    status: int
    text: str = ""
    ids: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    first_token_at: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


class Transport(Protocol):
    """How a call reaches the model: over HTTP, or in-process on the virtual clock."""

    async def call(
        self, program_id: str, step: int, conversation: Conversation, max_tokens: int
    ) -> CallResult: ...

    async def release(self, program_id: str) -> None: ...


@dataclass
class StepLog:
    program_id: str
    step: int
    attempt: int
    sent_at: float
    finished_at: float
    first_token_at: float | None
    prompt_tokens: int
    output_tokens: int
    #: Tokens of this program's previous prompt and answer: what the call could hit in cache.
    reusable_tokens: int
    status: int
    reported_prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass
class ProgramLog:
    program_id: str
    arrived_at: float
    started_at: float | None = None
    finished_at: float | None = None
    completed: bool = False
    steps: int = 0


@dataclass
class RunLog:
    """Everything the agents recorded; ``figures.compute`` turns it into the reported figures."""

    time_scale: float
    started_at: float
    finished_at: float = 0.0
    #: Closed loop: when a worker first found no program left to start (the tail begins).
    exhausted_at: float | None = None
    steps: list[StepLog] = field(default_factory=list)
    programs: list[ProgramLog] = field(default_factory=list)


class Progress(Protocol):
    def update(self, log: RunLog) -> None: ...


@dataclass(frozen=True)
class Schedule:
    """How programs arrive."""

    arrivals: str = "closed"
    #: Closed loop: agents at a time. Open loop: the most programs running at once (0: no cap).
    concurrency: int = 1
    #: Poisson arrivals: programs per simulated second.
    rate: float = 0.0
    #: Multiplies tool and think time (and Mooncake's turn offsets).
    gap_scale: float = 1.0
    seed: int = 0
    #: Whether an agent releases its program when it ends (``POST /programs/release``). Most
    #: agent frameworks never do: the proxy then learns a program ended from its silence alone.
    release: bool = True

    def __post_init__(self) -> None:
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"arrivals {self.arrivals!r} is not one of {ARRIVALS}")
        if self.arrivals == "closed" and self.concurrency < 1:
            raise ValueError("closed-loop runs need a concurrency of at least 1")
        if self.gap_scale < 0:
            raise ValueError("gap_scale must be >= 0")


class Agents:
    """Runs a workload's programs through one transport and records what happened."""

    def __init__(
        self,
        workload: Workload,
        transport: Transport,
        schedule: Schedule,
        *,
        time_scale: float = 1.0,
        vocabulary: Vocabulary | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.workload = workload
        self.transport = transport
        self.schedule = schedule
        self.time_scale = time_scale
        self.vocabulary = vocabulary or Vocabulary(seed=schedule.seed)
        self.progress = progress
        self.stall_s = STALL_S
        self._last_progress = 0.0
        self._in_flight = 0
        self._system = (
            system_prompt(self.vocabulary, workload.system_tokens, seed=schedule.seed)
            if workload.system_tokens
            else None
        )
        self._blocks = BlockText(self.vocabulary, workload.block_tokens, seed=schedule.seed)
        self.log = RunLog(time_scale=time_scale, started_at=0.0)

    def _now(self) -> float:
        return trio.current_time()

    async def _sleep_sim(self, seconds: float) -> None:
        if seconds > 0:
            await trio.sleep(seconds * self.time_scale)

    def _changed(self) -> None:
        if self.progress is not None:
            self.progress.update(self.log)

    async def run(self) -> RunLog:
        self.log.started_at = self._last_progress = self._now()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watchdog)
            if self.schedule.arrivals == "closed":
                await self._closed_loop()
            else:
                await self._open_loop()
            nursery.cancel_scope.cancel()
        self.log.finished_at = self._now()
        self._changed()
        return self.log

    async def _watchdog(self) -> None:
        limit = self.stall_s * self.time_scale
        while True:
            await trio.sleep(limit / 8)
            # Stuck means calls are out and none comes back; long think times are not stuck.
            if self._in_flight and self._now() - self._last_progress > limit:
                running = [p.program_id for p in self.log.programs if p.finished_at is None]
                raise BenchError(
                    f"No call ended for {self.stall_s:.0f} simulated seconds while "
                    f"{len(running)} programs were unfinished ({', '.join(running[:5])}"
                    f"{', ...' if len(running) > 5 else ''}): the target is stuck."
                )

    async def _closed_loop(self) -> None:
        programs: Iterator[ProgramSpec] = iter(self.workload.programs)

        async def worker() -> None:
            for spec in programs:
                await self._run_program(spec, self._now())
            if self.log.exhausted_at is None:
                self.log.exhausted_at = self._now()

        async with trio.open_nursery() as nursery:
            for _ in range(self.schedule.concurrency):
                nursery.start_soon(worker)

    async def _open_loop(self) -> None:
        schedule = self.schedule
        specs = self.workload.programs
        if schedule.arrivals == "poisson":
            offsets = poisson_arrivals(len(specs), schedule.rate, schedule.seed)
        else:
            first = min((p.arrival_s for p in specs), default=0.0)
            offsets = [p.arrival_s - first for p in specs]
        cap = schedule.concurrency if schedule.concurrency > 0 else math.inf
        limiter = trio.CapacityLimiter(cap)
        start = self._now()

        async def arrive(spec: ProgramSpec, arrived_at: float) -> None:
            async with limiter:
                await self._run_program(spec, arrived_at)

        async with trio.open_nursery() as nursery:
            for spec, offset in sorted(zip(specs, offsets, strict=True), key=lambda x: x[1]):
                await trio.sleep_until(start + offset * self.time_scale)
                nursery.start_soon(arrive, spec, self._now())
        self.log.exhausted_at = self._now()

    async def _run_program(self, spec: ProgramSpec, arrived_at: float) -> None:
        started_at = self._now()
        log = ProgramLog(spec.program_id, arrived_at=arrived_at, started_at=started_at)
        self.log.programs.append(log)
        conversation = Conversation(
            spec.program_id,
            self.vocabulary,
            system=None if spec.steps and spec.steps[0].blocks is not None else self._system,
            blocks=self._blocks,
            seed=self.schedule.seed,
        )
        gap_scale = self.schedule.gap_scale
        reusable = 0
        try:
            for index, step in enumerate(spec.steps, start=1):
                if step.at_s is not None:
                    # Open-loop turns: at the recorded time, or now if the last one ended late.
                    await trio.sleep_until(started_at + step.at_s * gap_scale * self.time_scale)
                elif index > 1:
                    await self._sleep_sim(step.gap_before_s * gap_scale)
                conversation.prepare(step)
                result = await self._call(
                    spec.program_id, index, conversation, step.output_tokens, reusable
                )
                if result is None:
                    return  # abandoned after MAX_ATTEMPTS failures
                conversation.answer(result.text, result.ids, carried=step.carried_tokens)
                # Append-only history is reusable by the next call; block prompts say
                # themselves what they share, so nothing is counted for them.
                reusable = conversation.reusable_tokens if step.blocks is None else 0
                log.steps = index
                self._changed()
            log.completed = True
        finally:
            log.finished_at = self._now()
            if self.schedule.release:
                with trio.CancelScope(shield=True):
                    await self.transport.release(spec.program_id)
            self._changed()

    async def _call(
        self,
        program_id: str,
        index: int,
        conversation: Conversation,
        output_tokens: int,
        reusable: int,
    ) -> CallResult | None:
        for attempt in range(1, MAX_ATTEMPTS + 1):
            sent_at = self._now()
            if not self._in_flight:
                self._last_progress = sent_at  # the stall clock starts with the first call out
            self._in_flight += 1
            try:
                result = await self.transport.call(program_id, index, conversation, output_tokens)
            finally:
                self._in_flight -= 1
            self._last_progress = self._now()
            self.log.steps.append(
                StepLog(
                    program_id=program_id,
                    step=index,
                    attempt=attempt,
                    sent_at=sent_at,
                    finished_at=self._now(),
                    first_token_at=result.first_token_at,
                    prompt_tokens=conversation.prompt_tokens,
                    output_tokens=output_tokens,
                    reusable_tokens=reusable,
                    status=result.status,
                    reported_prompt_tokens=result.prompt_tokens,
                    completion_tokens=result.completion_tokens,
                    cached_tokens=result.cached_tokens,
                    error=result.error,
                )
            )
            if result.ok:
                return result
            await self._sleep_sim(RETRY_BACKOFF_S)
        return None


def sticky_round_robin(urls: list[str]) -> Callable[[str], str]:
    """Program -> backend without a proxy: each new program takes the next backend, and keeps it."""
    placed: dict[str, str] = {}

    def place(program_id: str) -> str:
        url = placed.get(program_id)
        if url is None:
            url = placed[program_id] = urls[len(placed) % len(urls)]
        return url

    return place
