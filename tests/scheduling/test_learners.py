"""The learners are pure values; the prompt sizer cannot be poisoned by ordinary traffic."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from thunderproxy.scheduling.learners import (
    CALL_TIME_WEIGHT,
    MAX_OVERHEAD_TOKENS,
    CallTime,
    CapacityFactor,
    PromptSizer,
    SharedPrefix,
    program_estimate,
)

#: A chat template adds this many tokens around the content.
TEMPLATE = 9


def test_tiny_prompts_teach_the_overhead_not_a_rate() -> None:
    sizer = PromptSizer()
    for _ in range(40):
        sizer = sizer.observe(chars=2, prompt_tokens=TEMPLATE + 1)  # "hi"
    # A 10 KB prompt: about 2,500 tokens at ~4 chars/token, never 47K.
    estimate = sizer.estimate(10_000)
    assert 2_000 < estimate < 3_000


def test_the_rate_and_the_overhead_are_fitted_apart() -> None:
    sizer = PromptSizer()
    for chars in range(100, 20_000, 500):
        sizer = sizer.observe(chars, TEMPLATE + chars // 3)
    assert abs(sizer.chars_per_token - 3.0) < 0.05
    assert abs(sizer.overhead - TEMPLATE) < 2
    assert abs(sizer.estimate(30_000) - (TEMPLATE + 10_000)) < 30


@given(
    st.lists(st.tuples(st.integers(0, 200_000), st.integers(1, 200_000)), min_size=1, max_size=80),
    st.integers(0, 1_000_000),
)
def test_no_history_makes_an_estimate_exceed_its_characters(
    history: list[tuple[int, int]], chars: int
) -> None:
    sizer = PromptSizer()
    for c, t in history:
        sizer = sizer.observe(c, t)
    assert sizer.estimate(chars) <= chars + MAX_OVERHEAD_TOKENS


def test_a_known_programs_rate_is_bounded_like_a_tokenizer() -> None:
    assert program_estimate(1_000, 0.1) == 1_000
    assert program_estimate(1_000, 100.0) == 125


def test_shared_prefix_is_the_median_of_first_call_hits() -> None:
    prefix = SharedPrefix()
    for cached in (0, 1_792, 1_792, 1_808, -5):
        prefix = prefix.observe(cached)
    assert prefix.tokens == 1_792


def test_capacity_backs_off_on_preemptions_and_recovers() -> None:
    factor = CapacityFactor().observe(10)  # first reading: nothing learned
    assert factor.factor == 1.0
    factor = factor.observe(12)
    assert factor.factor == 0.9
    factor = factor.observe(12)
    assert abs(factor.factor - 0.92) < 1e-9
    factor = factor.observe(3)  # the engine restarted: its counter reset
    assert abs(factor.factor - 0.92) < 1e-9


def test_call_time_is_a_moving_mean_of_the_backends_calls() -> None:
    assert CallTime().seconds is None
    first = CallTime().observe(2.0)
    assert first.seconds == 2.0  # the first call is all it knows
    assert first.observe(-1.0) == first  # a clock that went back teaches nothing
    second = first.observe(10.0)
    assert second.seconds == 2.0 + CALL_TIME_WEIGHT * 8.0
    steady = CallTime()
    for _ in range(500):
        steady = steady.observe(1.0)
    assert steady.seconds is not None
    assert abs(steady.seconds - 1.0) < 1e-9
