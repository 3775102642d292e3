"""The admission stage on trio's MockClock: waiting, FIFO, returning programs first, leaving
the queue, 429 with Retry-After from the window, fallbacks that stick, settling usage."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import trio
import trio.testing

from thunderproxy.admission.service import AdmissionService, Ticket
from thunderproxy.audit import AuditLog
from thunderproxy.audit.records import AuditRecord, DecisionRecord
from thunderproxy.backends import BackendPool
from thunderproxy.config.limits import ClassSpec, LimitsSpec, ModelLimits
from thunderproxy.errors import InvalidRequest, RateLimited
from thunderproxy.gateway import Call
from thunderproxy.http.sse import OPENAI
from thunderproxy.programs import StepUsage

BIG, SMALL = "qwen-32b", "qwen-8b"


def service(
    limits: dict[str, ModelLimits],
    classes: tuple[ClassSpec, ...] | None = None,
    *,
    default_model: str = "",
) -> tuple[AdmissionService, trio.MemoryReceiveChannel[AuditRecord]]:
    send, receive = trio.open_memory_channel[AuditRecord](1000)
    pool = BackendPool(
        aliases={"coder": (BIG, SMALL), "claude-*": (BIG,)}, default_model=default_model
    )
    pool.add("http://gpu0:8000", models=[BIG])
    pool.add("http://gpu1:8000", models=[SMALL])
    spec = LimitsSpec(limits, classes or (ClassSpec("default", 1.0, max_wait_s=10.0),), "default")
    if classes:
        spec = LimitsSpec(limits, classes, classes[0].name)
    return AdmissionService(spec, pool=pool, audit=AuditLog(send, 1), instance="i0"), receive


def call(program: str, model: str = BIG, **body: Any) -> Call:
    return Call(
        program_id=program,
        endpoint="/v1/chat/completions",
        body={"model": model, "max_tokens": 10, **body},
        wire=OPENAI,
        arrived_at=trio.current_time(),
        model=model,
        context_chars=40,
    )


def decisions(
    receive: trio.MemoryReceiveChannel[AuditRecord],
) -> list[tuple[str, str, dict[str, Any]]]:
    rows = []
    while True:
        try:
            record = receive.receive_nowait()
        except trio.WouldBlock:
            return rows
        if isinstance(record, DecisionRecord):
            rows.append((record.program_id, record.action, json.loads(record.detail or "{}")))


async def test_a_call_over_rpm_waits_for_the_next_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm, rx = service({BIG: ModelLimits(rpm=1)})
    await trio.sleep(50.0 - trio.current_time())
    await adm.admit(call("a"), trio.current_time())
    await adm.admit(call("b"), trio.current_time())
    assert trio.current_time() == pytest.approx(60.0)
    actions = [(p, a) for p, a, _ in decisions(rx)]
    assert actions == [("a", "admit"), ("b", "queue"), ("b", "admit")]


@pytest.mark.parametrize(("model", "default"), [("claude-opus-4-8", ""), ("gpt-5", SMALL)])
async def test_names_nothing_serves_count_against_the_limits_of_the_model_served(
    autojump_clock: trio.testing.MockClock, model: str, default: str
) -> None:
    """A name an alias pattern or default_model sends to a served model is that model's call
    for [limits] too (else Claude Code's calls would pass every limit of the model they use)."""
    served = BIG if default == "" else default
    adm, rx = service({served: ModelLimits(rpm=1)}, default_model=default)
    await trio.sleep(50.0 - trio.current_time())
    await adm.admit(call("a", model), trio.current_time())
    await adm.admit(call("b", model), trio.current_time())
    assert trio.current_time() == pytest.approx(60.0)
    assert [(p, a) for p, a, _ in decisions(rx)] == [("a", "admit"), ("b", "queue"), ("b", "admit")]


async def test_past_its_wait_a_call_is_refused_with_retry_after_from_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm, rx = service({BIG: ModelLimits(rpd=1)})
    await adm.admit(call("a"), trio.current_time())
    with pytest.raises(RateLimited) as info:
        await adm.admit(call("b"), trio.current_time())
    assert trio.current_time() == pytest.approx(10.0)
    assert info.value.retry_after_s == pytest.approx(86_400.0 - 10.0)
    assert "rpd: 1 used of 1" in info.value.message
    rows = decisions(rx)
    assert rows[-1][1] == "reject"
    assert rows[-1][2]["dimension"] == "rpd"
    assert rows[-1][2]["instance"] == "i0"


async def test_a_class_that_may_not_wait_is_refused_on_one_check(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm, rx = service({BIG: ModelLimits(rpm=1)}, (ClassSpec("now", 1.0, max_wait_s=0.0),))
    await trio.sleep(10.0 - trio.current_time())
    await adm.admit(call("a"), trio.current_time())
    with pytest.raises(RateLimited) as info:
        await adm.admit(call("b"), trio.current_time())
    assert trio.current_time() == pytest.approx(10.0)
    assert info.value.retry_after_s == pytest.approx(50.0)
    # No queue row for a call that never waited, and nothing left in the queue.
    assert [(p, a) for p, a, _ in decisions(rx)] == [("a", "admit"), ("b", "reject")]
    assert not any(adm.queues.values())


async def test_fifo_within_a_class_and_returning_programs_go_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm, _ = service({BIG: ModelLimits(concurrent=1)})
    first = await adm.admit(call("old"), trio.current_time())
    adm.done(first, StepUsage(5, 5), 200, trio.current_time())  # "old" has run once
    holder = await adm.admit(call("holder"), trio.current_time())
    order: list[str] = []

    async def one(program: str) -> None:
        ticket = await adm.admit(call(program), trio.current_time())
        order.append(program)
        await trio.sleep(1.0)
        adm.done(ticket, StepUsage(5, 5), 200, trio.current_time())

    async with trio.open_nursery() as nursery:
        for program in ("new1", "new2", "old"):
            nursery.start_soon(one, program)
            await trio.sleep(0.1)
        await trio.sleep(1.0)
        adm.done(holder, StepUsage(5, 5), 200, trio.current_time())
    # "old" queued last but already ran: it goes ahead of the newcomer behind the head.
    assert order == ["new1", "old", "new2"]


async def test_a_waiting_caller_that_leaves_is_out_of_the_queue_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm, _ = service({BIG: ModelLimits(concurrent=1)})
    holder = await adm.admit(call("holder"), trio.current_time())
    admitted: list[str] = []

    leaver = trio.CancelScope()

    async def wait(program: str, scope: trio.CancelScope) -> None:
        with scope:
            await adm.admit(call(program), trio.current_time())
            admitted.append(program)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, "leaver", leaver)
        await trio.sleep(0.1)
        nursery.start_soon(wait, "stayer", trio.CancelScope())
        await trio.sleep(0.1)
        assert [w.program_id for w in adm.queues[(BIG, "default", None)]] == ["leaver", "stayer"]
        leaver.cancel()
        await trio.sleep(0.1)
        assert [w.program_id for w in adm.queues[(BIG, "default", None)]] == ["stayer"]
        adm.done(holder, None, 200, trio.current_time())
    assert admitted == ["stayer"]


async def test_a_program_falls_back_past_its_wait_and_stays_there(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm, rx = service({BIG: ModelLimits(concurrent=1)})
    await adm.admit(call("hog", "coder"), trio.current_time())
    ticket = await adm.admit(call("p", "coder"), trio.current_time())
    assert ticket.served == SMALL
    assert trio.current_time() == pytest.approx(10.0)
    fallback = [d for p, a, d in decisions(rx) if a == "fallback"]
    assert fallback == [
        {
            "model": BIG,
            "class": "default",
            "instance": "i0",
            "share": 1.0,
            "limits": {"concurrent": 1.0},
            "to": SMALL,
            "alias": "coder",
            "why": "wait budget spent",
        }
    ]
    adm.done(ticket, StepUsage(5, 5), 200, trio.current_time())
    # The big model has room again; the program keeps the model it was moved to.
    adm.limiter.usage(BIG, "default").concurrent = 0
    again = await adm.admit(call("p", "coder"), trio.current_time())
    assert again.served == SMALL
    newcomer = await adm.admit(call("q", "coder"), trio.current_time())
    assert newcomer.served == BIG


async def test_a_program_falls_back_when_its_backends_are_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm, rx = service({})
    node = adm.pool.get("http://gpu0:8000")
    assert node is not None
    node.health.healthy = False
    ticket = await adm.admit(call("p", "coder"), trio.current_time())
    assert ticket.served == SMALL
    assert [d["why"] for _, a, d in decisions(rx) if a == "fallback"] == ["backends down"]


async def test_settling_refunds_and_learns_the_completion_length(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm, rx = service({BIG: ModelLimits(tpm=100_000)})
    ticket = await adm.admit(call("p", max_tokens=1000), trio.current_time())
    assert isinstance(ticket, Ticket)
    assert ticket.reservation is not None
    reserved = ticket.reservation.tokens
    adm.done(ticket, StepUsage(prompt_tokens=20, completion_tokens=30), 200, trio.current_time())
    adm.done(ticket, StepUsage(prompt_tokens=20, completion_tokens=30), 200, trio.current_time())
    assert adm.limiter.usage(BIG, "default").used("tpm", trio.current_time()) == 50
    refunds = [d for _, a, d in decisions(rx) if a == "refund"]
    assert [r["tokens"] for r in refunds] == [reserved - 50]  # settled once
    assert adm.completions[BIG] == pytest.approx(256 + 0.2 * (30 - 256))


async def test_the_class_comes_from_the_body_or_the_header(
    autojump_clock: trio.testing.MockClock,
) -> None:
    classes = (ClassSpec("interactive", 0.5, flexible=False), ClassSpec("batch", 0.5))
    adm, _ = service({BIG: ModelLimits(rpm=10)}, classes)
    t1 = await adm.admit(call("a", extra_body={"program_class": "batch"}), trio.current_time())
    assert isinstance(t1, Ticket)
    assert t1.klass == "batch"
    t2 = await adm.admit(call("b"), trio.current_time())
    assert isinstance(t2, Ticket)
    assert t2.klass == "interactive"
    with pytest.raises(InvalidRequest, match="Unknown program class 'nope'; use one of"):
        await adm.admit(call("c", program_class="nope"), trio.current_time())


async def test_a_backend_limit_holds_calls_of_a_model_with_none(
    autojump_clock: trio.testing.MockClock,
) -> None:
    send, receive = trio.open_memory_channel[AuditRecord](1000)
    pool = BackendPool()
    pool.add("http://gpu0:8000", models=[BIG])
    pool.add("http://gpu1:8000", models=[BIG])
    spec = LimitsSpec(
        {},
        (ClassSpec("default", 1.0, max_wait_s=5.0),),
        "default",
        backends={"gpu0": ModelLimits(rpm=1)},
    )
    # Every program goes to gpu0 but "spare", which goes to gpu1 (no limits).
    placed = {"spare": "http://gpu1:8000"}
    adm = AdmissionService(
        spec,
        pool=pool,
        audit=AuditLog(send, 1),
        instance="i0",
        place=lambda program, model: placed.get(program, "http://gpu0:8000"),
    )
    adm.limiter.name_backend("http://gpu0:8000", "gpu0")
    await trio.sleep(50.0 - trio.current_time())
    first = await adm.admit(call("a"), trio.current_time())
    assert isinstance(first, Ticket)
    assert first.reservation is not None
    assert first.reservation.backend == "http://gpu0:8000"
    # gpu1 has no limit: a call placed there is not held by gpu0's.
    await adm.admit(call("spare"), trio.current_time())
    assert trio.current_time() == pytest.approx(50.0)
    with pytest.raises(RateLimited) as info:
        await adm.admit(call("b"), trio.current_time())
    assert trio.current_time() == pytest.approx(55.0)
    assert "rpm" in str(info.value)
    # In the next minute it fits again.
    await trio.sleep(60.0 - trio.current_time())
    await adm.admit(call("c"), trio.current_time())
    assert trio.current_time() == pytest.approx(60.0)
    rows = [(p, a, d.get("dimension")) for p, a, d in decisions(receive)]
    assert rows == [
        ("a", "admit", None),
        ("spare", "admit", None),
        ("b", "queue", "rpm"),
        ("b", "reject", "rpm"),
        ("c", "admit", None),
    ]


async def test_a_class_whose_most_is_below_one_call_is_refused_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 0.4 of 2 concurrent calls, and the only lender is fixed: this class can never run a call.
    classes = (
        ClassSpec("interactive", 0.6, flexible=False),
        ClassSpec("batch", 0.4, max_wait_s=120.0),
    )
    adm, rx = service({BIG: ModelLimits(concurrent=2)}, classes)
    start = trio.current_time()
    with pytest.raises(RateLimited) as info:
        await adm.admit(call("b", program_class="batch"), start)
    assert trio.current_time() == start  # not a moment of its 120 s wait
    message = info.value.message
    assert "Class 'batch' can never run a call of qwen-32b" in message
    assert "concurrent limit is 0.8, less than one call" in message
    assert "raise limits.models.qwen-32b.concurrent or limits.classes.batch.ratio" in message
    assert "shorter prompt" not in message
    assert [(p, a) for p, a, _ in decisions(rx)] == [("b", "reject")]


async def test_an_rpm_refusal_names_waiting_or_a_larger_limit_not_a_shorter_prompt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm, _ = service({BIG: ModelLimits(rpm=1)})
    adm.limiter.set_share(1 / 3)  # three instances share one call a minute: 1/3 each
    with pytest.raises(RateLimited) as info:
        await adm.admit(call("a"), trio.current_time())
    message = info.value.message
    assert "its part of qwen-32b's rpm limit is 0.333333" in message
    assert "(this instance's share is 1/3)" in message
    assert "shorter prompt" not in message


async def test_a_call_over_a_token_limit_is_told_to_be_smaller(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm, _ = service({BIG: ModelLimits(tpm=50)})
    with pytest.raises(RateLimited) as info:
        await adm.admit(call("a", max_tokens=1000), trio.current_time())
    assert "send a shorter prompt or a smaller max_tokens" in info.value.message
    assert "raise limits.models.qwen-32b.tpm" in info.value.message


async def test_refusals_are_logged_as_one_summary_a_minute(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="thunderproxy.admission")
    adm, _ = service({BIG: ModelLimits(rpm=1)}, (ClassSpec("now", 1.0, max_wait_s=0.0),))
    await trio.sleep(1.0)
    await adm.admit(call("a"), trio.current_time())
    refused = 0
    for i in range(50):  # three minutes of refusals, a call every 3.6 s
        try:
            await adm.admit(call(f"b{i}"), trio.current_time())
        except RateLimited:
            refused += 1
        await trio.sleep(3.6)
    await trio.sleep(60.0)
    adm.statistics(trio.current_time())  # a read (/health, /metrics) flushes the last minute
    lines = [r.getMessage() for r in caplog.records if r.name == "thunderproxy.admission"]
    # The first at once, then one a minute: not one per call.
    assert 3 <= len(lines) <= 5, lines
    assert lines[0].startswith("admission refused 1 call: 1 of qwen-32b class 'now' on rpm")
    counted = sum(int(line.split()[2]) for line in lines)
    assert counted == refused
    assert lines[1].startswith("admission refused 16 calls in the last 61 s: 16 of qwen-32b")
