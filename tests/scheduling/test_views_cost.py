"""What tr's views cost a call, and that the shortcut which avoids building them decides as the
views would.

A call that changes nothing (no program paused, every backend within its bound) is answered
from the registry's index: its cost is that of the calls in flight, not of the programs tracked.
The bound it is answered with (``ViewSource.used_bound``) must be at least what the policy sums,
whatever the programs' states, the configuration and the time, or a decision would change.
"""

from __future__ import annotations

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.scheduling.test_scheduler import B0, B1, begin, end, open_harness
from thunderproxy.backends import BackendPool
from thunderproxy.programs import ProgramRegistry, StepUsage
from thunderproxy.scheduling import TrPolicy
from thunderproxy.scheduling.policies import Views
from thunderproxy.scheduling.tr import BackendView, PolicyConfig, used_tokens
from thunderproxy.scheduling.views import ViewSource


async def _views_per_call(programs: int, capacity: int) -> tuple[float, int]:
    """ProgramViews built per returning call, with ``programs`` programs called in turn (each
    called once before), and how many programs ended paused."""
    async with open_harness(PolicyConfig(), capacity=capacity) as harness:
        scheduler = harness.scheduler

        async def call(k: int) -> None:
            now = trio.current_time()
            lease = await begin(scheduler, f"p{k}", arrived_at=now, context_chars=4_000)
            end(scheduler, lease, 200, StepUsage(1_000, 30, 900))

        for k in range(programs):
            await call(k)
        before = scheduler.source.programs_viewed
        for _ in range(3):
            for k in range(programs):
                await call(k)
        built = scheduler.source.programs_viewed - before
        paused = sum(p.status == "paused" for p in scheduler.registry)
        return built / (3 * programs), paused


async def test_a_call_that_changes_nothing_builds_only_its_own_view() -> None:
    # Before the shortcut each call built every program's view three times (the return gate,
    # the lease's rebalance, the close's), 96 at 32 programs: the cost grew with them.
    for programs in (8, 64):
        per_call, paused = await _views_per_call(programs, capacity=16_000_000)
        assert paused == 0
        # The return gate's view of the returning program itself, and nothing else.
        assert per_call == 1, (programs, per_call)


# -- the bound against the sum, over arbitrary states -------------------------------------------

KINDS = ("reasoning", "acting", "paused", "marked", "waiting_acting", "waiting_paused")

program_states = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.sampled_from((B0, B1)),
        st.integers(0, 50_000),  # tokens
        st.one_of(st.floats(0.0, 10.0), st.floats(0.0, 200.0)),  # idle since (seconds)
        st.one_of(st.none(), st.floats(0.0, 300.0)),  # its last tool's time
    ),
    max_size=14,
)
configs = st.builds(
    PolicyConfig,
    decode_buffer=st.integers(0, 2_000),
    tool_coefficient=st.floats(0.0, 2.0),
    acting_half_life_s=st.sampled_from((0.0, 1.0, 5.0, 60.0)),
    idle_claims=st.sampled_from(("decay", "break_even")),
    pause_cooldown_s=st.sampled_from((0.0, 5.0)),
)
backend_views = st.builds(
    BackendView,
    url=st.sampled_from((B0, B1)),
    healthy=st.booleans(),
    capacity_tokens=st.one_of(st.none(), st.integers(0, 60_000), st.integers(0, 200_000)),
    shared_prefix_tokens=st.integers(0, 5_000),
    capacity_factor=st.floats(0.5, 1.0),
    last_pause_at=st.one_of(st.none(), st.floats(990.0, 1_000.0)),  # cooling or not
    hold=st.booleans(),
    prefill_s_per_token=st.one_of(st.none(), st.floats(1e-6, 1e-3)),
)


def _registry(
    states: list[tuple[str, str, int, float, float | None]], now: float
) -> ProgramRegistry:
    registry = ProgramRegistry()
    for k, (kind, url, tokens, idle, tool_s) in enumerate(states):
        ended_at = now - idle - 2.0
        program, _ = registry.get_or_create(f"p{k}", 0.0)
        registry.assign(program, url)
        registry.set_tokens(program, tokens)
        program.last_tool_s = tool_s
        if kind == "marked":
            program.marked_for_pause = True  # as the scheduler marks a reasoning program
            continue
        if kind == "reasoning":
            continue
        registry.end_step(program, ended_at, StepUsage(tokens, 0), reason="response complete")
        if kind in ("paused", "waiting_paused"):
            registry.pause(program, ended_at + 1.0, reason="paused: test")
        if kind.startswith("waiting"):
            registry.set_waiting(program, ended_at + 2.0)
    return registry


@settings(max_examples=500, deadline=None)
@given(
    program_states,
    configs,
    st.lists(backend_views, min_size=1, max_size=2, unique_by=lambda b: b.url),
    st.booleans(),
    st.booleans(),
)
def test_the_bound_is_at_least_the_sum_and_decisions_do_not_change(
    states: list[tuple[str, str, int, float, float | None]],
    cfg: PolicyConfig,
    backends: list[BackendView],
    silence: bool,
    pausing: bool,
) -> None:
    if not pausing:  # nothing paused: where the shortcut may answer a rebalance
        states = [(k.replace("paused", "acting"), *rest) for k, *rest in states]
    now = 1_000.0
    registry = _registry(states, now)
    if silence:
        registry.presume_ended(now)  # the long idle ones count as ended
    source = ViewSource(registry, BackendPool(), cfg)
    programs = source.views(now).programs
    for b in backends:
        bound = source.used_bound(b)
        assert bound >= used_tokens(b, programs, cfg, now)
        for p in programs:
            if p.status == "reasoning" and not p.marked:
                continue  # the bound counts their shared prefix: it holds with them all in
            others = [q for q in programs if q.program_id != p.program_id]
            assert bound >= used_tokens(b, others, cfg, now)
    policy = TrPolicy(cfg)
    plain = Views(lambda: programs, lambda: backends)
    bounded = Views(
        lambda: programs, lambda: backends, bound=source.used_bound, paused=source.paused
    )
    assert policy.rebalance(bounded, now) == policy.rebalance(plain, now)
    urls = {b.url for b in backends}
    for p in programs:
        if p.status == "acting" and p.backend in urls:
            fast, full = policy.on_return(p, bounded, now), policy.on_return(p, plain, now)
            assert fast is not None
            assert full is not None
            assert (fast.action, fast.rule, fast.program_tokens) == (
                full.action,
                full.rule,
                full.program_tokens,
            )


# -- first calls beside many programs that ran one call -----------------------------------------


def _one_call_programs(registry: ProgramRegistry, count: int, now: float) -> None:
    """``count`` programs that each ran one call on B0 and ended it at ``now``, as plain SDK
    traffic without a program id leaves them (every call a new program)."""
    for k in range(count):
        program, _ = registry.get_or_create(f"auto-{k}", now)
        registry.assign(program, B0)
        registry.begin_step(program, now, context_chars=4_000, arrived_at=now)
        registry.end_step(program, now, StepUsage(1_000, 30, 900), reason="response complete")


async def _views_per_first_call(cfg: PolicyConfig, registered: int) -> tuple[float, list[str]]:
    """ProgramViews built per new program's call (its lease and its close), with
    ``registered`` one-call programs on the backend, and the admissions' rules."""
    async with open_harness(cfg, capacity=16_000_000) as harness:
        scheduler = harness.scheduler
        _one_call_programs(scheduler.registry, registered, trio.current_time())
        await trio.sleep(5)  # idle for a while, within any keep horizon: they still claim
        harness.records()
        before = scheduler.source.programs_viewed
        calls = 20
        for k in range(calls):
            lease = await begin(
                scheduler, f"new-{k}", arrived_at=trio.current_time(), context_chars=4_000
            )
            end(scheduler, lease, 200, StepUsage(1_000, 30, 900))
            await trio.sleep(0.1)
        built = scheduler.source.programs_viewed - before
        rules = [rule for action, _, rule in harness.decisions() if action == "admit"]
        return built / calls, rules


async def test_programs_that_ran_one_call_cost_a_newcomer_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Before, every first call summed every program still claiming KV (all of them, within
    # the keep horizon): 10,000 views per admission, and a tr proxy in front of plain SDK
    # traffic slowed with every call it had served in the last two minutes.
    for registered in (0, 10_000):
        # Nobody came back yet: tr does not hold (few_returns), and decides without the sum.
        per_call, rules = await _views_per_first_call(PolicyConfig(), registered)
        assert per_call == 0, (registered, per_call)
        assert set(rules) == {"few_returns"}, rules
        # Holding, where the bound from the calls in flight shows that the newcomer fits.
        per_call, rules = await _views_per_first_call(PolicyConfig(hold="always"), registered)
        assert per_call == 0, (registered, per_call)
        assert set(rules) == {"fits"}, rules


async def test_a_newcomer_that_the_bound_does_not_show_fitting_is_decided_from_the_sum(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 10,000 programs of 1,000 tokens on a 5M cache: the bound (all of them whole) does not
    # fit, the decayed claims summed do; the sum decides, and admits.
    cfg = PolicyConfig(hold="always", idle_claims="decay")
    async with open_harness(cfg, capacity=5_000_000) as harness:
        scheduler = harness.scheduler
        _one_call_programs(scheduler.registry, 10_000, trio.current_time())
        await trio.sleep(200)
        harness.records()
        before = scheduler.source.programs_viewed
        lease = await begin(scheduler, "new", arrived_at=trio.current_time(), context_chars=4_000)
        assert scheduler.source.programs_viewed > before
        assert [r for a, _, r in harness.decisions() if a == "admit"] == ["fits"]
        end(scheduler, lease, 200, StepUsage(1_000, 30, 900))
