"""The call gateway on trio's MockClock, over an in-process backend whose answers each test
scripts: every way a call can end is recorded exactly once, with the status that happened, and
reaches the backend's health."""

from __future__ import annotations

import json
import logging

import pytest
import trio
import trio.testing

from tests.conftest import EVENTS, URL, ScriptedBackend, rig
from thunderproxy.audit import StepRecord
from thunderproxy.audit.records import RejectionRecord
from thunderproxy.errors import (
    BackendTimeout,
    BackendUnavailable,
    ModelNotFound,
)
from thunderproxy.gateway import Call
from thunderproxy.http.sse import OPENAI


def call(model: str = "m", *, stream: bool = True) -> Call:
    return Call(
        program_id="p",
        endpoint="/v1/chat/completions",
        body={"model": model, "messages": [], "stream": stream},
        wire=OPENAI,
        arrived_at=trio.current_time(),
        model=model,
        stream=stream,
        context_chars=400,
    )


async def test_a_streamed_call_is_relayed_and_recorded_once_with_its_usage() -> None:
    r = rig(ScriptedBackend())
    async with r.gateway.call(call()) as exchange:
        assert exchange.is_event_stream
        relayed = b"".join([chunk async for chunk in exchange.stream()])
    assert relayed == b"".join(EVENTS)
    (step,) = r.records(StepRecord)
    assert (step.status, step.prompt_tokens, step.cached_tokens) == (200, 30, 16)
    assert step.first_token_at is not None
    assert r.gateway.scheduler.registry.get("p").in_flight == 0
    assert r.node.in_flight == 0
    sent = r.backend.sent[0]
    assert ("x-request-id", "p-1") in sent.headers


async def test_an_alias_is_sent_as_the_served_name() -> None:
    r = rig(ScriptedBackend())
    async with r.gateway.call(call("coder")) as exchange:
        await exchange.read()
    assert json.loads(r.backend.sent[0].content)["model"] == "served-coder"
    (step,) = r.records(StepRecord)
    assert step.model == "coder"  # the name the client asked for


async def test_an_unknown_model_is_a_rejection_not_a_step() -> None:
    r = rig(ScriptedBackend())
    with pytest.raises(ModelNotFound):
        await r.gateway.open(call("nope"))
    records = r.records(object)
    assert [type(x) for x in records] == [RejectionRecord]
    assert records[0].status == 404
    assert r.backend.sent == []
    assert "p" not in r.gateway.scheduler.registry


async def test_a_refused_connection_takes_the_backend_down_and_is_a_502_step() -> None:
    r = rig(ScriptedBackend(error=BackendUnavailable("refused", backend=URL)))
    with pytest.raises(BackendUnavailable):
        await r.gateway.open(call())
    (step,) = r.records(StepRecord)
    assert step.status == 502
    assert not r.node.healthy


async def test_no_first_byte_within_the_timeout_is_a_504(
    autojump_clock: trio.testing.MockClock,
) -> None:
    r = rig(ScriptedBackend(delay=100.0), first_byte_timeout=10.0)
    with pytest.raises(BackendTimeout):
        await r.gateway.open(call())
    (step,) = r.records(StepRecord)
    assert step.status == 504
    assert r.node.healthy  # one slow answer does not take a backend out
    assert r.node.health.failures == 1


async def test_silence_mid_stream_ends_it_with_an_error_event_and_a_504(
    autojump_clock: trio.testing.MockClock,
) -> None:
    r = rig(ScriptedBackend(chunks=[EVENTS[0], 1000.0, EVENTS[2]]), read_timeout=30.0)
    async with r.gateway.call(call()) as exchange:
        chunks = [chunk async for chunk in exchange.stream()]
    assert chunks[0] == EVENTS[0]
    error = json.loads(chunks[-1].split(b"\n\n")[0][len(b"data: ") :])["error"]
    assert error["code"] == 504
    (step,) = r.records(StepRecord)
    assert step.status == 504


@pytest.mark.parametrize(("stopping", "status"), [(False, 499), (True, 503)])
async def test_a_call_cut_before_its_end_is_the_client_or_the_proxy(
    stopping: bool, status: int
) -> None:
    r = rig(ScriptedBackend())
    r.gateway.stopping = stopping
    exchange = await r.gateway.open(call())
    stream = exchange.stream()
    await stream.__anext__()
    await stream.aclose()  # the connection ended with the body half sent
    await exchange.aclose()
    await exchange.aclose()  # and a second close changes nothing
    (step,) = r.records(StepRecord)
    assert step.status == status
    assert r.backend.responses[0].closed
    assert r.gateway.scheduler.registry.get("p").in_flight == 0


async def test_a_client_that_leaves_on_the_end_event_was_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The backend sends [DONE] but keeps the connection open a while: the OpenAI SDK stops
    # reading at [DONE] and closes, which must not turn a complete answer into a 499.
    r = rig(ScriptedBackend(chunks=[*EVENTS, 5.0]))
    exchange = await r.gateway.open(call())
    stream = exchange.stream()
    async for chunk in stream:
        if b"[DONE]" in chunk:
            break
    await stream.aclose()
    await exchange.aclose()
    (step,) = r.records(StepRecord)
    assert (step.status, step.completion_tokens) == (200, 2)


@pytest.mark.parametrize(
    ("pieces", "relayed"),
    [
        # The stream stopped mid-event, its last bytes in pieces shorter than a boundary: the
        # partial event was held (a client cannot read it), so it is not relayed at all.
        ([b'data: {"a', b"b", b"c", b"\n"], b""),
        # It stopped at an event's end, the blank line itself split over short pieces.
        ([b'data: {"a": 1}', b"\n", b"\n"], b'data: {"a": 1}\n\n'),
        ([b'data: {"a": 1}\r\n', b"\r", b"\n"], b'data: {"a": 1}\r\n\r\n'),
        ([b'data: {"a": 1}\n\n'], b'data: {"a": 1}\n\n'),
    ],
)
async def test_an_error_event_starts_an_event_of_its_own_after_short_pieces(
    autojump_clock: trio.testing.MockClock, pieces: list[bytes], relayed: bytes
) -> None:
    r = rig(ScriptedBackend(chunks=[EVENTS[0], *pieces, 1000.0]), read_timeout=30.0)
    async with r.gateway.call(call()) as exchange:
        chunks = [chunk async for chunk in exchange.stream()]
    assert b"".join(chunks[:-1]) == EVENTS[0] + relayed
    assert chunks[-1].startswith(b"data: ")


async def test_bytes_after_a_whole_answer_go_out_as_they_came_when_the_connection_is_lost(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # [DONE] passed, then the start of an event that never ends, then silence past the read
    # timeout: the answer was whole, so the lost connection is no fault, and the trailing bytes
    # the tap held (a partial event) are relayed as they came, as at a clean end.
    caplog.set_level(logging.INFO, logger="thunderproxy.gateway")
    trailing = b'data: {"never": "ended'
    r = rig(ScriptedBackend(chunks=[*EVENTS, trailing, 1000.0]), read_timeout=30.0)
    async with r.gateway.call(call()) as exchange:
        relayed = b"".join([chunk async for chunk in exchange.stream()])
    assert relayed == b"".join(EVENTS) + trailing
    (step,) = r.records(StepRecord)
    assert (step.status, step.error) == (200, None)
    assert not [rec for rec in caplog.records if rec.name == "thunderproxy.gateway"]


async def test_a_call_cut_mid_answer_is_one_warning_naming_backend_program_and_bytes(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="thunderproxy.gateway")
    r = rig(ScriptedBackend(chunks=[EVENTS[0], 1000.0, EVENTS[2]]), read_timeout=30.0)
    async with r.gateway.call(call()) as exchange:
        chunks = [chunk async for chunk in exchange.stream()]
    assert chunks[0] == EVENTS[0]
    (line,) = [rec for rec in caplog.records if rec.name == "thunderproxy.gateway"]
    assert line.levelno == logging.WARNING
    assert line.getMessage().startswith(
        f"backend {r.node.url} cut call p-1 (program p) mid-answer after "
        f"{len(EVENTS[0])} bytes relayed: Backend {r.node.url} did not answer in time"
    )


async def test_a_whole_answer_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="thunderproxy.gateway")
    r = rig(ScriptedBackend())
    async with r.gateway.call(call()) as exchange:
        assert [chunk async for chunk in exchange.stream()]
    assert not [rec for rec in caplog.records if rec.name == "thunderproxy.gateway"]


async def test_an_answer_its_backend_ends_with_an_error_event_is_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="thunderproxy.gateway")
    failed = b'data: {"error": {"message": "engine died", "code": 500}}\n\n'
    r = rig(ScriptedBackend(chunks=[EVENTS[0], failed, EVENTS[2]]))
    async with r.gateway.call(call()) as exchange:
        assert [chunk async for chunk in exchange.stream()]
    (line,) = [rec for rec in caplog.records if rec.name == "thunderproxy.gateway"]
    assert line.levelno == logging.WARNING
    assert line.getMessage() == (
        f"backend {r.node.url} ended call p-1 (program p) with an error after "
        f"{len(EVENTS[0]) + len(failed)} bytes relayed: engine died"
    )
    (step,) = r.records(StepRecord)
    assert (step.status, step.error) == (200, "engine died")


# --- what the log tells of refusals: a line per cause a minute, never one per call -------------


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        rec.getMessage()
        for rec in caplog.records
        if rec.name == "thunderproxy.gateway" and rec.levelno == logging.WARNING
    ]


async def test_unknown_models_are_one_warning_a_minute_naming_what_was_asked(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="thunderproxy.gateway")
    r = rig(ScriptedBackend())
    for model in ["claude-opus-4-8"] * 5 + ["gpt-9"] * 3:
        with pytest.raises(ModelNotFound):
            await r.gateway.open(call(model))
        await trio.sleep(1.0)
    first = warnings_of(caplog)
    assert first == [
        "refused 1 call for models no backend serves: 'claude-opus-4-8' x1 (served: "
        "m, served-coder, coder); ask for a served model, or send other names to one with "
        "--default-model or an [aliases] pattern"
    ]
    await trio.sleep(60.0)
    with pytest.raises(ModelNotFound):
        await r.gateway.open(call("gpt-9"))
    (second,) = warnings_of(caplog)[1:]
    assert second.startswith(
        "refused 8 calls in the last 68 s for models no backend serves: 'claude-opus-4-8' x4, "
        "'gpt-9' x4 (served:"
    )
    assert len(r.records(RejectionRecord)) == 9  # each refusal is still a row


async def test_a_backends_4xx_is_one_warning_per_message_a_minute(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="thunderproxy.gateway")

    def refusing(message: str) -> list[bytes | float]:
        return [json.dumps({"error": {"message": message, "code": 400}}).encode()]

    backend = ScriptedBackend(status=400, chunks=refusing("`tools` must not be an empty array"))
    r = rig(backend)
    for _ in range(6):
        async with r.gateway.call(call(stream=False)) as exchange:
            await exchange.read()
        await trio.sleep(1.0)
    # Another message is another cause; one that differs only in its numbers is not.
    for tokens in (140_000, 150_000):
        backend.chunks = refusing(
            f"This model's maximum context length is 131072; you asked {tokens}"
        )
        async with r.gateway.call(call(stream=False)) as exchange:
            await exchange.read()
    assert warnings_of(caplog) == [
        f"backend {URL} answered 400 to 1 call: `tools` must not be an empty array",
        f"backend {URL} answered 400 to 1 call: This model's maximum context length is 131072; "
        "you asked 140000",
    ]
    await trio.sleep(60.0)
    async with r.gateway.call(call(stream=False)) as exchange:
        await exchange.read()
    assert warnings_of(caplog)[2:] == [
        f"backend {URL} answered 400 to 2 calls in the last 60 s: This model's maximum context "
        "length is 131072; you asked 150000"
    ]
    assert [s.status for s in r.records(StepRecord)] == [400] * 9
