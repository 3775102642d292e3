"""Agent loops written as clients write them, with the official SDKs, against the simulator on
loopback: the bytes each call sent and received are read by the taps and the recognizer. The
taps must agree with what the SDK made of the same stream, and two interleaved agents with one
system prompt must each be recognised as their own program, turn after turn, by prefix alone.

The SDKs' synchronous clients run in a worker thread so the simulator keeps the trio loop.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from types import ModuleType
from typing import Any, TypeVar

import anthropic
import httpx
import httpx2
import openai
import pytest
import trio

from thunderproxy.protocols import Protocol, SseTap, tap_for
from thunderproxy.protocols.recognition import ProgramRecognizer, Source
from thunderproxy.sim import SimConfig, Simulator, open_simulator

from ..sim.helpers import SMALL
from ..sim.test_sim_http import MODEL
from ..sim.test_sim_tools import ALWAYS, SHELL

T = TypeVar("T")
SYSTEM = "You are a coding agent. Use the bash tool to finish the task."
TASKS = ["Find the failing test.", "Count the Python files."]


class Recorder:
    """A transport that keeps every request body and the raw bytes of every response."""

    def __init__(self, http: ModuleType) -> None:
        self.inner = http.HTTPTransport()
        self.http = http
        self.sent: list[dict[str, Any]] = []
        self.received: list[list[bytes]] = []

    def handle_request(self, request: Any) -> Any:
        self.sent.append(json.loads(request.read()))
        response = self.inner.handle_request(request)
        chunks: list[bytes] = []
        self.received.append(chunks)
        upstream = response.stream

        class Recording(self.http.SyncByteStream):  # type: ignore[name-defined,misc]
            def __iter__(self) -> Iterator[bytes]:
                for chunk in upstream:
                    chunks.append(chunk)
                    yield chunk

            def close(self) -> None:
                upstream.close()

        return self.http.Response(
            response.status_code,
            headers=response.headers,
            stream=Recording(),
            extensions=response.extensions,
        )

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
async def sim() -> AsyncIterator[Simulator]:
    config = SimConfig(**{**SMALL, "time_scale": 0.01, **ALWAYS})  # type: ignore[arg-type]
    async with open_simulator(config) as simulator:
        yield simulator


async def in_thread(fn: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(fn)


def read(tap: SseTap, chunks: list[bytes]) -> SseTap:
    for chunk in chunks:
        tap.feed(chunk)
    tap.flush()
    return tap


class Loop:
    """Two agents taking turns; after each call the recognizer learns the answer."""

    def __init__(self, protocol: Protocol, recorder: Recorder) -> None:
        self.protocol = protocol
        self.recorder = recorder
        self.recognizer = ProgramRecognizer(salt=b"sim")
        self.programs: dict[int, str] = {}
        self.now = 0.0

    def check(self, agent: int, turn: int, collect: bool = True) -> SseTap:
        """Recognise the call just made, read its stream, and learn its answer."""
        self.now += 1.0
        sent, received = self.recorder.sent[-1], self.recorder.received[-1]
        found = self.recognizer.recognise(self.protocol, sent, {}, self.now)
        if turn == 0:
            assert found.source is Source.NEW
            self.programs[agent] = found.program_id
        else:
            assert (found.program_id, found.source) == (self.programs[agent], Source.PREFIX)
        tap = read(tap_for(self.protocol, collect_answer=collect), received)
        assert tap.error is None
        assert tap.content_started
        self.recognizer.observe_answer(
            found.program_id, self.protocol, sent, tap.answer(), self.now
        )
        return tap

    def done(self) -> None:
        assert len(set(self.programs.values())) == len(TASKS)


async def test_openai_chat_agents(sim: Simulator) -> None:
    recorder = Recorder(httpx)
    tools: Any = [{"type": "function", "function": {"name": "bash", "parameters": SHELL}}]
    histories: list[list[Any]] = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}] for task in TASKS
    ]
    loop = Loop(Protocol.CHAT, recorder)
    with openai.OpenAI(
        base_url=sim.url + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(transport=recorder),
    ) as client:
        for turn in range(3):
            for agent, messages in enumerate(histories):

                def call(messages: list[Any] = messages) -> Any:
                    with client.chat.completions.stream(
                        model=MODEL,
                        messages=messages,
                        tools=tools,
                        stream_options={"include_usage": True},
                    ) as stream:
                        for _ in stream:
                            pass
                        return stream.get_final_completion()

                final = await in_thread(call)
                tap = loop.check(agent, turn)
                assert tap.usage is not None
                assert tap.usage.prompt_tokens == final.usage.prompt_tokens
                assert tap.usage.completion_tokens == final.usage.completion_tokens
                message = final.choices[0].message
                calls = message.tool_calls or []
                messages.append(
                    {
                        "role": "assistant",
                        "content": message.content,
                        "tool_calls": [
                            {
                                "id": c.id,
                                "type": "function",
                                "function": {
                                    "name": c.function.name,
                                    "arguments": c.function.arguments,
                                },
                            }
                            for c in calls
                        ],
                    }
                )
                messages += [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in calls]
    loop.done()


async def test_anthropic_messages_agents(sim: Simulator) -> None:
    recorder = Recorder(httpx2)
    tools: Any = [{"name": "bash", "description": "Run a command", "input_schema": SHELL}]
    histories: list[list[Any]] = [[{"role": "user", "content": task}] for task in TASKS]
    loop = Loop(Protocol.MESSAGES, recorder)
    with anthropic.Anthropic(
        base_url=sim.url,
        api_key="unused",
        max_retries=0,
        http_client=httpx2.Client(transport=recorder),
    ) as client:
        for turn in range(3):
            for agent, messages in enumerate(histories):

                def call(messages: list[Any] = messages) -> Any:
                    with client.messages.stream(
                        model=MODEL, max_tokens=64, system=SYSTEM, messages=messages, tools=tools
                    ) as stream:
                        return stream.get_final_message()

                final = await in_thread(call)
                tap = loop.check(agent, turn)
                assert tap.usage is not None
                assert tap.usage.completion_tokens == final.usage.output_tokens
                # The SDK's own objects go back as the next turn's history, as in its docs.
                messages.append({"role": "assistant", "content": final.content})
                uses = [block for block in final.content if block.type == "tool_use"]
                results = [
                    {"type": "tool_result", "tool_use_id": b.id, "content": "ok"} for b in uses
                ]
                messages.append({"role": "user", "content": results or "go on"})
    loop.done()


async def test_openai_responses_agents_without_stored_state(sim: Simulator) -> None:
    recorder = Recorder(httpx)
    tools: Any = [{"type": "function", "name": "bash", "parameters": SHELL, "strict": False}]
    inputs: list[list[Any]] = [[{"role": "user", "content": task}] for task in TASKS]
    loop = Loop(Protocol.RESPONSES, recorder)
    with openai.OpenAI(
        base_url=sim.url + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(transport=recorder),
    ) as client:
        for turn in range(3):
            for agent, items in enumerate(inputs):

                def call(items: list[Any] = items) -> Any:
                    with client.responses.stream(
                        model=MODEL, instructions=SYSTEM, input=items, tools=tools, store=False
                    ) as stream:
                        for _ in stream:
                            pass
                        return stream.get_final_response()

                final = await in_thread(call)
                tap = loop.check(agent, turn)
                assert tap.usage is not None
                assert tap.usage.prompt_tokens == final.usage.input_tokens
                assert tap.response_id == final.id
                # The whole history goes back each turn (no previous_response_id), as stateless
                # clients do.
                items += [item.model_dump(exclude_none=True) for item in final.output]
                items += [
                    {"type": "function_call_output", "call_id": item.call_id, "output": "ok"}
                    for item in final.output
                    if item.type == "function_call"
                ]
    loop.done()
