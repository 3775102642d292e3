"""`/v1/responses` over loopback: the response object, streamed events with their sequence
numbers, function calls, the store behind `previous_response_id`, and cached tokens."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from .test_sim_http import MODEL
from .test_sim_tools import ALWAYS, SHELL, check

TOOLS = [{"type": "function", "name": "bash", "description": "Run", "parameters": SHELL}]
NEVER = {"tool_call_probability": 0.0, "tool_call_after_result_probability": 0.0}
KEYS = [
    "id",
    "created_at",
    "incomplete_details",
    "instructions",
    "metadata",
    "model",
    "object",
    "output",
    "parallel_tool_calls",
    "temperature",
    "tool_choice",
    "tools",
    "top_p",
    "background",
    "max_output_tokens",
    "max_tool_calls",
    "previous_response_id",
    "prompt",
    "reasoning",
    "service_tier",
    "status",
    "text",
    "top_logprobs",
    "truncation",
    "usage",
    "user",
    "input_messages",
    "output_messages",
]


async def stream(client: httpx.AsyncClient, payload: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    name = None
    async with client.stream("POST", "/v1/responses", json={**payload, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == name
                out.append(data)
    return out


@pytest.mark.parametrize("sim", [NEVER], indirect=True)
async def test_text_response_object_and_events(client: httpx.AsyncClient) -> None:
    payload = {
        "model": MODEL,
        "input": "hello",
        "instructions": "Be brief. " * 20,
        "max_output_tokens": 40,
    }
    r = await client.post("/v1/responses", json=payload)
    assert r.status_code == 200
    resp = r.json()
    assert list(resp) == KEYS
    assert resp["id"].startswith("resp_")
    assert resp["object"] == "response"
    assert resp["status"] in ("completed", "incomplete")
    assert resp["max_output_tokens"] == 40
    (item,) = resp["output"]
    assert item["type"] == "message"
    assert item["role"] == "assistant"
    assert item["content"][0]["type"] == "output_text"
    usage = resp["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert set(usage["input_tokens_details"]) >= {"cached_tokens"}
    events = await stream(client, payload)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["usage"] is None
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = events[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == text
    assert done["usage"]["input_tokens"] == usage["input_tokens"]
    # The same prompt again: its full blocks are cached, and usage says so.
    assert done["usage"]["input_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("sim", [ALWAYS], indirect=True)
async def test_function_call_items_streamed_and_not(client: httpx.AsyncClient) -> None:
    payload = {"model": MODEL, "input": "run it", "tools": TOOLS, "max_output_tokens": 1000}
    resp = (await client.post("/v1/responses", json=payload)).json()
    call = resp["output"][-1]
    assert call["type"] == "function_call"
    assert call["status"] == "completed"
    assert call["call_id"].startswith("call_")
    assert call["name"] == "bash"
    check(SHELL, json.loads(call["arguments"]))
    events = await stream(client, payload)
    added = [e for e in events if e["type"] == "response.output_item.added"][-1]
    assert added["item"]["type"] == "function_call"
    assert added["item"]["arguments"] == ""
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(e["delta"] for e in deltas) == call["arguments"]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == call["arguments"]
    assert done["name"] == "bash"
    assert events[-1]["response"]["output"][-1]["arguments"] == call["arguments"]


@pytest.mark.parametrize("sim", [ALWAYS], indirect=True)
async def test_previous_response_id_chains_and_hits_the_cache(client: httpx.AsyncClient) -> None:
    first_payload = {
        "model": MODEL,
        "input": "please fix the failing test " * 30,
        "tools": TOOLS,
        "max_output_tokens": 1000,
    }
    first = (await client.post("/v1/responses", json=first_payload)).json()
    call = first["output"][-1]
    follow = {
        "model": MODEL,
        "tools": TOOLS,
        "previous_response_id": first["id"],
        "input": [
            {"type": "function_call_output", "call_id": call["call_id"], "output": "1 failed"}
        ],
    }
    second = (await client.post("/v1/responses", json=follow)).json()
    assert second["previous_response_id"] == first["id"]
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    # The stored input is replayed (vLLM leaves the previous function call out), so the
    # second prompt extends the first's input (and any text the first reply wrote).
    first_input = first["usage"]["input_tokens"]
    assert (first_input - 5) // 32 * 32 <= cached < first_input + first["usage"]["output_tokens"]
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    got = await client.get(f"/v1/responses/{second['id']}")
    assert got.status_code == 200
    assert got.json() == second


async def test_unknown_previous_response_is_404(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_x"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "Response with id 'resp_x' not found."
    assert (await client.get("/v1/responses/resp_x")).status_code == 404


@pytest.mark.parametrize("sim", [{"enable_responses_api_store": False}], indirect=True)
async def test_without_the_store_nothing_chains(client: httpx.AsyncClient) -> None:
    first = (await client.post("/v1/responses", json={"input": "hi"})).json()
    r = await client.post("/v1/responses", json={"input": "x", "previous_response_id": first["id"]})
    assert r.status_code == 404


@pytest.mark.parametrize("sim", [{"responses_store_size": 2}], indirect=True)
async def test_the_store_is_bounded(client: httpx.AsyncClient) -> None:
    ids = [
        (await client.post("/v1/responses", json={"input": f"q{i}"})).json()["id"] for i in range(3)
    ]
    assert (await client.get(f"/v1/responses/{ids[0]}")).status_code == 404
    assert (await client.get(f"/v1/responses/{ids[2]}")).status_code == 200


async def test_a_failed_stream_ends_with_an_error_event(client: httpx.AsyncClient) -> None:
    payload = {"input": "hi", "max_output_tokens": 40, "stream": True}
    headers = {"X-Sim-Fault": "stream", "X-Sim-Output-Tokens": "40"}
    async with client.stream("POST", "/v1/responses", json=payload, headers=headers) as r:
        data = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data")]
    assert data[-1]["type"] == "error"
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert all(d["type"] != "response.completed" for d in data)
