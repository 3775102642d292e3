"""The simulated engine core: a trio task that runs scheduler steps on the timing model.

Time comes only from `trio.current_time()`, so a MockClock drives it in tests; simulated
seconds are trio seconds divided by `config.time_scale`. Callers submit token ids and
iterate the returned handle for per-step outputs; no HTTP is involved here.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import trio

from ..config import SimConfig
from .blocks import BlockPool
from .metrics import Recorder
from .offload import CPUTier
from .scheduler import Scheduler, SimRequest, Status, StepPlan, StepResult
from .timing import batch_shape, step_seconds
from .tokenizer import TextGenerator, Tokenizer


class EngineDeadError(Exception):
    """Raised by `submit` after `kill()`: the engine accepts nothing until `revive()`."""


class QueueFullError(Exception):
    """Raised by `submit` when an admission limit (`max_num_queued_*`) is reached."""


class StepOutput(NamedTuple):
    """What one engine step produced for one request (tokens are emitted at step end).

    A NamedTuple because the engine builds one per running request per step.
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None  # stop | length | abort | error, on the last output only
    num_prompt_tokens: int
    num_cached_tokens: int  # prefix hit of the first schedule
    num_output_tokens: int
    time: float  # simulated seconds since the engine started
    arrival_time: float
    num_preemptions: int


class RequestHandle:
    """Per-request output buffer. Iterate it, or `next_batch()` to take all pending at once.

    Outputs are buffered without bound so a slow consumer never stalls the engine; that is
    also what lets the HTTP layer coalesce several steps into one write.
    """

    def __init__(self, request: SimRequest) -> None:
        self.request = request
        self.request_id = request.request_id
        self.program = request.program
        self._pending: deque[StepOutput] = deque()
        self._event = trio.Event()
        self.finished = False

    def _push(self, output: StepOutput) -> None:
        self._pending.append(output)
        if output.finish_reason is not None:
            self.finished = True
        self._event.set()

    async def next_batch(self) -> list[StepOutput]:
        """Wait for at least one output and take every pending one; [] once finished."""
        while not self._pending:
            if self.finished:
                return []
            await self._event.wait()
            self._event = trio.Event()
        out = list(self._pending)
        self._pending.clear()
        return out

    def drain(self) -> list[StepOutput]:
        """Take whatever is pending without waiting."""
        out = list(self._pending)
        self._pending.clear()
        return out

    # A plain async iterator rather than an async generator: consumers that stop early
    # (an error mid-request) must not leave a generator for the garbage collector to close.
    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> StepOutput:
        while not self._pending:
            if self.finished:
                raise StopAsyncIteration
            await self._event.wait()
            self._event = trio.Event()
        return self._pending.popleft()


class Engine:
    def __init__(self, config: SimConfig, *, epoch: float = 0.0) -> None:
        self.config = config
        # Unix time of simulated second 0, for `created` fields and *_created gauges.
        self.epoch = epoch
        self.tokenizer = Tokenizer(
            vocab_size=config.vocab_size, chars_per_token=config.chars_per_token
        )
        self._origin: float | None = None
        self._wakeup = trio.Event()
        self._ids = random.Random(f"ids:{config.seed}")
        self._jitter = random.Random(f"jitter:{config.seed}")
        self.dead = False
        self.sleeping = False
        self._reset_state()

    def _reset_state(self) -> None:
        cfg = self.config
        self.block_size = cfg.resolved_block_size()
        self.pool = BlockPool(
            cfg.resolved_num_gpu_blocks(), enable_caching=cfg.enable_prefix_caching
        )
        cpu_blocks = cfg.resolved_num_cpu_blocks()
        self.cpu: CPUTier | None = None
        if cpu_blocks > 0:
            self.cpu = CPUTier(
                cpu_blocks,
                block_size=self.block_size,
                bytes_per_block=cfg.resolved_kv_bytes_per_token() * self.block_size,
                bandwidth_bytes_per_s=cfg.kv_offload_bandwidth_gbps * 1e9,
                latency_s=cfg.kv_offload_latency_us * 1e-6,
            )
        self.scheduler = Scheduler(
            self.pool,
            cpu=self.cpu,
            block_size=self.block_size,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            policy=cfg.scheduling_policy,
            reserve_full_isl=cfg.scheduler_reserve_full_isl,
        )
        self.recorder = Recorder(cfg.max_model_len)
        self.handles: dict[str, RequestHandle] = {}
        self.trace: deque[tuple[Any, ...]] = deque(maxlen=20_000)
        self.profile = cfg.timing
        # Requests still in the "frontend" (c_prep_us): (ready time, seq, request).
        self._arrivals: list[tuple[float, int, SimRequest]] = []
        self._seq = itertools.count()

    # --- time --------------------------------------------------------------------------
    def now(self) -> float:
        """Simulated seconds since the engine started (0 before `run`)."""
        if self._origin is None:
            return 0.0
        return (trio.current_time() - self._origin) / self.config.time_scale

    def unix_time(self, sim_time: float | None = None) -> float:
        return self.epoch + (self.now() if sim_time is None else sim_time)

    # --- requests ----------------------------------------------------------------------
    def submit(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int,
        request_id: str | None = None,
        program: str | None = None,
        cache_salt: str | None = None,
        output_tokens: int | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        priority: int = 0,
        script: Sequence[tuple[int, str]] | None = None,
    ) -> RequestHandle:
        """Queue a request; `output_tokens` fixes where it stops (EOS included).

        `script` is (id, text) pairs the model generates first (a tool call's markup and
        arguments); by default the request then stops with EOS right after it.
        """
        if self.dead:
            raise EngineDeadError(
                "EngineCore encountered an issue. See stack trace for the root cause."
            )
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self._check_admission(len(prompt_token_ids))
        if request_id is None:
            request_id = f"{self._ids.getrandbits(64):016x}"
        while request_id in self.handles:  # vLLM keeps ids unique internally as well
            request_id = f"{request_id}-{self._ids.getrandbits(16):04x}"
        if script is not None and output_tokens is None:
            output_tokens = len(script) + 1
        stop_at = self._plan_length(request_id, max_tokens, output_tokens, ignore_eos, min_tokens)
        generator = TextGenerator(self.tokenizer, self.config.seed, request_id)
        sampler: Callable[[], tuple[int, str]] = generator.next_token
        if script:
            scripted = iter(script)

            def scripted_sampler() -> tuple[int, str]:
                return next(scripted, None) or generator.next_token()

            sampler = scripted_sampler
        request = SimRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            max_tokens=max_tokens,
            arrival_time=self.now(),
            sampler=sampler,
            stop_at=stop_at,
            eos_token_id=self.tokenizer.eos_id,
            program=program,
            cache_salt=cache_salt,
            priority=priority,
        )
        handle = RequestHandle(request)
        self.handles[request_id] = handle
        prep = self.profile.c_prep_us * 1e-6 * len(request.prompt_token_ids)
        if prep > 0:
            heapq.heappush(self._arrivals, (request.arrival_time + prep, next(self._seq), request))
        else:
            self.scheduler.add_request(request)
        self._wakeup.set()
        return handle

    def abort(self, request_id: str) -> bool:
        """Client went away: free the request's blocks (full ones stay cached)."""
        handle = self.handles.pop(request_id, None)
        if handle is None:
            return False
        self.scheduler.abort(handle.request)
        if not handle.finished:
            handle._push(self._output(handle.request, None, "", "abort"))
        return True

    def _check_admission(self, prompt_len: int) -> None:
        cfg = self.config
        waiting = self.scheduler.waiting
        if cfg.max_num_queued_reqs is not None and len(waiting) >= cfg.max_num_queued_reqs:
            self.recorder.admission_rejections["max_num_queued_reqs"] += 1
            raise QueueFullError("max_num_queued_reqs")
        limit = cfg.max_num_queued_tokens
        if limit is not None and self.scheduler.waiting_tokens() + prompt_len > limit:
            self.recorder.admission_rejections["max_num_queued_tokens"] += 1
            raise QueueFullError("max_num_queued_tokens")

    def _plan_length(
        self,
        request_id: str,
        max_tokens: int,
        output_tokens: int | None,
        ignore_eos: bool,
        min_tokens: int,
    ) -> int | None:
        if ignore_eos:
            return None
        if output_tokens is None:
            output_tokens = sample_length(self.config.output_len_dist, self.config.seed, request_id)
        output_tokens = max(output_tokens, min_tokens, 1)
        return output_tokens if output_tokens < max_tokens else None

    # --- lifecycle ---------------------------------------------------------------------
    def kill(self) -> None:
        """Behave like a crashed EngineCore: fail in-flight requests, refuse new ones."""
        self.dead = True
        for handle in list(self.handles.values()):
            self.scheduler.abort(handle.request)
            if not handle.finished:
                handle._push(self._output(handle.request, None, "", "error"))
        self.handles.clear()
        self._wakeup.set()

    def revive(self) -> None:
        self.dead = False
        self._wakeup.set()

    def reset(self, config: SimConfig | None = None) -> None:
        """Forget all state (cache, counters, requests); optionally switch config."""
        for handle in list(self.handles.values()):
            if not handle.finished:
                handle._push(self._output(handle.request, None, "", "abort"))
        if config is not None:
            self.config = config
            self.tokenizer = Tokenizer(
                vocab_size=config.vocab_size, chars_per_token=config.chars_per_token
            )
        self._reset_state()
        self._wakeup.set()

    def set_sleeping(self, sleeping: bool) -> None:
        self.sleeping = sleeping
        self._wakeup.set()

    # --- the step loop -----------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Step forever; each step sleeps its modelled duration times `time_scale`."""
        if self._origin is None:
            self._origin = trio.current_time()
        task_status.started()
        nominal = mark = trio.current_time()
        while True:
            sched = self.scheduler
            if self._arrivals:
                self._admit_arrivals()
            if self.dead or self.sleeping or not sched.has_work():
                if self._arrivals and not (self.dead or self.sleeping):
                    ready = self._origin + self._arrivals[0][0] * self.config.time_scale
                    with trio.move_on_at(ready):
                        await self._wakeup.wait()
                else:
                    await self._wakeup.wait()
                self._wakeup = trio.Event()
                nominal = mark = trio.current_time()
                continue
            start_sim = self.now()
            plan = sched.schedule(start_sim)
            if not plan.scheduled:
                landing = sched.next_load_ready()
                if landing is not None:
                    # Only CPU loads are under way: idle until one lands (or a submit).
                    with trio.move_on_at(self._origin + landing * self.config.time_scale):
                        await self._wakeup.wait()
                    self._wakeup = trio.Event()
                    nominal = mark = trio.current_time()
                    continue
                if not sched.running and sched.release_landed():
                    continue
                self._fail_unschedulable()
                await trio.lowlevel.checkpoint()
                continue
            dt = self._step_duration(plan)
            # Deadlines chain on the nominal clock, so time lost to a late wake-up (or to
            # the HTTP layer hogging the CPU) is caught up on the next steps.
            nominal += dt * self.config.time_scale
            await trio.sleep_until(nominal)
            end = trio.current_time()
            if sched is not self.scheduler:
                continue  # reset() while the step ran: its results belong to nobody
            self._account_clock(dt, mark, end, nominal)
            mark = end
            results = sched.complete_step(plan, self.now())
            self._record_step(plan, start_sim, dt)
            self._emit(results, self.now())

    def _admit_arrivals(self) -> None:
        now = self.now()
        while self._arrivals and self._arrivals[0][0] <= now:
            request = heapq.heappop(self._arrivals)[2]
            if request.status is Status.WAITING:  # not aborted while in the frontend
                self.scheduler.add_request(request)

    def _step_duration(self, plan: StepPlan) -> float:
        shape = batch_shape((s.num_new, s.start, s.is_decode) for s in plan.scheduled)
        dt = step_seconds(self.profile, shape)
        jitter = self.config.jitter
        if jitter > 0:
            dt *= 1.0 + self._jitter.uniform(-jitter, jitter)
        return dt

    def _account_clock(self, dt: float, since: float, end: float, nominal: float) -> None:
        """Busy wall time runs from the previous step's end (or the wake-up) to this one's."""
        rec = self.recorder
        rec.busy_sim_seconds += dt
        rec.busy_nominal_wall_seconds += dt * self.config.time_scale
        rec.busy_wall_seconds += end - since
        rec.lag_seconds = max(0.0, end - nominal)
        rec.max_lag_seconds = max(rec.max_lag_seconds, rec.lag_seconds)

    def _fail_unschedulable(self) -> None:
        # Nothing fits and nothing runs: the head request needs more KV than exists.
        sched = self.scheduler
        if sched.running or not sched.waiting:
            return
        request = sched.waiting[0]
        sched.abort(request)
        request.finish_reason = "error"
        handle = self.handles.pop(request.request_id, None)
        if handle is not None:
            handle._push(self._output(request, None, "", "error"))

    def _record_step(self, plan: StepPlan, start_sim: float, dt: float) -> None:
        self.recorder.iteration_tokens.observe(plan.num_tokens)
        self.trace.append(
            (
                start_sim,
                dt,
                plan.num_tokens,
                [(s.request.request_id, s.num_new, s.start, s.is_decode) for s in plan.scheduled],
                [r.request_id for r in plan.preempted],
                len(self.scheduler.running),
                len(self.scheduler.waiting),
            )
        )

    def _emit(self, results: list[StepResult], now: float) -> None:
        rec = self.recorder
        for result in results:
            req = result.request
            rec.token(req, now)
            handle = self.handles.get(req.request_id)
            reason = None
            if result.finished:
                reason = req.finish_reason
                req.finished_time = now
                self.recorder.finish(req, now)
                self.handles.pop(req.request_id, None)
            if handle is not None:
                token_ids = () if result.token_id is None else (result.token_id,)
                handle._push(self._output(req, token_ids, result.text, reason, now))

    def _output(
        self,
        req: SimRequest,
        token_ids: tuple[int, ...] | None,
        text: str,
        reason: str | None,
        now: float | None = None,
    ) -> StepOutput:
        return StepOutput(
            request_id=req.request_id,
            token_ids=token_ids or (),
            text=text,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=len(req.output_token_ids),
            time=self.now() if now is None else now,
            arrival_time=req.arrival_time,
            num_preemptions=req.num_preemptions,
        )


def sample_length(spec: str, seed: int, request_id: str) -> int:
    """Draw an output length from `lognormal:MEDIAN:SIGMA`, `uniform:LO:HI` or `fixed:N`."""
    kind, _, args = spec.partition(":")
    params = [float(a) for a in args.split(":") if a]
    rng = random.Random(f"len:{seed}:{request_id}")
    if kind == "fixed" and len(params) == 1:
        return max(1, int(params[0]))
    if kind == "uniform" and len(params) == 2:
        return max(1, rng.randint(int(params[0]), int(params[1])))
    if kind == "lognormal" and len(params) == 2:
        return max(1, round(rng.lognormvariate(math.log(params[0]), params[1])))
    raise ValueError(f"bad output length distribution {spec!r}")
