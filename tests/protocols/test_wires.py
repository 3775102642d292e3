"""Each protocol's wire in the real call gateway: usage recorded in the steps row, the answer and
the response id left for recognition, and a mid-stream failure ended in the protocol's own form."""

from __future__ import annotations

import json
from typing import Any

import trio
import trio.testing

from tests.conftest import ScriptedBackend, rig
from thunderproxy.audit import StepRecord
from thunderproxy.gateway import Call
from thunderproxy.protocols import Protocol, ProtocolWire
from thunderproxy.protocols.base import parse_event
from thunderproxy.protocols.recognition import ProgramRecognizer, Source

from .streams import MESSAGES_ANSWER, RESPONSE_USAGE, messages_events, responses_events


def call(wire: ProtocolWire, endpoint: str, body: dict[str, Any], *, stream: bool = True) -> Call:
    return Call(
        program_id="p",
        endpoint=endpoint,
        body=body,
        wire=wire,
        arrived_at=trio.current_time(),
        model="m",
        stream=stream,
        context_chars=100,
    )


MESSAGE = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Read a.py."}]}


async def test_a_messages_stream_through_the_gateway() -> None:
    events = messages_events()
    r = rig(ScriptedBackend(chunks=events))
    wire = ProtocolWire(Protocol.MESSAGES, collect_answer=True)
    async with r.gateway.call(call(wire, "/v1/messages", MESSAGE)) as exchange:
        relayed = b"".join([chunk async for chunk in exchange.stream()])
    assert relayed == b"".join(events)
    (step,) = r.records(StepRecord)
    assert (step.status, step.prompt_tokens, step.completion_tokens, step.cached_tokens) == (
        200,
        124,
        15,
        100,
    )
    assert wire.last_tap is not None
    assert wire.last_tap.answer() == MESSAGES_ANSWER


async def test_a_responses_stream_leaves_its_id_for_the_next_call() -> None:
    r = rig(ScriptedBackend(chunks=responses_events()))
    wire = ProtocolWire(Protocol.RESPONSES)
    body = {"model": "m", "input": "Read a.py.", "stream": True}
    async with r.gateway.call(call(wire, "/v1/responses", body)) as exchange:
        async for _ in exchange.stream():
            pass
    (step,) = r.records(StepRecord)
    assert step.prompt_tokens == RESPONSE_USAGE["input_tokens"]
    assert wire.last_tap is not None
    recognizer = ProgramRecognizer()
    recognizer.remember_response(wire.last_tap.response_id, "p", now=0.0)
    follow = {"input": "go on", "previous_response_id": "resp_1"}
    found = recognizer.recognise(Protocol.RESPONSES, follow, {}, now=1.0)
    assert (found.program_id, found.source) == ("p", Source.PREVIOUS_RESPONSE)


async def test_a_non_streamed_message_has_its_usage_read() -> None:
    body = {"id": "msg_1", "content": [], "usage": {"input_tokens": 9, "output_tokens": 3}}
    r = rig(ScriptedBackend(chunks=[json.dumps(body).encode()]))
    wire = ProtocolWire(Protocol.MESSAGES)
    async with r.gateway.call(call(wire, "/v1/messages", MESSAGE, stream=False)) as exchange:
        await exchange.read()
    (step,) = r.records(StepRecord)
    assert (step.prompt_tokens, step.completion_tokens) == (9, 3)


async def test_silence_mid_messages_stream_ends_in_anthropics_error_event(
    autojump_clock: trio.testing.MockClock,
) -> None:
    first = messages_events()[0]
    r = rig(ScriptedBackend(chunks=[first, 1000.0]), read_timeout=30.0)
    wire = ProtocolWire(Protocol.MESSAGES)
    async with r.gateway.call(call(wire, "/v1/messages", MESSAGE)) as exchange:
        chunks = [chunk async for chunk in exchange.stream()]
    event = parse_event(chunks[-1].rstrip(b"\n"))
    assert event.name == "error"
    payload = json.loads(event.data)
    assert payload["type"] == "error"
    assert payload["error"]["type"] == "api_error"  # a timeout, as Anthropic's SDKs know it
    (step,) = r.records(StepRecord)
    assert step.status == 504
