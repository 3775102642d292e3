"""`/v1/messages` and `/v1/messages/count_tokens` over loopback: shapes, tool use, errors,
and the prefix cache shared with chat completions (vLLM serves both through chat)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from .helpers import parse_metrics
from .test_sim_http import MODEL
from .test_sim_tools import ALWAYS, SHELL, check

TOOLS = [{"name": "bash", "description": "Run a command", "input_schema": SHELL}]
NEVER = {"tool_call_probability": 0.0, "tool_call_after_result_probability": 0.0}


def body(content: Any = "hello there", **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


async def events(client: httpx.AsyncClient, payload: dict[str, Any]) -> list[tuple[str, Any]]:
    """(event name, data) pairs of a named-event SSE stream."""
    out: list[tuple[str, Any]] = []
    name = None
    async with client.stream("POST", "/v1/messages", json=payload) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                out.append((name or "", json.loads(line[len("data: ") :])))
                name = None
    return out


@pytest.mark.parametrize("sim", [NEVER], indirect=True)
async def test_text_message_shapes(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/messages", json=body(system=[{"type": "text", "text": "Be brief"}]))
    assert r.status_code == 200
    msg = r.json()
    assert list(msg) == ["id", "type", "role", "content", "model", "stop_reason", "usage"]
    assert (msg["type"], msg["role"], msg["model"]) == ("message", "assistant", MODEL)
    assert [b["type"] for b in msg["content"]] == ["text"]
    assert msg["stop_reason"] in ("end_turn", "max_tokens")
    assert list(msg["usage"]) == ["input_tokens", "output_tokens"]
    stream = await events(client, body(system="Be brief", stream=True))
    names = [n for n, _ in stream]
    assert names[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(n == d["type"] for n, d in stream)
    start = stream[0][1]["message"]
    assert start["content"] == []
    assert start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": msg["usage"]["input_tokens"], "output_tokens": 0}
    assert stream[1][1] == {
        "type": "content_block_start",
        "content_block": {"type": "text", "text": ""},
        "index": 0,
    }
    deltas = [d for n, d in stream if n == "content_block_delta"]
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for d in deltas)
    final = stream[-2][1]
    assert final["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert final["usage"]["input_tokens"] == msg["usage"]["input_tokens"]
    assert final["usage"]["output_tokens"] >= len(deltas)


@pytest.mark.parametrize("sim", [ALWAYS], indirect=True)
async def test_tool_use_shapes_streamed_and_not(client: httpx.AsyncClient) -> None:
    payload = body("run the tests", tools=TOOLS, max_tokens=1000)
    msg = (await client.post("/v1/messages", json=payload)).json()
    assert msg["stop_reason"] == "tool_use"
    use = msg["content"][-1]
    assert list(use) == ["type", "id", "name", "input"]
    assert use["name"] == "bash"
    check(SHELL, use["input"])
    stream = await events(client, {**payload, "stream": True})
    starts = [d for n, d in stream if n == "content_block_start"]
    tool_start = starts[-1]
    assert tool_start["content_block"] == {
        "type": "tool_use",
        "id": use["id"],
        "name": "bash",
        "input": {},
    }
    partial = "".join(
        d["delta"]["partial_json"]
        for n, d in stream
        if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    )
    assert json.loads(partial) == use["input"]
    assert stream[-2][1]["delta"] == {"stop_reason": "tool_use"}
    assert stream[-2][1]["usage"]["output_tokens"] == msg["usage"]["output_tokens"]


@pytest.mark.parametrize("sim", [ALWAYS], indirect=True)
async def test_tool_choice_conversion(client: httpx.AsyncClient) -> None:
    msg = await client.post("/v1/messages", json=body(tools=TOOLS, tool_choice={"type": "none"}))
    assert all(b["type"] == "text" for b in msg.json()["content"])
    named = body("x", tools=TOOLS, max_tokens=1000, tool_choice={"type": "tool", "name": "bash"})
    msg = (await client.post("/v1/messages", json=named)).json()
    assert [b["type"] for b in msg["content"]] == ["tool_use"]
    assert msg["stop_reason"] == "end_turn"  # vLLM maps a named choice's "stop" to end_turn


async def test_errors_in_anthropic_shape_as_vllm_returns_them(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/messages", json={**body(), "model": "claude-sonnet"})
    assert r.status_code == 404
    assert r.json() == {
        "type": "error",
        "error": {
            "type": "NotFoundError",
            "message": f"The model `claude-sonnet` does not exist. Valid aliases: {MODEL}.",
        },
    }
    huge = body("word " * 3000)
    r = await client.post("/v1/messages", json=huge)
    assert r.status_code == 400
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "BadRequestError"
    # Schema errors come from vLLM's server-wide handler, in OpenAI's shape.
    r = await client.post("/v1/messages", json={"model": MODEL, "messages": []})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "body.max_tokens"
    await client.post("/_sim/kill")
    r = await client.post("/v1/messages", json=body())
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "internal_error"


async def test_count_tokens_equals_the_chat_prompt(client: httpx.AsyncClient) -> None:
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: abc"},
        {"type": "text", "text": "You are terse."},
    ]
    history = [
        {"role": "user", "content": "list files"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Sure."},
                {"type": "tool_use", "id": "t1", "name": "bash", "input": {"command": "ls"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py b.py"}],
        },
    ]
    payload = {"model": MODEL, "system": system, "messages": history, "tools": TOOLS}
    count = (await client.post("/v1/messages/count_tokens", json=payload)).json()
    chat_messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "list files"},
        {
            "role": "assistant",
            "content": "Sure.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": json.dumps({"command": "ls"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "a.py b.py"},
    ]
    chat_tools = [
        {
            "type": "function",
            "function": {"name": "bash", "description": "Run a command", "parameters": SHELL},
        }
    ]
    r = await client.post("/tokenize", json={"messages": chat_messages, "tools": chat_tools})
    assert count == {
        "input_tokens": r.json()["count"],
        "context_management": {"original_input_tokens": r.json()["count"]},
    }


@pytest.mark.parametrize("sim", [ALWAYS], indirect=True)
async def test_a_second_turn_extending_the_first_hits_the_cache(
    client: httpx.AsyncClient,
) -> None:
    first_body = body("please fix the failing test " * 30, tools=TOOLS, max_tokens=1000)
    first = (await client.post("/v1/messages", json=first_body)).json()
    use = first["content"][-1]
    turn = [
        {"role": "assistant", "content": first["content"]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "1 failed"}],
        },
    ]
    before = parse_metrics((await client.get("/metrics")).text)
    second = await client.post(
        "/v1/messages", json={**first_body, "messages": first_body["messages"] + turn}
    )
    after = parse_metrics((await client.get("/metrics")).text)
    name = "vllm:prefix_cache_hits_total"
    hits = after[name].value(name) - before[name].value(name)
    reply_end = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert hits == (reply_end - 1) // 32 * 32  # the generated tool_use block included
    assert second.json()["usage"]["input_tokens"] > reply_end


async def test_faults_reach_messages_in_anthropic_shape(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/messages", json=body(), headers={"X-Sim-Fault": "500"})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "internal_error"
    r = await client.post("/v1/messages", json=body(), headers={"X-Sim-Fault": "stream"})
    assert r.status_code == 500
    assert r.json()["type"] == "error"
    lines = []
    payload = body(stream=True, max_tokens=40)
    headers = {"X-Sim-Fault": "stream", "X-Sim-Output-Tokens": "40"}
    async with client.stream("POST", "/v1/messages", json=payload, headers=headers) as response:
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-3] == "event: error"
    assert json.loads(lines[-2][len("data: ") :])["error"]["type"] == "internal_error"
    assert lines[-1] == "data: [DONE]"


CACHED = {**NEVER, "enable_prompt_tokens_details": True}


@pytest.mark.parametrize("sim", [CACHED], indirect=True)
async def test_cache_reads_are_reported_as_anthropic_does(client: httpx.AsyncClient) -> None:
    """With cached tokens reported, input_tokens leaves out what the prefix cache served, which
    comes back as cache_read_input_tokens; the three counts add up to the whole prompt."""
    prompt = "a long shared task description " * 40
    first = (await client.post("/v1/messages", json=body(prompt))).json()
    assert first["id"].startswith("msg_")
    usage = first["usage"]
    assert list(usage) == [
        "input_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "output_tokens",
    ]
    assert usage["cache_read_input_tokens"] == 0
    whole = usage["input_tokens"]
    again = body([{"type": "text", "text": prompt}, {"type": "text", "text": "and more"}])
    stream = await events(client, {**again, "stream": True})
    start = stream[0][1]["message"]
    assert start["id"].startswith("msg_")
    read = start["usage"]["cache_read_input_tokens"]
    assert read > 0
    assert read % 32 == 0  # whole blocks of the first prompt
    assert start["usage"]["cache_creation_input_tokens"] == 0
    assert read + start["usage"]["input_tokens"] > whole
    final = stream[-2][1]["usage"]
    assert (final["input_tokens"], final["cache_read_input_tokens"]) == (
        start["usage"]["input_tokens"],
        read,
    )
