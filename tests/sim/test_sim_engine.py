"""Engine behaviour on the MockClock: prefix caching, LRU, preemption, batching, lifecycle."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio
from trio.testing import MockClock

from thunderproxy.sim import Engine, EngineDeadError, QueueFullError, SimConfig, StepOutput

from .helpers import SMALL, token_prompt

Start = Callable[[SimConfig], Awaitable[Engine]]


async def run(engine: Engine, prompt: list[int], **kw: object) -> list[StepOutput]:
    kw.setdefault("max_tokens", 3)
    kw.setdefault("ignore_eos", True)
    handle = engine.submit(prompt, **kw)  # type: ignore[arg-type]
    return [out async for out in handle]


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        pytest.param(608, 576, id="live-608"),
        pytest.param(231, 224, id="live-231"),
        pytest.param(64, 32, id="exact-blocks-recompute-last"),
        pytest.param(33, 32, id="one-block-plus-one"),
        pytest.param(32, 0, id="single-block-never-hits"),
    ],
)
async def test_cached_tokens_on_repeat(
    autojump_clock: MockClock,
    start_engine: Start,
    small_config: SimConfig,
    length: int,
    expected: int,
) -> None:
    engine = await start_engine(small_config)
    prompt = token_prompt(1, length)
    assert (await run(engine, prompt))[-1].num_cached_tokens == 0
    assert (await run(engine, prompt))[-1].num_cached_tokens == expected
    assert expected == (length - 1) // 32 * 32


async def test_cache_salt_separates_caches(
    autojump_clock: MockClock, start_engine: Start, small_config: SimConfig
) -> None:
    engine = await start_engine(small_config)
    prompt = token_prompt(2, 608)
    await run(engine, prompt)
    hits = [
        (await run(engine, prompt, cache_salt=salt))[-1].num_cached_tokens
        for salt in ("prog-a", "prog-a", "prog-b", None)
    ]
    assert hits == [0, 576, 0, 576]


async def test_lru_survival_matches_live_vllm(
    autojump_clock: MockClock, start_engine: Start, small_config: SimConfig
) -> None:
    """A live run on vLLM 0.32: a 608-token prefix survives 3 other prompts, not 6 more."""
    engine = await start_engine(small_config)
    target = token_prompt(0, 608)
    await run(engine, target)
    assert (await run(engine, target))[-1].num_cached_tokens == 576
    for seed in range(100, 103):
        await run(engine, token_prompt(seed, 608))
    assert (await run(engine, target))[-1].num_cached_tokens == 576
    for seed in range(200, 206):
        await run(engine, token_prompt(seed, 608))
    assert (await run(engine, target))[-1].num_cached_tokens == 0
    # Idle usage leaves the cached blocks out, as vLLM's kv_cache_usage_perc does.
    assert engine.pool.usage() == 0.0
    assert engine.pool.num_cached_free > 0


async def test_touch_moves_prefix_to_mru_end(
    autojump_clock: MockClock, start_engine: Start, small_config: SimConfig
) -> None:
    """A keep-alive touch (max_tokens=1) lets a prefix outlive traffic that evicts it."""
    engine = await start_engine(small_config)
    a, b = token_prompt(10, 608), token_prompt(11, 608)
    await run(engine, a)
    await run(engine, b)
    for seed in range(300, 304):
        await run(engine, token_prompt(seed, 608))
        await run(engine, a, max_tokens=1)  # touch a, never b
    assert (await run(engine, a))[-1].num_cached_tokens == 576
    assert (await run(engine, b))[-1].num_cached_tokens == 0


async def test_preemption_under_overload_matches_live_vllm(
    autojump_clock: MockClock, start_engine: Start, small_config: SimConfig
) -> None:
    """Six 608+700 streams in a 100x32 pool. vLLM 0.32: 6 preemptions, every stream
    completes, five get their first token at once and one queues until blocks free up."""
    engine = await start_engine(small_config)
    finals: list[StepOutput] = []
    ttfts: list[float] = []

    async def stream(seed: int) -> None:
        outputs = await run(engine, token_prompt(seed, 608), max_tokens=700)
        finals.append(outputs[-1])
        ttfts.append(outputs[0].time - outputs[0].arrival_time)

    async with trio.open_nursery() as nursery:
        for seed in range(6):
            nursery.start_soon(stream, seed)
    stats = engine.scheduler.stats
    assert stats.preemptions == 6
    assert sorted(f.num_output_tokens for f in finals) == [700] * 6
    assert {f.finish_reason for f in finals} == {"length"}
    # Resumed requests are not looked up again in the counters.
    assert stats.prefix_queries == 6 * 608
    assert stats.prompt_tokens == 6 * 608
    ttfts.sort()
    assert ttfts[4] < 0.2 < 1.0 < ttfts[5]
    assert max(step[5] for step in engine.trace) == 5
    assert stats.recomputed_prefill_tokens > 0
    assert engine.pool.num_free == 99


async def test_victim_is_last_running_and_goes_to_waiting_front(
    autojump_clock: MockClock, start_engine: Start, small_config: SimConfig
) -> None:
    engine = await start_engine(small_config)
    handles = [
        engine.submit(token_prompt(s, 608), max_tokens=700, ignore_eos=True, request_id=f"r{s}")
        for s in range(5)
    ]
    while not engine.scheduler.preemption_log:
        await trio.sleep(0.001)
    _, victim = engine.scheduler.preemption_log[0]
    running_ids = [r.request_id for r in engine.scheduler.running]
    # All five prompts fit (5 x 19 of 99 blocks); decode growth then evicts the last one.
    assert victim == "r4"
    assert engine.scheduler.waiting[0].request_id == "r4"
    assert running_ids == ["r0", "r1", "r2", "r3"]
    for handle in handles:
        engine.abort(handle.request_id)


async def test_chunked_prefill_and_ttft_follow_the_formula(
    autojump_clock: MockClock, start_engine: Start
) -> None:
    config = SimConfig(**{**SMALL, "max_model_len": 4096})  # type: ignore[arg-type]
    engine = await start_engine(config)
    outputs = await run(engine, token_prompt(3, 1200), max_tokens=2)
    chunks = [(rec[3][0][1], rec[3][0][2]) for rec in engine.trace]
    assert chunks == [(512, 0), (512, 512), (176, 1024), (1, 1200)]
    ttft = outputs[0].time - outputs[0].arrival_time
    assert ttft == pytest.approx(sum(rec[1] for rec in list(engine.trace)[:3]), rel=1e-9)


async def test_time_scale_divides_wall_time(autojump_clock: MockClock, start_engine: Start) -> None:
    config = SimConfig(**{**SMALL, "time_scale": 0.1})  # type: ignore[arg-type]
    engine = await start_engine(config)
    t0 = trio.current_time()
    outputs = await run(engine, token_prompt(4, 100), max_tokens=10)
    sim_elapsed = outputs[-1].time - outputs[0].arrival_time
    assert trio.current_time() - t0 == pytest.approx(sim_elapsed * 0.1)
    assert sim_elapsed == pytest.approx(sum(rec[1] for rec in engine.trace))


async def test_abort_frees_blocks_but_keeps_full_ones_cached(
    autojump_clock: MockClock, start_engine: Start, small_config: SimConfig
) -> None:
    engine = await start_engine(small_config)
    prompt = token_prompt(5, 608)
    handle = engine.submit(prompt, max_tokens=500, ignore_eos=True, request_id="x")
    outputs = []
    async for out in handle:
        outputs.append(out)
        if len(outputs) == 3:
            assert engine.abort("x")
    assert outputs[-1].finish_reason == "abort"
    assert engine.pool.num_free == 99
    assert (await run(engine, prompt))[-1].num_cached_tokens == 576
    assert engine.recorder.finished["abort"] == 0  # live vLLM did not count it either


async def test_max_num_seqs_caps_the_batch(autojump_clock: MockClock, start_engine: Start) -> None:
    config = SimConfig(**{**SMALL, "max_num_seqs": 2})  # type: ignore[arg-type]
    engine = await start_engine(config)
    async with trio.open_nursery() as nursery:
        for seed in range(5):
            nursery.start_soon(run, engine, token_prompt(seed, 40))
    assert max(rec[5] for rec in engine.trace) == 2


async def test_long_prefill_threshold_caps_chunks(
    autojump_clock: MockClock, start_engine: Start
) -> None:
    config = SimConfig(**{**SMALL, "long_prefill_token_threshold": 100})  # type: ignore[arg-type]
    engine = await start_engine(config)
    await run(engine, token_prompt(6, 250), max_tokens=1)
    assert [rec[2] for rec in engine.trace] == [100, 100, 50]


async def test_priority_policy_admits_lowest_value_first(
    autojump_clock: MockClock, start_engine: Start
) -> None:
    config = SimConfig(**{**SMALL, "scheduling_policy": "priority", "max_num_seqs": 1})  # type: ignore[arg-type]
    engine = await start_engine(config)
    first = engine.submit(token_prompt(7, 40), max_tokens=5, ignore_eos=True, request_id="a")
    await trio.sleep(0.001)  # "a" is admitted and holds the only seat
    low = engine.submit(token_prompt(8, 40), max_tokens=5, ignore_eos=True, priority=5,
                        request_id="low")  # fmt: skip
    high = engine.submit(token_prompt(9, 40), max_tokens=5, ignore_eos=True, priority=-1,
                         request_id="high")  # fmt: skip
    order = []
    for handle in (first, low, high):
        async for out in handle:
            if out.finish_reason:
                order.append((out.time, handle.request_id))
    assert [rid for _, rid in sorted(order)] == ["a", "high", "low"]


async def test_output_length_eos_and_min_tokens(
    autojump_clock: MockClock, start_engine: Start, small_config: SimConfig
) -> None:
    engine = await start_engine(small_config)
    eos = engine.tokenizer.eos_id
    out = await run(engine, token_prompt(1, 50), max_tokens=20, ignore_eos=False, output_tokens=5)
    assert [o.finish_reason for o in out] == [None] * 4 + ["stop"]
    assert out[-1].token_ids == (eos,)
    assert out[-1].text == ""
    out = await run(engine, token_prompt(1, 50), max_tokens=4, ignore_eos=False, output_tokens=9)
    assert (len(out), out[-1].finish_reason) == (4, "length")
    out = await run(engine, token_prompt(1, 50), max_tokens=20, ignore_eos=False, output_tokens=2,
                    min_tokens=6)  # fmt: skip
    assert (len(out), out[-1].finish_reason) == (6, "stop")


async def test_generated_text_retokenizes_to_the_same_ids(
    autojump_clock: MockClock, start_engine: Start, small_config: SimConfig
) -> None:
    engine = await start_engine(small_config)
    out = await run(engine, token_prompt(1, 40), max_tokens=300, ignore_eos=True)
    ids = [t for o in out for t in o.token_ids]
    text = "".join(o.text for o in out)
    assert engine.tokenizer.encode(text) == ids


async def test_multi_turn_chat_hits_prompt_and_reply(
    autojump_clock: MockClock, start_engine: Start, small_config: SimConfig
) -> None:
    """An agent that appends the reply to its history gets the reply's blocks back."""
    engine = await start_engine(small_config)
    tok = engine.tokenizer
    messages = [{"role": "system", "content": "You are terse. " * 40},
                {"role": "user", "content": "List the files."}]  # fmt: skip
    p1 = tok.encode(tok.apply_chat_template(messages))
    out = await run(engine, p1, max_tokens=200, ignore_eos=False, output_tokens=90)
    reply = "".join(o.text for o in out)
    messages += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "Now open the first one."}]  # fmt: skip
    p2 = tok.encode(tok.apply_chat_template(messages))
    # Turn 1's tokens, EOS included, are a prefix of turn 2's.
    computed = len(p1) + 90 - 1  # the last sampled token is never computed
    assert p2[: len(p1) + 90] == p1 + [t for o in out for t in o.token_ids]
    hit = (await run(engine, p2))[-1].num_cached_tokens
    assert hit == min(computed // 32, (len(p2) - 1) // 32) * 32
    assert hit > len(p1)


async def test_kill_fails_in_flight_and_refuses_new(
    autojump_clock: MockClock, start_engine: Start, small_config: SimConfig
) -> None:
    engine = await start_engine(small_config)
    handle = engine.submit(token_prompt(1, 100), max_tokens=100, ignore_eos=True)
    await trio.sleep(0.05)
    engine.kill()
    outputs = [o async for o in handle]
    assert outputs[-1].finish_reason == "error"
    with pytest.raises(EngineDeadError):
        engine.submit(token_prompt(1, 100), max_tokens=1)
    engine.revive()
    assert (await run(engine, token_prompt(1, 100)))[-1].finish_reason == "length"


async def test_admission_limits_reject(autojump_clock: MockClock, start_engine: Start) -> None:
    config = SimConfig(**{**SMALL, "max_num_queued_reqs": 2, "max_num_seqs": 1})  # type: ignore[arg-type]
    engine = await start_engine(config)
    engine.submit(token_prompt(0, 40), max_tokens=50, ignore_eos=True)
    await trio.sleep(0.001)  # admitted: it no longer counts as queued
    for seed in range(1, 3):
        engine.submit(token_prompt(seed, 40), max_tokens=50, ignore_eos=True)
    with pytest.raises(QueueFullError):
        engine.submit(token_prompt(9, 40), max_tokens=50)
    assert engine.recorder.admission_rejections["max_num_queued_reqs"] == 1


async def test_request_too_large_for_the_pool_errors_instead_of_hanging(
    autojump_clock: MockClock, start_engine: Start
) -> None:
    config = SimConfig(**{**SMALL, "num_gpu_blocks": 5})  # type: ignore[arg-type]
    engine = await start_engine(config)
    outputs = await run(engine, token_prompt(1, 600))
    assert outputs[-1].finish_reason == "error"


async def test_jitter_is_seeded(autojump_clock: MockClock, start_engine: Start) -> None:
    durations = []
    for _ in range(2):
        config = SimConfig(**{**SMALL, "jitter": 0.2, "seed": 7})  # type: ignore[arg-type]
        engine = await start_engine(config)
        await run(engine, token_prompt(1, 100), max_tokens=20)
        durations.append([rec[1] for rec in engine.trace])
    assert durations[0] == durations[1]
    assert len(set(durations[0])) > 1


async def test_reset_forgets_cache_and_counters(
    autojump_clock: MockClock, start_engine: Start, small_config: SimConfig
) -> None:
    engine = await start_engine(small_config)
    prompt = token_prompt(1, 608)
    await run(engine, prompt)
    engine.reset()
    assert engine.scheduler.stats.prefix_queries == 0
    assert (await run(engine, prompt))[-1].num_cached_tokens == 0
