"""The KV block pool: free-queue order, lazy eviction, hash chains, usage."""

from __future__ import annotations

from thunderproxy.sim.engine.blocks import BlockPool, block_hashes, salt_key


def ids(blocks: object) -> list[int]:
    return [b.block_id for b in blocks]  # type: ignore[attr-defined]


def test_block_zero_is_the_null_block_and_never_allocated() -> None:
    pool = BlockPool(5)
    assert pool.num_free == 4
    assert ids(pool.get_new_blocks(4, None)) == [1, 2, 3, 4]
    assert pool.usage() == 1.0


def test_free_order_hashed_to_tail_reversed_unhashed_to_head() -> None:
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(4, "p")  # ids 1..4
    for block, h in zip(blocks[:3], (11, 12, 13), strict=True):
        pool.cache_block(block, h)  # block 4 stays a partial, unhashed block
    pool.free_blocks(reversed(blocks))
    # Unhashed partial first, then the untouched 5..7, then the prefix tail-first.
    assert ids(pool.free_queue) == [4, 5, 6, 7, 3, 2, 1]
    assert pool.num_cached_free == 3
    assert pool.usage() == 0.0


def test_eviction_is_lazy_and_hits_touch_blocks_out_of_the_queue() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(2, "a")
    pool.cache_block(a[0], 100)
    pool.cache_block(a[1], 101)
    pool.free_blocks(reversed(a))
    assert pool.find_prefix([100, 101], 2) == a  # still findable after free
    pool.touch(a[:1], "b")
    assert pool.num_free == 2
    assert a[0].ref_cnt == 1
    assert pool.resident_by_program == {"b": 1, "a": 1}
    # Allocating pops the head: the free block 3, then a[1] (evicted: its hash goes).
    assert ids(pool.get_new_blocks(2, "c")) == [3, 2]
    assert pool.evictions == 1
    assert pool.evictions_by_program == {"a": 1}
    assert pool.get_cached_block(101) is None
    assert pool.find_prefix([100, 101], 2) == a[:1]


def test_reset_prefix_cache_refused_while_blocks_are_held() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(1, None)
    pool.cache_block(blocks[0], 5)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(5) is None


def test_hash_chain_is_prefix_stable_and_salted_on_block_zero_only() -> None:
    tokens = list(range(100))
    full = block_hashes(tokens, 16)
    assert len(full) == 6
    assert block_hashes(tokens[:40], 16) == full[:2]
    assert block_hashes(tokens[32:64], 16, parent=full[1]) == full[2:4]
    salted = block_hashes(tokens, 16, salt=salt_key("prog-a"))
    assert all(x != y for x, y in zip(salted, full, strict=True))
    assert salt_key(None) == salt_key("") == 0
    assert salt_key("prog-a") == salt_key("prog-a") != salt_key("prog-b")
