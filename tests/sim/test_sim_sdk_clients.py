"""The real client libraries against a simulator on loopback: the openai SDK (chat
completions and responses with tools) and the anthropic SDK (messages with tools), streamed
and not, including their stream accumulators, which check the event sequence strictly.

The SDKs' synchronous clients run in a worker thread so the simulator keeps the trio loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import anthropic
import openai
import pytest
import trio

from thunderproxy.sim import Simulator

from .test_sim_http import MODEL
from .test_sim_tools import ALWAYS, SHELL, check

T = TypeVar("T")
CHAT_TOOLS: Any = [{"type": "function", "function": {"name": "bash", "parameters": SHELL}}]
RESPONSE_TOOLS: Any = [{"type": "function", "name": "bash", "parameters": SHELL, "strict": False}]
ANTHROPIC_TOOLS: Any = [{"name": "bash", "description": "Run", "input_schema": SHELL}]


async def in_thread(fn: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(fn)


@pytest.fixture
def oai(sim: Simulator) -> Iterator[openai.OpenAI]:
    # Closed explicitly: an SDK client left to the garbage collector leaks its sockets.
    with openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
def claude(sim: Simulator) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=sim.url, api_key="unused", max_retries=0) as client:
        yield client


@pytest.mark.parametrize("sim", [ALWAYS], indirect=True)
async def test_openai_chat_with_tools(oai: openai.OpenAI) -> None:
    client = oai
    messages: Any = [{"role": "user", "content": "list the files"}]

    def plain() -> Any:
        return client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS)

    def streamed() -> Any:
        with client.chat.completions.stream(
            model=MODEL, messages=messages, tools=CHAT_TOOLS
        ) as stream:
            for _ in stream:
                pass
            return stream.get_final_completion()

    full = await in_thread(plain)
    call = full.choices[0].message.tool_calls[0]
    assert full.choices[0].finish_reason == "tool_calls"
    check(SHELL, json.loads(call.function.arguments))
    final = await in_thread(streamed)
    streamed_call = final.choices[0].message.tool_calls[0]
    assert streamed_call.function.name == call.function.name
    assert streamed_call.function.arguments == call.function.arguments
    assert streamed_call.id == call.id


@pytest.mark.parametrize("sim", [ALWAYS], indirect=True)
async def test_openai_responses_with_tools(oai: openai.OpenAI) -> None:
    client = oai

    def plain() -> Any:
        return client.responses.create(model=MODEL, input="run the tests", tools=RESPONSE_TOOLS)

    def streamed(previous: str) -> Any:
        output = [{"type": "function_call_output", "call_id": "c1", "output": "ok"}]
        with client.responses.stream(
            model=MODEL, input=output, tools=RESPONSE_TOOLS, previous_response_id=previous
        ) as stream:
            kinds = [event.type for event in stream]
            return kinds, stream.get_final_response()

    first = await in_thread(plain)
    call = first.output[-1]
    assert call.type == "function_call"
    check(SHELL, json.loads(call.arguments))
    assert first.usage.input_tokens > 0
    kinds, second = await in_thread(lambda: streamed(first.id))
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("sim", [ALWAYS], indirect=True)
async def test_anthropic_messages_with_tools(claude: anthropic.Anthropic) -> None:
    client = claude
    messages: Any = [{"role": "user", "content": "run the tests"}]

    def plain() -> Any:
        return client.messages.create(
            model=MODEL, max_tokens=1000, messages=messages, tools=ANTHROPIC_TOOLS
        )

    def streamed() -> Any:
        with client.messages.stream(
            model=MODEL, max_tokens=1000, messages=messages, tools=ANTHROPIC_TOOLS
        ) as stream:
            for _ in stream:
                pass
            return stream.get_final_message()

    def count() -> Any:
        return client.messages.count_tokens(model=MODEL, messages=messages, tools=ANTHROPIC_TOOLS)

    full = await in_thread(plain)
    use = full.content[-1]
    assert full.stop_reason == "tool_use"
    assert use.type == "tool_use"
    check(SHELL, use.input)
    final = await in_thread(streamed)
    assert final.stop_reason == "tool_use"
    assert final.content[-1].input == use.input
    assert final.usage.output_tokens == full.usage.output_tokens
    assert (await in_thread(count)).input_tokens == full.usage.input_tokens


async def test_an_anthropic_agent_loop_ends_with_text(claude: anthropic.Anthropic) -> None:
    """With the default knobs an agent's loop of tool calls ends in a text answer."""
    client = claude

    def loop() -> tuple[int, Any]:
        messages: list[Any] = [{"role": "user", "content": "fix the failing test"}]
        for turn in range(40):
            reply = client.messages.create(
                model=MODEL, max_tokens=2000, messages=messages, tools=ANTHROPIC_TOOLS,
                tool_choice={"type": "any"} if turn == 0 else {"type": "auto"},
            )  # fmt: skip
            if reply.stop_reason != "tool_use":
                return turn, reply
            messages.append({"role": "assistant", "content": reply.content})
            use = reply.content[-1]
            result = {"type": "tool_result", "tool_use_id": use.id, "content": "done"}
            messages.append({"role": "user", "content": [result]})
        raise AssertionError("the loop never ended")

    turns, last = await in_thread(loop)
    assert turns >= 1  # the first turn had to call a tool
    assert last.content[0].type == "text"
