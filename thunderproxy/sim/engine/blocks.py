"""The paged KV pool: blocks, chained block hashes and the LRU free queue of vLLM V1.

Pure data structures (no trio): the scheduler drives them, tests poke them directly.
Eviction is lazy, exactly as in vLLM: a freed block keeps its hash and stays findable
until allocation pops it from the head of the free queue.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

# Seeds the chain so that block 0's hash does not depend on Python's hash randomisation.
ROOT_HASH = 0x7468756E646572


def salt_key(cache_salt: str | None) -> int:
    """A stable integer for a cache_salt, folded into the first block's hash only."""
    if not cache_salt:
        return 0
    digest = hashlib.blake2b(cache_salt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    salt: int = 0,
    parent: int | None = None,
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`.

    With `parent` None the chain starts at block 0 (and `salt` goes into that block);
    otherwise `token_ids` continue a chain whose last hash is `parent`. Tuples of ints
    hash deterministically in CPython (only str/bytes are randomised), so the chain is
    stable across processes.
    """
    hashes = []
    extra = salt if parent is None else 0
    prev = ROOT_HASH if parent is None else parent
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash((prev, tuple(token_ids[i : i + block_size]), extra))
        extra = 0
        hashes.append(prev)
    return hashes


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next", "program")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None
        # Simulator truth: the program whose KV the block holds (last allocator or hitter).
        self.program: str | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeQueue:
    """Doubly linked list of free blocks; the head is reused first (least recently freed)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        self.append_n(list(blocks))

    def popleft_n(self, n: int) -> list[KVBlock]:
        out = []
        node = self._head.next
        for _ in range(n):
            if node is None or node is self._tail:
                raise AssertionError("free queue underflow")
            out.append(node)
            node = node.next
        self._head.next = node
        assert node is not None
        node.prev = self._head
        for block in out:
            block.prev = block.next = None
        self.num_free -= n
        return out

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise AssertionError(f"{block} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free -= 1

    def append_n(self, blocks: Sequence[KVBlock]) -> None:
        last = self._tail.prev
        assert last is not None
        for block in blocks:
            last.next = block
            block.prev = last
            last = block
        last.next = self._tail
        self._tail.prev = last
        self.num_free += len(blocks)

    def prepend_n(self, blocks: Sequence[KVBlock]) -> None:
        """Insert `blocks` at the head, keeping their order (the first is reused first)."""
        first = self._head.next
        assert first is not None
        prev = self._head
        for block in blocks:
            prev.next = block
            block.prev = prev
            prev = block
        prev.next = first
        first.prev = prev
        self.num_free += len(blocks)

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


class BlockPool:
    """`num_blocks` blocks, block 0 being the never-allocated null block."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("a block pool needs the null block plus at least one more")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeQueue(self.blocks[1:])
        # hash -> {block_id: block}; duplicates happen when two requests fill the same
        # block before either is cached, and all of them stay findable.
        self.cached: dict[int, dict[int, KVBlock]] = {}
        self.evictions = 0
        self.evictions_by_program: Counter[str] = Counter()
        self.resident_by_program: Counter[str] = Counter()
        self.num_cached_free = 0  # free blocks that still carry a hash

    # --- queries -----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: cached-but-free blocks count as free."""
        return 1.0 - self.num_free / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        entry = self.cached.get(block_hash)
        if not entry:
            return None
        return next(iter(entry.values()))

    def find_prefix(self, hashes: Sequence[int], max_blocks: int) -> list[KVBlock]:
        """The longest run of cached blocks matching `hashes` from block 0."""
        hits: list[KVBlock] = []
        if not self.enable_caching:
            return hits
        for block_hash in hashes[:max_blocks]:
            block = self.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    # --- mutations ---------------------------------------------------------------------
    def touch(self, blocks: Iterable[KVBlock], program: str | None) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            block.ref_cnt += 1
            self._set_program(block, program)

    def get_new_blocks(self, n: int, program: str | None) -> list[KVBlock]:
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks, only {self.num_free} free")
        blocks = self.free_queue.popleft_n(n)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            self._set_program(block, program)
        return blocks

    def cache_block(self, block: KVBlock, block_hash: int) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, {})[block.block_id] = block

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Release references; `ordered` lists blocks in eviction order (first goes first)."""
        evict_first: list[KVBlock] = []
        evict_last: list[KVBlock] = []
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and block is not self.null_block:
                if block.block_hash is None:
                    # Partial blocks can never be hit again: hand them out first.
                    self._set_program(block, None)
                    evict_first.append(block)
                else:
                    evict_last.append(block)
        self.free_queue.prepend_n(evict_first)
        self.free_queue.append_n(evict_last)
        self.num_cached_free += len(evict_last)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is referenced."""
        if self.num_free != self.num_blocks - 1:
            return False
        for entry in self.cached.values():
            for block in entry.values():
                block.block_hash = None
                self._set_program(block, None)
        self.cached.clear()
        self.num_cached_free = 0
        return True

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        entry = self.cached.get(block.block_hash)
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                del self.cached[block.block_hash]
        block.block_hash = None
        self.num_cached_free -= 1
        self.evictions += 1
        if block.program is not None:
            self.evictions_by_program[block.program] += 1

    def _set_program(self, block: KVBlock, program: str | None) -> None:
        if block.program == program:
            return
        if block.program is not None:
            counter = self.resident_by_program
            counter[block.program] -= 1
            if counter[block.program] <= 0:
                del counter[block.program]
        block.program = program
        if program is not None:
            self.resident_by_program[program] += 1
