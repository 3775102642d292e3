"""Admission under KV pressure: vLLM 0.32 keeps a request waiting until its whole prompt fits
(``scheduler_reserve_full_isl``) rather than admitting its first chunk and preempting later."""

from __future__ import annotations

from thunderproxy.sim.engine.blocks import BlockPool
from thunderproxy.sim.engine.scheduler import Scheduler, SimRequest, Status

from .helpers import token_prompt


def scheduler(*, reserve_full_isl: bool) -> Scheduler:
    # 40 usable blocks of 32 tokens (1,280 tokens); the budget prefills 512 tokens a step.
    return Scheduler(
        BlockPool(41), block_size=32, max_model_len=4096, max_num_seqs=16,
        max_num_batched_tokens=512, reserve_full_isl=reserve_full_isl,
    )  # fmt: skip


def request(name: str, seed: int, tokens: int, max_tokens: int = 400) -> SimRequest:
    return SimRequest(name, token_prompt(seed, tokens), max_tokens, 0.0, sampler=lambda: (7, "x"))


def run_until_idle(sched: Scheduler, limit: int = 5_000) -> None:
    now = 0.0
    while sched.has_work() and limit:
        now += 1.0
        sched.complete_step(sched.schedule(now), now)
        limit -= 1
    assert not sched.has_work()


def test_a_prompt_that_does_not_fit_whole_waits_for_capacity() -> None:
    sched = scheduler(reserve_full_isl=True)
    running = request("a", 0, 600)  # 19 blocks, decoding into more
    sched.add_request(running)
    sched.complete_step(sched.schedule(1.0), 1.0)
    sched.complete_step(sched.schedule(2.0), 2.0)
    # 800 tokens need 25 blocks; 21 are free: its first chunk (16 blocks) would fit.
    late = request("b", 1, 800)
    sched.add_request(late)
    sched.complete_step(sched.schedule(3.0), 3.0)
    assert late.status is Status.WAITING
    assert late.num_computed_tokens == 0
    assert sched.stats.preemptions == 0
    run_until_idle(sched)
    assert sched.stats.preemptions == 0


def test_without_the_gate_the_first_chunk_is_admitted_and_preempts_later() -> None:
    sched = scheduler(reserve_full_isl=False)
    sched.add_request(request("a", 0, 600))
    sched.complete_step(sched.schedule(1.0), 1.0)
    sched.complete_step(sched.schedule(2.0), 2.0)
    late = request("b", 1, 800)
    sched.add_request(late)
    sched.complete_step(sched.schedule(3.0), 3.0)
    assert late.status is Status.RUNNING
    run_until_idle(sched)
    assert sched.stats.preemptions > 0


def resend_after_holder(holder_tokens: int) -> SimRequest:
    """A 700-token prompt cached (21 full blocks, free), then a holder running, then the same
    prompt with 64 tokens more: 24 blocks, 21 of them hits that sit in the free queue."""
    sched = scheduler(reserve_full_isl=True)
    sched.add_request(request("a", 0, 700, max_tokens=1))
    run_until_idle(sched)
    sched.add_request(request("h", 5, holder_tokens, max_tokens=300))
    sched.complete_step(sched.schedule(10.0), 10.0)
    sched.complete_step(sched.schedule(11.0), 11.0)
    again = SimRequest("a2", [*token_prompt(0, 700), *token_prompt(9, 64)], 1, 0.0,
                       sampler=lambda: (7, "x"))  # fmt: skip
    sched.add_request(again)
    sched.complete_step(sched.schedule(12.0), 12.0)
    return again


def test_hit_blocks_in_the_free_queue_count_as_blocks_the_request_takes() -> None:
    # A 400-token holder leaves 27 blocks free: the 24 it needs, hits included, fit.
    admitted = resend_after_holder(400)
    assert admitted.status is Status.FINISHED  # one token asked: admitted and done in a step
    assert admitted.num_cached_tokens == 21 * 32
    # A 600-token holder leaves 21 free: only 3 blocks are new, but the 21 hits leave the
    # free queue too, and 24 > 21: it waits, as vLLM counts it.
    assert resend_after_holder(600).status is Status.WAITING
