"""Latency classes: how a call's class is resolved (the class it names, a recognised
interactive client, its program's class, the default), and what tr does with it: an
interactive call is never held past its own bound, and room for it is made from batch
programs first. On trio's MockClock; no sleeps."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from tests.conftest import ScriptedBackend, rig
from thunderproxy.audit import StepRecord
from thunderproxy.gateway import Call
from thunderproxy.http.sse import OPENAI
from thunderproxy.programs import ProgramStatus, StepUsage
from thunderproxy.scheduling.classes import BATCH, INTERACTIVE, named_class, resolve
from thunderproxy.scheduling.tr import PolicyConfig

from .test_scheduler import B0, CFG, Harness, begin, end, harness, open_harness, snapshot

__all__ = ["harness"]  # the fixture, shared with the scheduler's tests

# -- resolution -----------------------------------------------------------------------------


def test_the_class_a_call_names_is_read_from_its_body_then_extra_body_then_header() -> None:
    header = [("X-Program-Class", "interactive")]
    assert named_class({}, header) == "interactive"
    assert named_class({"program_class": "batch"}, header) == "batch"
    assert named_class({"extra_body": {"program_class": "batch"}}, header) == "batch"
    assert named_class({"program_class": ""}, []) is None


@pytest.mark.parametrize(
    ("named", "source", "current", "default", "expected"),
    [
        pytest.param("interactive", None, None, BATCH, INTERACTIVE, id="named"),
        pytest.param("batch", "claude_code", INTERACTIVE, BATCH, BATCH, id="named-beats-client"),
        pytest.param(None, "claude_code", None, BATCH, INTERACTIVE, id="claude-code"),
        pytest.param(None, "codex", None, BATCH, INTERACTIVE, id="codex"),
        pytest.param(None, "edited_prefix", BATCH, BATCH, INTERACTIVE, id="aider"),
        pytest.param(None, "prefix", INTERACTIVE, BATCH, INTERACTIVE, id="program-keeps-it"),
        pytest.param(None, "explicit", None, INTERACTIVE, INTERACTIVE, id="default-class"),
        pytest.param(None, "explicit", None, BATCH, BATCH, id="default-batch"),
        # A [limits] class of another name says nothing about latency.
        pytest.param("gold", "session_header", None, BATCH, BATCH, id="limits-class"),
    ],
)
def test_a_calls_class_is_named_then_recognised_then_its_programs_then_the_default(
    named: str | None, source: str | None, current: str | None, default: str, expected: str
) -> None:
    assert resolve(named, source, current, default) == expected


def _call(program: str, *, body: dict[str, Any] | None = None, **more: Any) -> Call:
    return Call(
        program_id=program,
        endpoint="/v1/chat/completions",
        body={"model": "m", "messages": [], "stream": True, **(body or {})},
        wire=OPENAI,
        arrived_at=trio.current_time(),
        model="m",
        stream=True,
        context_chars=400,
        **more,
    )


@pytest.mark.parametrize(
    ("call", "default", "expected"),
    [
        pytest.param(
            partial(_call, "h", headers=[("X-Program-Class", "interactive")]),
            BATCH,
            INTERACTIVE,
            id="header",
        ),
        pytest.param(
            partial(_call, "b", body={"extra_body": {"program_class": "interactive"}}),
            BATCH,
            INTERACTIVE,
            id="extra-body",
        ),
        pytest.param(partial(_call, "c", source="claude_code"), BATCH, INTERACTIVE, id="claude"),
        pytest.param(partial(_call, "x", source="codex"), BATCH, INTERACTIVE, id="codex"),
        pytest.param(partial(_call, "n", source="explicit"), BATCH, BATCH, id="default-batch"),
        pytest.param(
            partial(_call, "d", source="new"), INTERACTIVE, INTERACTIVE, id="default-interactive"
        ),
        pytest.param(
            partial(_call, "r", headers=[("x-program-class", "batch")], source="claude_code"),
            INTERACTIVE,
            BATCH,
            id="header-names-batch",
        ),
    ],
)
async def test_the_gateway_resolves_each_calls_class_and_records_it_on_its_step(
    call: Any, default: str, expected: str
) -> None:
    r = rig(ScriptedBackend())
    r.gateway.scheduler.policy.config = PolicyConfig(default_program_class=default)
    async with r.gateway.call(call()) as exchange:
        await exchange.read()
    (step,) = r.records(StepRecord)
    assert step.program_class == expected
    program = r.gateway.scheduler.registry.get(step.program_id)
    assert program.program_class == expected


async def test_an_aider_program_becomes_interactive_once_a_call_shows_it() -> None:
    # aider's first call carries nothing of its own (source "new"); its second is tied to the
    # first by the edited turn only aider makes (edited_prefix). A later plain continuation
    # keeps the class.
    r = rig(ScriptedBackend())
    for source in ("new", "edited_prefix", "prefix"):
        async with r.gateway.call(_call("aider", source=source)) as exchange:
            await exchange.read()
    classes = [s.program_class for s in r.records(StepRecord)]
    assert classes == [BATCH, INTERACTIVE, INTERACTIVE]


# -- the scheduler rule ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("klass", "bound"),
    [
        pytest.param(INTERACTIVE, CFG.interactive_max_wait_s, id="interactive"),
        pytest.param(BATCH, CFG.max_wait_s, id="batch"),
        pytest.param(None, CFG.max_wait_s, id="default"),
    ],
)
async def test_a_call_is_held_at_most_its_classs_bound(
    harness: Harness, autojump_clock: trio.testing.MockClock, klass: str | None, bound: float
) -> None:
    # The hog was force-resumed (protected), so no room can be made, and the cache shrank
    # under the late program's last call: only the bound ends its next call's wait, kept by
    # the request's own deadline (no resume monitor runs here).
    sched = harness.scheduler
    first = await sched.lease(
        "late", sched.pool.route(None), arrived_at=0.0, context_chars=2_000, program_class=klass
    )
    end(sched, first, 200, StepUsage(450, 50, 0))
    await harness.step("hog", 9_400)
    sched.registry.get("hog").protected_until = 1e9
    harness.pool.get(B0).snapshot = snapshot(9_600)  # type: ignore[union-attr]
    start = trio.current_time()
    lease = await sched.lease(
        "late", sched.pool.route(None), arrived_at=start, context_chars=20_000
    )
    assert lease.sent_at - start == pytest.approx(bound)
    assert CFG.interactive_max_wait_s < CFG.max_wait_s
    assert ("force_resume", "late", "max_wait") in harness.decisions()


async def test_room_for_an_interactive_call_is_made_from_batch_programs_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Two idle programs fill most of the cache: an interactive one whose tool has run longer
    # (so that without classes it would be the first paused) and a batch one. A new interactive
    # program's call that does not fit goes out at once (not at half a bound, not after the
    # pause cooldown a round just started) by pausing the batch program, and the idle
    # interactive program keeps its cache.
    async with open_harness(replace(CFG, pause_cooldown_s=5.0)) as held:
        sched = held.scheduler
        route = sched.pool.route(None)
        idle = await sched.lease(
            "person-idle", route, arrived_at=0.0, context_chars=16_000, program_class=INTERACTIVE
        )
        end(sched, idle, 200, StepUsage(3_900, 100, 0))
        await trio.sleep(10)
        await held.step("batch-idle", 4_000)
        sched.schedule_of("http://b0").last_pause_at = trio.current_time()  # a round just ran
        held.records()
        start = trio.current_time()
        lease = await sched.lease(
            "person", route, arrived_at=start, context_chars=12_000, program_class=INTERACTIVE
        )
        assert lease.sent_at == start
        decisions = held.decisions()
        assert ("queue", "person", "capacity_full") in decisions
        assert ("pause", "batch-idle", "make_room") in decisions
        assert sched.registry.get("person-idle").status is ProgramStatus.ACTING
        assert not [d for d in decisions if d[1] == "person-idle"]


async def test_a_waiting_interactive_call_goes_before_waiting_batch_calls(
    harness: Harness, autojump_clock: trio.testing.MockClock
) -> None:
    # A batch program has waited 8 s (of its 20 s bound) when an interactive call arrives;
    # when room frees for one of them, the interactive call takes it, and the batch call
    # keeps waiting.
    sched = harness.scheduler
    route = sched.pool.route(None)
    hog = await begin(sched, "hog", arrived_at=0.0, context_chars=36_000)
    sent: list[str] = []

    async def call(program: str, klass: str) -> None:
        lease = await sched.lease(
            program, route, arrived_at=trio.current_time(), context_chars=24_000,
            program_class=klass,
        )  # fmt: skip
        sent.append(program)
        await trio.sleep(30)
        end(sched, lease, 200, StepUsage(5_900, 100, 0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, "batch", BATCH)
        await trio.sleep(8)
        nursery.start_soon(call, "person", INTERACTIVE)
        await trio.sleep(1)
        assert sent == []
        end(sched, hog, 200, StepUsage(8_900, 100, 0))
        sched.release("hog")
        await trio.sleep(1)
        assert sent == ["person"]
        assert sched.registry.get("batch").status is ProgramStatus.PAUSED
