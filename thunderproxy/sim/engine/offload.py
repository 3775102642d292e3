"""The CPU tier of vLLM's native KV offloading connector (`--kv-offloading-size`).

Pure data (no trio): the scheduler stores every full block a step computed, looks up
prefixes the GPU pool lost, and loads hits back; the engine owns time and passes `now`.
Transfers run on one channel per direction (GPU->CPU stores, CPU->GPU loads), each
transfer waiting for the previous one in its direction: the cost of one is
`latency + bytes / bandwidth`. docs/SIMULATOR.md lists what matches vLLM and what not.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from .metrics import Histogram

# Transfer sizes in bytes for vllm:kv_offload_size: 64 KiB .. 4 GiB by powers of 4.
TRANSFER_SIZE_BUCKETS = tuple(float(4**i * 65536) for i in range(9))


class CPUTier:
    """`num_blocks` CPU blocks keyed by block hash, evicted least recently used first."""

    def __init__(
        self,
        num_blocks: int,
        *,
        block_size: int,
        bytes_per_block: int,
        bandwidth_bytes_per_s: float,
        latency_s: float,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.bandwidth = bandwidth_bytes_per_s
        self.latency = latency_s
        # hash -> simulated time its store finishes (it is not a hit before); the first
        # entry is the least recently used.
        self.blocks: OrderedDict[int, float] = OrderedDict()
        # Blocks being loaded cannot be evicted (vLLM's ref_cnt on a CPU block).
        self.refs: Counter[int] = Counter()
        self.free_at = {"GPU_to_CPU": 0.0, "CPU_to_GPU": 0.0}
        # Counters, in blocks unless named otherwise.
        self.stored = 0
        self.store_skipped = 0  # stores dropped because nothing could be evicted
        self.loaded = 0
        self.load_requests = 0
        self.evicted = 0
        self.bytes = {"GPU_to_CPU": 0, "CPU_to_GPU": 0}
        self.seconds = {"GPU_to_CPU": 0.0, "CPU_to_GPU": 0.0}
        self.sizes = {
            "GPU_to_CPU": Histogram(TRANSFER_SIZE_BUCKETS),
            "CPU_to_GPU": Histogram(TRANSFER_SIZE_BUCKETS),
        }

    def __len__(self) -> int:
        return len(self.blocks)

    def lookup(self, hashes: Sequence[int], now: float) -> int:
        """How many leading `hashes` are stored and finished storing."""
        hits = 0
        for block_hash in hashes:
            ready = self.blocks.get(block_hash)
            if ready is None or ready > now:
                break
            hits += 1
        return hits

    def touch(self, hashes: Sequence[int]) -> None:
        """Mark as most recently used; the first block ends up the most recent of all,
        so a shared prefix outlives the blocks that continue it."""
        for block_hash in reversed(hashes):
            if block_hash in self.blocks:
                self.blocks.move_to_end(block_hash)

    def load(self, hashes: Sequence[int], now: float) -> float:
        """Start a CPU->GPU transfer of stored blocks; returns when it completes."""
        for block_hash in hashes:
            self.refs[block_hash] += 1
        self.loaded += len(hashes)
        self.load_requests += 1
        return self._transfer("CPU_to_GPU", len(hashes), now)

    def complete_load(self, hashes: Sequence[int]) -> None:
        for block_hash in hashes:
            self.refs[block_hash] -= 1
            if self.refs[block_hash] <= 0:
                del self.refs[block_hash]

    def store(self, hashes: Sequence[int], now: float) -> int:
        """Copy the blocks not stored yet; evict LRU blocks for room, or store nothing."""
        new = [h for h in dict.fromkeys(hashes) if h not in self.blocks]
        self.touch(hashes)
        if not new:
            return 0
        excess = len(self.blocks) + len(new) - self.num_blocks
        victims = []
        if excess > 0:
            for block_hash in self.blocks:
                if block_hash not in self.refs:
                    victims.append(block_hash)
                    if len(victims) == excess:
                        break
            else:
                self.store_skipped += len(new)
                return 0
        for block_hash in victims:
            del self.blocks[block_hash]
        self.evicted += len(victims)
        done = self._transfer("GPU_to_CPU", len(new), now)
        for block_hash in new:
            self.blocks[block_hash] = done
        self.stored += len(new)
        return len(new)

    def _transfer(self, kind: str, n_blocks: int, now: float) -> float:
        size = n_blocks * self.bytes_per_block
        seconds = self.latency + size / self.bandwidth
        start = max(now, self.free_at[kind])
        self.free_at[kind] = end = start + seconds
        self.bytes[kind] += size
        self.seconds[kind] += seconds
        self.sizes[kind].observe(size)
        return end
