"""Tool calls: the argument generator, the seeded decision, and chat completions with tools.

Shapes follow vLLM's chat serving with a hermes-style tool parser (docs/SIMULATOR.md).
"""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from trio.testing import MockClock

from thunderproxy.sim import Engine, SimConfig
from thunderproxy.sim.api.tools import (
    ArgumentGenerator,
    ToolSpec,
    Tracker,
    plan_tool_call,
    template_messages,
)
from thunderproxy.sim.engine.tokenizer import Tokenizer

from .helpers import SMALL, parse_metrics, token_prompt
from .test_sim_http import MODEL, sse

ALWAYS = {"tool_call_probability": 1.0, "tool_call_after_result_probability": 1.0}
SHELL = {
    "type": "object",
    "properties": {
        "command": {"type": "string"},
        "timeout": {"type": "integer", "minimum": 1, "maximum": 600},
    },
    "required": ["command"],
}
EDIT = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "mode": {"enum": ["replace", "insert"]},
        "old_str": {"type": "string"},
        "new_str": {"type": "string"},
        "dry_run": {"type": "boolean"},
        "ranges": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"start": {"type": "integer"}, "end": {"type": "number"}},
                "required": ["start", "end"],
            },
            "minItems": 1,
        },
    },
    "required": ["path", "mode", "new_str", "dry_run", "ranges"],
}
TOOLS = [
    {"type": "function", "function": {"name": "bash", "description": "Run", "parameters": SHELL}},
    {"type": "function", "function": {"name": "edit", "parameters": EDIT}},
]


def check(schema: dict[str, Any], value: Any) -> None:
    """A small validator for the schema features the generator promises to honour."""
    if "enum" in schema:
        assert value in schema["enum"]
        return
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict)
        assert set(schema.get("required", [])) <= set(value)
        for name, sub in schema["properties"].items():
            if name in value:
                check(sub, value[name])
    elif kind == "array":
        assert isinstance(value, list)
        assert len(value) >= schema.get("minItems", 0)
        for item in value:
            check(schema["items"], item)
    elif kind == "string":
        assert isinstance(value, str)
        assert value
    elif kind == "integer":
        assert isinstance(value, int)
        assert not isinstance(value, bool)
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)
    elif kind == "number":
        assert isinstance(value, int | float)
        assert not isinstance(value, bool)
    elif kind == "boolean":
        assert isinstance(value, bool)


@pytest.mark.parametrize("seed", range(40))
def test_arguments_satisfy_the_schema(seed: int) -> None:
    gen = ArgumentGenerator(random.Random(seed))
    for schema, name in ((SHELL, "bash"), (EDIT, "edit")):
        check(schema, gen.value(schema, name))


def test_arguments_have_agent_like_lengths() -> None:
    tok = Tokenizer()
    sizes = []
    for seed in range(60):
        gen = ArgumentGenerator(random.Random(seed))
        for schema in (SHELL, EDIT):
            sizes.append(len(tok.encode(json.dumps(gen.value(schema, "x")))))
    assert min(sizes) >= 10
    assert max(sizes) <= 600
    assert 25 <= sorted(sizes)[len(sizes) // 2] <= 250  # a shell command to a file edit


def plan(choice: str, prompt: list[int], **kw: Any) -> Any:
    specs = [ToolSpec("bash", None, SHELL), ToolSpec("edit", None, EDIT)]
    args: dict[str, Any] = dict(
        tools=specs,
        choice=choice,
        after_tool_result=False,
        probability=0.5,
        probability_after_result=0.25,
        seed=0,
        prompt_ids=prompt,
        preamble="Let me look.",
        call_id_prefix="call_",
    )
    args.update(kw)
    return plan_tool_call(**args)


def test_the_decision_is_seeded_by_the_prompt_and_follows_the_knobs() -> None:
    prompts = [[i, i + 1, i + 2] for i in range(400)]
    first = [plan("auto", p) for p in prompts]
    assert first == [plan("auto", p) for p in prompts]  # runs repeat
    share = sum(p is not None for p in first) / len(prompts)
    assert 0.4 < share < 0.6
    after = sum(plan("auto", p, after_tool_result=True) is not None for p in prompts)
    assert 0.15 < after / len(prompts) < 0.35  # text is likely after a tool result
    assert all(plan("auto", p, probability=0.0) is None for p in prompts[:50])
    assert all(plan("auto", p, probability=1.0) is not None for p in prompts[:50])
    assert all(plan("none", p, probability=1.0) is None for p in prompts[:50])
    assert all(plan("required", p, probability=0.0) is not None for p in prompts[:50])
    assert {plan("edit", p, probability=0.0).name for p in prompts[:50]} == {"edit"}


@pytest.mark.parametrize("choice", ["auto", "required", "edit"])
def test_the_tracker_splits_text_markup_and_arguments(choice: str) -> None:
    tok = Tokenizer()
    for i in range(30):
        p = plan(choice, [i, 7], probability=1.0)
        tracker = Tracker(p)
        content, starts, args = "", 0, ""
        for piece in tok.pieces(p.text):
            c, began, a = tracker.feed(piece)
            content, starts, args = content + c, starts + began, args + a
        assert starts == 1
        assert args == p.arguments
        json.loads(args)
        assert content == p.text[: p.content_end]
        assert p.parse(p.text) == (content or None, True)
        assert p.parse(p.text[:-1]) == (p.text[:-1], False)  # cut short: no call


def test_a_resent_call_renders_to_the_generated_tokens() -> None:
    """The template's rendering of a call equals what the model generated (prefix hits)."""
    tok = Tokenizer()
    for i in range(20):
        p = plan("auto", [i], probability=1.0)
        generated = tok.encode("<|start|>assistant\n" + p.text + "<|end|>")
        content = p.text[: p.content_end] or None
        call = {
            "id": "x",
            "type": "function",
            "function": {"name": p.name, "arguments": p.arguments},
        }
        message = {"role": "assistant", "content": content, "tool_calls": [call]}
        rendered = tok.encode_chat(template_messages([message], None), add_generation_prompt=False)
        assert rendered == generated


# --- over HTTP ----------------------------------------------------------------------------
def chat(content: str = "list the files", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


@pytest.mark.parametrize("sim", [ALWAYS], indirect=True)
async def test_chat_tool_call_nonstream_shape(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat(tools=TOOLS))
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert list(message) == [
        "role",
        "content",
        "refusal",
        "annotations",
        "audio",
        "function_call",
        "tool_calls",
        "reasoning",
    ]
    (call,) = message["tool_calls"]
    assert list(call) == ["id", "type", "function"]
    assert call["id"].startswith("chatcmpl-tool-")
    assert call["type"] == "function"
    name = call["function"]["name"]
    check(SHELL if name == "bash" else EDIT, json.loads(call["function"]["arguments"]))
    # The call's tokens are generated tokens: markup and arguments count in usage.
    usage = r.json()["usage"]
    assert usage["completion_tokens"] > len(Tokenizer().encode(call["function"]["arguments"]))


@pytest.mark.parametrize("sim", [ALWAYS], indirect=True)
async def test_chat_tool_call_stream_matches_the_nonstreamed_call(
    client: httpx.AsyncClient,
) -> None:
    body = chat("stream it", tools=TOOLS)
    full = (await client.post("/v1/chat/completions", json=body)).json()
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    events = await sse(client, "/v1/chat/completions", stream)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [e["choices"][0]["delta"] for e in events[1:-2]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    head, *fragments = calls
    assert list(head) == ["id", "type", "index", "function"]
    assert head["index"] == 0
    assert head["function"] == {"name": head["function"]["name"]}
    assert all(list(f) == ["index", "function"] for f in fragments)
    arguments = "".join(f["function"]["arguments"] for f in fragments)
    expected = full["choices"][0]["message"]["tool_calls"][0]
    assert head["function"]["name"] == expected["function"]["name"]
    assert arguments == expected["function"]["arguments"]
    assert events[-3]["choices"][0]["finish_reason"] == "tool_calls"
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == full["usage"]["completion_tokens"]


async def test_tool_choice_none_and_required_and_named(client: httpx.AsyncClient) -> None:
    await client.post("/_sim/config", json={"tool_call_probability": 1.0})
    r = await client.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice="none"))
    message = r.json()["choices"][0]["message"]
    assert "tool_calls" not in message
    assert r.json()["choices"][0]["finish_reason"] != "tool_calls"
    await client.post("/_sim/config", json={"tool_call_probability": 0.0})
    for i in range(5):
        body = chat(f"go {i}", tools=TOOLS, tool_choice="required", max_tokens=2000)
        choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == ""
        named = {"type": "function", "function": {"name": "edit"}}
        body = chat(f"go {i}", tools=TOOLS, tool_choice=named, max_tokens=2000)
        choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "edit"
        check(EDIT, json.loads(call["function"]["arguments"]))
        assert choice["finish_reason"] == "stop"  # vLLM keeps "stop" for a named choice


async def test_tool_choice_errors(client: httpx.AsyncClient) -> None:
    named = {"type": "function", "function": {"name": "nope"}}
    r = await client.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice=named))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tool_choice"
    r = await client.post("/v1/chat/completions", json=chat(tool_choice="required", tools=None))
    assert r.status_code == 400
    r = await client.post("/v1/chat/completions", json=chat(tools=[]))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tools"


@pytest.mark.parametrize("sim", [ALWAYS], indirect=True)
async def test_an_agent_loop_resending_the_call_hits_the_cache(
    client: httpx.AsyncClient,
) -> None:
    """Turn two resends turn one's call and a tool result: its prefix is cached."""
    body = chat("fix the bug " * 40, tools=TOOLS)
    first = (await client.post("/v1/chat/completions", json=body)).json()
    message = first["choices"][0]["message"]
    call = message["tool_calls"][0]
    history = [
        *body["messages"],
        {"role": "assistant", "content": message["content"], "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "ok"},
    ]
    before = parse_metrics((await client.get("/metrics")).text)
    second = await client.post("/v1/chat/completions", json={**body, "messages": history})
    after = parse_metrics((await client.get("/metrics")).text)
    hits = after["vllm:prefix_cache_hits_total"].value("vllm:prefix_cache_hits_total") - before[
        "vllm:prefix_cache_hits_total"
    ].value("vllm:prefix_cache_hits_total")
    prompt = second.json()["usage"]["prompt_tokens"]
    reply_end = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    # Everything up to the reply's last full block was cached, the generated call included.
    assert hits == (reply_end - 1) // 32 * 32
    assert prompt > reply_end


def test_odd_schemas_still_give_valid_arguments() -> None:
    """Schemas agents really send: untyped, required-but-undescribed, inverted bounds."""
    odd: list[tuple[dict[str, Any], Any]] = [
        ({"type": "object", "required": ["query"]}, lambda v: isinstance(v["query"], str)),
        ({"type": "integer", "minimum": 50, "maximum": 10}, lambda v: v == 50),
        ({"type": ["string", "null"]}, lambda v: isinstance(v, str)),
        ({"anyOf": [{"type": "null"}, {"type": "boolean"}]}, lambda v: isinstance(v, bool)),
        ({"properties": {"n": {"type": "number"}}, "required": ["n"]},
         lambda v: isinstance(v["n"], float)),
        ({"const": "fixed"}, lambda v: v == "fixed"),
        ({}, lambda v: isinstance(v, str)),
    ]  # fmt: skip
    for seed in range(10):
        gen = ArgumentGenerator(random.Random(seed))
        for schema, ok in odd:
            value = gen.value(schema, "query")
            assert ok(value), (schema, value)
            json.dumps(value)


async def test_a_scripted_call_is_decoded_token_by_token(
    autojump_clock: MockClock, start_engine: Callable[[SimConfig], Awaitable[Engine]]
) -> None:
    """The call's tokens are engine output: one per decode step, then EOS, in the usage."""
    engine = await start_engine(SimConfig(**SMALL))  # type: ignore[arg-type]
    tok = engine.tokenizer
    p = plan("auto", [1, 2, 3], probability=1.0)
    script = [(tok.piece_id(piece), piece) for piece in tok.pieces(p.text)]
    handle = engine.submit(token_prompt(5, 100), max_tokens=2000, script=script)
    outputs = [out async for out in handle]
    assert "".join(o.text for o in outputs) == p.text
    assert len(outputs) == len(script) + 1  # one token per step, EOS last
    assert outputs[-1].finish_reason == "stop"
    assert outputs[-1].num_output_tokens == len(script) + 1
    decode_steps = [rec for rec in engine.trace if all(b[3] for b in rec[3])]
    assert len(decode_steps) == len(script)  # the first token came with the prefill
    short = engine.submit(token_prompt(6, 100), max_tokens=5, script=script)
    cut = [out async for out in short]
    assert cut[-1].finish_reason == "length"
    assert "".join(o.text for o in cut) == "".join(piece for _, piece in script[:5])
