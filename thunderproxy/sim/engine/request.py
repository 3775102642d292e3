"""One request inside the simulated engine: its tokens, its KV blocks and its timeline.

It sits below the scheduler that moves it and the metrics that observe it, so neither imports
the other for it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from .blocks import KVBlock, block_hashes, salt_key


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    # Produces the next (token id, text) pair the "model" samples.
    sampler: Callable[[], tuple[int, str]]
    # Output length at which the request stops with EOS; None: run to max_tokens.
    stop_at: int | None = None
    eos_token_id: int = -1
    program: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_text: list[str] = field(default_factory=list)
    num_computed_tokens: int = 0
    blocks: list[KVBlock] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the hash map
    num_cached_tokens: int = -1  # prefix hit of the first schedule; -1 until then
    num_preemptions: int = 0
    max_computed: int = 0  # high-water mark, to count recomputation after preemption
    status: Status = Status.WAITING
    finish_reason: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # CPU tier: when the blocks being loaded land (None: not loading), their hashes, the
    # tokens the first schedule got from the tier, and how many blocks were offered to it.
    load_ready: float | None = None
    load_hashes: list[int] = field(default_factory=list)
    num_external_tokens: int = 0
    num_offered_blocks: int = 0
    # Kept as plain attributes: the step loop reads them for every request every step.
    num_prompt_tokens: int = 0
    num_tokens: int = 0

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_tokens = self.num_prompt_tokens + len(self.output_token_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if stop <= prompt_len:
            return self.prompt_token_ids[start:stop]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : stop - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - prompt_len]

    def ensure_hashes(self, n_blocks: int, block_size: int) -> None:
        have = len(self.block_hashes)
        if have >= n_blocks:
            return
        # Hash only the new blocks: slicing the whole history every decode step is too slow.
        window = self.tokens(have * block_size, n_blocks * block_size)
        if have:
            self.block_hashes.extend(block_hashes(window, block_size, parent=self.block_hashes[-1]))
        else:
            self.block_hashes.extend(
                block_hashes(window, block_size, salt=salt_key(self.cache_salt))
            )
