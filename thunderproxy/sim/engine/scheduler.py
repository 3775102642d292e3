"""vLLM V1's scheduler, reduced to what shapes KV residency: continuous batching, chunked
prefill under a token budget, prefix lookup on first schedule, recompute preemption.

Pure logic driven by `schedule()` / `complete_step(plan, now)`; the engine owns time.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from .blocks import BlockPool, KVBlock
from .offload import CPUTier
from .request import SimRequest, Status

__all__ = [
    "Scheduled",
    "Scheduler",
    "SchedulerStats",
    "SimRequest",
    "Status",
    "StepPlan",
    "StepResult",
]


@dataclass(slots=True)
class Scheduled:
    request: SimRequest
    num_new: int
    start: int  # position of the first scheduled token
    is_decode: bool


@dataclass
class StepPlan:
    scheduled: list[Scheduled]
    preempted: list[SimRequest]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


@dataclass
class StepResult:
    """One request's share of a finished step: what it sampled, if anything."""

    request: SimRequest
    token_id: int | None
    text: str
    finished: bool


@dataclass
class SchedulerStats:
    prefix_queries: int = 0  # tokens, first schedule only
    prefix_hits: int = 0
    prefix_queries_blocks: int = 0  # the 0.8.x unit
    prefix_hits_blocks: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0  # local and external (CPU tier) hits
    prompt_tokens_external: int = 0
    external_queries: int = 0  # tokens, first schedule only, with a CPU tier
    external_hits: int = 0
    generation_tokens: int = 0
    recomputed_prefill_tokens: int = 0
    steps: int = 0
    recomputed_by_program: Counter[str] = field(default_factory=Counter)
    preemptions_by_program: Counter[str] = field(default_factory=Counter)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        long_prefill_token_threshold: int = 0,
        policy: str = "fcfs",
        cpu: CPUTier | None = None,
        reserve_full_isl: bool = True,
    ) -> None:
        self.pool = pool
        self.cpu = cpu
        self.loading: list[SimRequest] = []  # waiting requests whose CPU load is under way
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.policy = policy
        self.reserve_full_isl = reserve_full_isl
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.stats = SchedulerStats()
        self.preemption_log: deque[tuple[float, str]] = deque(maxlen=1000)

    # --- queue management --------------------------------------------------------------
    def add_request(self, request: SimRequest) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def waiting_tokens(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    def abort(self, request: SimRequest) -> None:
        """Drop a request wherever it is; its full blocks stay cached."""
        if request.status is Status.FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.load_ready is not None:
            self.loading.remove(request)
            self._end_load(request)
        self._free(request)
        request.status = Status.FINISHED
        request.finish_reason = "abort"

    # --- one engine step ---------------------------------------------------------------
    def next_load_ready(self) -> float | None:
        """When the earliest CPU->GPU load under way lands; None when none is."""
        return min((r.load_ready for r in self.loading if r.load_ready is not None), default=None)

    def schedule(self, now: float) -> StepPlan:
        if self.loading:
            self._finish_loads(now)
        budget = self.max_num_batched_tokens
        scheduled: list[Scheduled] = []
        preempted: list[SimRequest] = []
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            num_new = self._cap(req, req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            while not self._allocate(req, num_new, ()):
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                del self.running[victim_index]
                if victim_index < index:
                    index -= 1
                for item in scheduled:
                    if item.request is victim:
                        scheduled.remove(item)
                        budget += item.num_new
                        break
                self._preempt(victim, now)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break
            scheduled.append(self._scheduled(req, num_new))
            budget -= num_new
            index += 1

        # A step that had to preempt admits nobody: the pool is already too tight.
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                head = self._peek_waiting()
                if head is None:
                    break  # everyone waiting is waiting for a CPU load
                req = head
                if req.blocks:
                    # Its CPU load landed: blocks and computed tokens are already in place.
                    hits = []
                    computed = req.num_computed_tokens
                else:
                    hits = self._lookup(req)
                    computed = len(hits) * self.block_size
                    if self.cpu is not None and self.pool.enable_caching:
                        started = self._start_load(req, hits, now)
                        if started is None:
                            break  # no GPU blocks to load into
                        if started:
                            continue  # it waits for its load; vLLM looks at the next one
                num_new = self._cap(req, req.num_tokens - computed, budget, computed=computed)
                if num_new <= 0 or not self._whole_sequence_fits(req, hits):
                    break  # it waits for capacity; nobody behind it overtakes it
                if not self._allocate(req, num_new, hits):
                    break
                self.waiting.remove(req)
                self.running.append(req)
                req.status = Status.RUNNING
                if req.num_cached_tokens < 0:
                    self._record_first_schedule(req, computed, now)
                scheduled.append(self._scheduled(req, num_new))
                budget -= num_new
        return StepPlan(scheduled, preempted)

    def complete_step(self, plan: StepPlan, now: float = 0.0) -> list[StepResult]:
        """Advance computed tokens, sample where a request has caught up, free finishers.

        `now` (the step's end) times the CPU tier's stores; without a tier it is unused.
        """
        self.stats.steps += 1
        results = []
        for item in plan.scheduled:
            req = item.request
            if req.status is not Status.RUNNING:  # aborted while the step ran
                continue
            before = req.num_computed_tokens
            req.num_computed_tokens = after = before + item.num_new
            if self.cpu is not None and self.pool.enable_caching:
                self._offer_to_cpu(req, after, now)
            if before < req.max_computed:
                redone = min(after, req.max_computed) - before
                self.stats.recomputed_prefill_tokens += redone
                if req.program is not None:
                    self.stats.recomputed_by_program[req.program] += redone
            req.max_computed = max(req.max_computed, after)
            if after < req.num_tokens:
                continue  # a prefill chunk that did not reach the end of the prompt
            token_id, text = self._sample(req)
            finished = self._check_stop(req)
            if finished:
                self.running.remove(req)
                self._free(req)
                req.status = Status.FINISHED
            results.append(StepResult(req, token_id, text, finished))
        return results

    # --- helpers -----------------------------------------------------------------------
    def _cap(self, req: SimRequest, wanted: int, budget: int, *, computed: int = -1) -> int:
        if computed < 0:
            computed = req.num_computed_tokens
        threshold = self.long_prefill_token_threshold
        if 0 < threshold < wanted:
            wanted = threshold
        # One slot stays free for the token this step samples.
        return min(wanted, budget, self.max_model_len - computed - 1)

    def _scheduled(self, req: SimRequest, num_new: int) -> Scheduled:
        start = req.num_computed_tokens
        is_decode = num_new == 1 and start >= req.num_prompt_tokens
        return Scheduled(req, num_new, start, is_decode)

    def _peek_waiting(self) -> SimRequest | None:
        ready: Sequence[SimRequest] = self.waiting
        if self.loading:
            ready = [r for r in self.waiting if r.load_ready is None]
            if not ready:
                return None
        if self.policy == "priority":
            return min(ready, key=lambda r: (r.priority, r.arrival_time))
        return ready[0]

    def _pick_victim(self) -> SimRequest:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _lookup(self, req: SimRequest) -> list[KVBlock]:
        if not self.pool.enable_caching:
            return []
        # Never a full hit: the last token must be computed to sample from it.
        max_blocks = (req.num_tokens - 1) // self.block_size
        req.ensure_hashes(max_blocks, self.block_size)
        return self.pool.find_prefix(req.block_hashes, max_blocks)

    # --- the CPU tier --------------------------------------------------------------------
    def _start_load(self, req: SimRequest, hits: list[KVBlock], now: float) -> bool | None:
        """Load the blocks after the GPU hit that the CPU tier holds, as vLLM's connector
        does asynchronously: the request holds GPU blocks for them and is skipped until the
        transfer lands. False: nothing to load; None: not enough free GPU blocks."""
        cpu = self.cpu
        assert cpu is not None
        max_blocks = (req.num_tokens - 1) // self.block_size
        wanted = req.block_hashes[:max_blocks]
        # vLLM touches every block of the request on each lookup, hit or not.
        cpu.touch(wanted)
        n = cpu.lookup(wanted[len(hits) :], now)
        if n == 0:
            return False
        # New blocks for the loaded part only; free hit blocks are about to leave the queue.
        available = self.pool.num_free - sum(1 for b in hits if b.ref_cnt == 0)
        if n > available:
            return None
        if hits:
            self.pool.touch(hits, req.program)
        req.blocks = list(hits) + self.pool.get_new_blocks(n, req.program)
        req.num_cached_blocks = len(hits)
        req.num_computed_tokens = len(hits) * self.block_size
        req.load_hashes = wanted[len(hits) : len(hits) + n]
        req.load_ready = cpu.load(req.load_hashes, now)
        if req.num_cached_tokens < 0:
            req.num_external_tokens = n * self.block_size
        self.loading.append(req)
        return True

    def release_landed(self) -> bool:
        """Free the blocks of waiting requests whose load landed but that could not start.

        For an engine where nothing runs and nothing can be admitted: such requests hold
        blocks that the head of the queue needs, and would wait for each other forever. Their
        loaded blocks stay cached, so a later lookup finds them on the GPU if they survive.
        """
        stalled = [r for r in self.waiting if r.blocks and r.load_ready is None]
        for req in stalled:
            self._free(req)
            req.num_computed_tokens = 0
            req.num_cached_blocks = 0
        return bool(stalled)

    def _finish_loads(self, now: float) -> None:
        # A nanosecond of slack: the engine wakes at the landing time converted to trio
        # time and back, which may round to just before it.
        due = now + 1e-9
        landed = [r for r in self.loading if r.load_ready is not None and r.load_ready <= due]
        for req in landed:
            self.loading.remove(req)
            self._end_load(req)
            req.num_computed_tokens = len(req.blocks) * self.block_size
            # vLLM registers loaded blocks in the GPU prefix cache once they have landed.
            self._cache_full_blocks(req, req.num_computed_tokens)
            req.max_computed = max(req.max_computed, req.num_computed_tokens)

    def _end_load(self, req: SimRequest) -> None:
        assert self.cpu is not None
        self.cpu.complete_load(req.load_hashes)
        req.load_hashes = []
        req.load_ready = None

    def _offer_to_cpu(self, req: SimRequest, computed: int, now: float) -> None:
        # Every full block is stored once it is computed (after the step's forward pass),
        # not when the GPU evicts it; blocks the tier already has are skipped.
        full = min(computed, req.num_tokens) // self.block_size
        if full <= req.num_offered_blocks:
            return
        req.ensure_hashes(full, self.block_size)
        assert self.cpu is not None
        self.cpu.store(req.block_hashes[req.num_offered_blocks : full], now)
        req.num_offered_blocks = full

    def _whole_sequence_fits(self, req: SimRequest, hits: Sequence[KVBlock]) -> bool:
        """vLLM 0.32's admission gate (``scheduler_reserve_full_isl``): a waiting request
        starts only when the blocks for all of its tokens, less its prefix hits, are free.
        Without it, chunked prefill admits on the first chunk and the later chunks preempt
        running requests, which real vLLM no longer does: it keeps the request waiting
        (``num_requests_waiting_by_reason{reason="capacity"}``)."""
        if not self.reserve_full_isl or req.blocks:
            return True  # a request whose CPU load landed already holds its blocks
        bs = self.block_size
        total = -(-min(req.num_tokens, self.max_model_len) // bs)
        # Hit blocks that sit in the free queue leave it when the request takes them.
        evictable = sum(1 for b in hits if b.ref_cnt == 0)
        return total - len(hits) + evictable <= self.pool.num_free

    def _allocate(self, req: SimRequest, num_new: int, hits: Sequence[KVBlock]) -> bool:
        bs = self.block_size
        end = req.num_computed_tokens + num_new
        if not hits and end <= len(req.blocks) * bs:
            # Decode inside the last block: nothing to allocate, maybe a block to register.
            if min(end, req.num_tokens) // bs > req.num_cached_blocks:
                self._cache_full_blocks(req, end)
            return True
        computed = req.num_computed_tokens + len(hits) * bs
        needed = -(-(computed + num_new) // bs) - len(req.blocks) - len(hits)
        # Hit blocks that sit in the free queue are about to leave it.
        available = self.pool.num_free - sum(1 for b in hits if b.ref_cnt == 0)
        if needed > available:
            return False
        if hits:
            self.pool.touch(hits, req.program)
            req.blocks.extend(hits)
            req.num_computed_tokens = computed
            req.num_cached_blocks = len(hits)
        if needed > 0:
            req.blocks.extend(self.pool.get_new_blocks(needed, req.program))
        self._cache_full_blocks(req, computed + num_new)
        return True

    def _cache_full_blocks(self, req: SimRequest, end: int) -> None:
        # vLLM registers blocks as cached when they are scheduled, not when computed.
        bs = self.block_size
        full = min(end, req.num_tokens) // bs
        if full > req.num_cached_blocks:
            req.ensure_hashes(full, bs)
            for i in range(req.num_cached_blocks, full):
                self.pool.cache_block(req.blocks[i], req.block_hashes[i])
            req.num_cached_blocks = full

    def _record_first_schedule(self, req: SimRequest, computed: int, now: float) -> None:
        # Like vLLM, cached_tokens counts the connector's tokens; the prefix-cache
        # counters count the GPU's own hits and the external_* ones the tier's.
        req.num_cached_tokens = computed
        req.first_scheduled_time = now
        if self.pool.enable_caching:
            stats = self.stats
            local = computed - req.num_external_tokens
            stats.prefix_queries += req.num_tokens
            stats.prefix_hits += local
            stats.prefix_queries_blocks += req.num_tokens // self.block_size
            stats.prefix_hits_blocks += local // self.block_size
            if self.cpu is not None:
                stats.external_queries += req.num_tokens
                stats.external_hits += req.num_external_tokens

    def _preempt(self, req: SimRequest, now: float) -> None:
        self._free(req)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        req.num_cached_blocks = 0
        req.num_preemptions += 1
        self.stats.preemptions += 1
        if req.program is not None:
            self.stats.preemptions_by_program[req.program] += 1
        self.preemption_log.append((now, req.request_id))
        self.waiting.appendleft(req)

    def _free(self, req: SimRequest) -> None:
        # Tail blocks first, so a request's shared prefix is the last of it to be evicted.
        self.pool.free_blocks(reversed(req.blocks))
        req.blocks = []

    def _sample(self, req: SimRequest) -> tuple[int, str]:
        n_out = len(req.output_token_ids) + 1
        if req.stop_at is not None and n_out >= req.stop_at:
            token_id, text = req.eos_token_id, ""
        else:
            token_id, text = req.sampler()
        req.output_token_ids.append(token_id)
        req.output_text.append(text)
        req.num_tokens += 1
        if n_out == 1:
            self.stats.prompt_tokens += req.num_prompt_tokens
            self.stats.prompt_tokens_cached += max(req.num_cached_tokens, 0)
            self.stats.prompt_tokens_external += req.num_external_tokens
        self.stats.generation_tokens += 1
        return token_id, text

    def _check_stop(self, req: SimRequest) -> bool:
        n_out = len(req.output_token_ids)
        if req.stop_at is not None and n_out >= req.stop_at:
            req.finish_reason = "stop"
        elif n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.finish_reason = "length"
        else:
            return False
        return True
