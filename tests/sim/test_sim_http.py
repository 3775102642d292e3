"""The HTTP surface over real loopback sockets: golden shapes, usage, errors, auth, tokenize.

Expected key orders are the ones vLLM 0.32 sent on this machine (docs/SIMULATOR.md).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from thunderproxy.sim import Simulator

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DETAILS = {"enable_prompt_tokens_details": True}
LONG_TEXT = "alpha beta gamma delta " * 80


def chat_body(content: str = LONG_TEXT, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def sse(client: httpx.AsyncClient, path: str, body: dict[str, Any], **kw: Any) -> list[Any]:
    """POST and return the stream's events: parsed JSON, with "[DONE]" kept as a string."""
    events: list[Any] = []
    async with client.stream("POST", path, json=body, **kw) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("sim", [DETAILS], indirect=True)
async def test_chat_nonstream_golden_shape(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json=chat_body(max_tokens=4),
        headers={"X-Request-Id": "prog-42-turn-1"},
    )
    assert r.status_code == 200
    body = r.json()
    assert list(body) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "prompt_logprobs",
        "prompt_token_ids",
        "prompt_text",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    ]
    assert body["id"] == "chatcmpl-prog-42-turn-1"
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert list(choice) == [
        "index",
        "message",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "routed_experts",
    ]
    assert list(choice["message"]) == [
        "role",
        "content",
        "refusal",
        "annotations",
        "audio",
        "function_call",
        "reasoning",
    ]
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert list(usage) == [
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
        "completion_tokens_details",
    ]
    assert usage["completion_tokens"] == 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + 4
    created = usage["prompt_tokens"] // 32 * 32
    assert usage["prompt_tokens_details"] == {
        "cached_tokens": 0,
        "created_cache_tokens": created,
        "multimodal_tokens": None,
    }
    assert body["system_fingerprint"].startswith("vllm-0.33.0-")


@pytest.mark.parametrize("sim", [DETAILS], indirect=True)
async def test_chat_stream_golden_shape_with_usage(client: httpx.AsyncClient) -> None:
    body = chat_body(max_tokens=5, stream=True, stream_options={"include_usage": True})
    await client.post("/v1/chat/completions", json=body)  # warm the cache
    events = await sse(client, "/v1/chat/completions", body, headers={"X-Request-Id": "p-7"})
    role, *tokens, usage_chunk, done = events
    assert done == "[DONE]"
    assert {e["id"] for e in events[:-1]} == {"chatcmpl-p-7"}
    assert list(role) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "prompt_token_ids",
        "prompt_text",
    ]
    assert role["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert len(tokens) == 5  # one chunk per engine step
    for chunk in tokens[:-1]:
        assert list(chunk) == ["id", "object", "created", "model", "choices"]
        assert list(chunk["choices"][0]) == [
            "index",
            "delta",
            "logprobs",
            "finish_reason",
            "token_ids",
        ]
    final = tokens[-1]
    assert list(final) == ["id", "object", "created", "model", "choices"]
    assert list(final["choices"][0]) == [
        "index",
        "delta",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
    ]
    assert final["choices"][0]["finish_reason"] == "length"
    assert list(usage_chunk) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "usage",
        "system_fingerprint",
    ]
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    prompt = usage["prompt_tokens"]
    hit = (prompt - 1) // 32 * 32
    assert usage == {
        "prompt_tokens": prompt,
        "total_tokens": prompt + 5,
        "completion_tokens": 5,
        "prompt_tokens_details": {
            "cached_tokens": hit,
            "created_cache_tokens": prompt // 32 * 32 - hit,
        },
    }


async def test_stream_without_usage_puts_fingerprint_on_last_chunk(
    client: httpx.AsyncClient,
) -> None:
    events = await sse(client, "/v1/chat/completions", chat_body(max_tokens=2, stream=True))
    assert events[-1] == "[DONE]"
    assert "system_fingerprint" in events[-2]
    assert "usage" not in events[-2]
    assert all("system_fingerprint" not in e for e in events[:-2])


async def test_usage_details_are_gated_by_the_server_flag(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    assert r.json()["usage"]["prompt_tokens_details"] is None
    body = chat_body(max_tokens=2, stream=True, stream_options={"include_usage": True})
    events = await sse(client, "/v1/chat/completions", body)
    assert "prompt_tokens_details" not in events[-2]["usage"]


@pytest.mark.parametrize("sim", [DETAILS], indirect=True)
async def test_completions_shapes(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": list(range(100, 164)), "max_tokens": 3, "ignore_eos": True}
    r = await client.post("/v1/completions", json=body)
    out = r.json()
    assert out["id"].startswith("cmpl-")
    assert out["object"] == "text_completion"
    assert list(out["choices"][0]) == [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "prompt_logprobs",
        "prompt_token_ids",
        "routed_experts",
    ]
    assert out["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0,
        "created_cache_tokens": None,
        "multimodal_tokens": None,
    }
    events = await sse(
        client,
        "/v1/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    *tokens, usage_chunk, done = events
    assert done == "[DONE]"
    assert len(tokens) == 3  # no role chunk for completions
    assert list(tokens[0]["choices"][0]) == [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "prompt_token_ids",
        "token_ids",
    ]
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


async def test_continuous_usage_stats(client: httpx.AsyncClient) -> None:
    body = {
        "model": MODEL,
        "prompt": [5, 6, 7, 8],
        "max_tokens": 2,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = await sse(client, "/v1/completions", body)
    assert [e["usage"]["completion_tokens"] for e in events[:2]] == [1, 2]
    assert events[0]["usage"] == {"prompt_tokens": 4, "total_tokens": 5, "completion_tokens": 1}


@pytest.mark.parametrize("sim", [DETAILS], indirect=True)
async def test_cached_tokens_arithmetic_and_salt(client: httpx.AsyncClient) -> None:
    prompt = list(range(1000, 1608))

    async def cached(salt: str | None = None) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
        if salt:
            body["cache_salt"] = salt
        r = await client.post("/v1/completions", json=body)
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert [await cached(), await cached()] == [0, 576]
    assert [await cached("prog-a"), await cached("prog-a"), await cached("prog-b")] == [0, 576, 0]


@pytest.mark.parametrize("sim", [DETAILS], indirect=True)
async def test_agent_appending_the_reply_gets_prefix_hits(
    client: httpx.AsyncClient, sim: Simulator
) -> None:
    messages = [{"role": "system", "content": LONG_TEXT}, {"role": "user", "content": "go"}]
    r = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 120},
        headers={"X-Request-Id": "agent-1-1", "X-Sim-Output-Tokens": "100"},
    )
    first = r.json()
    assert first["choices"][0]["finish_reason"] == "stop"
    messages += [first["choices"][0]["message"], {"role": "user", "content": "tool output: ok"}]
    messages[-2] = {"role": "assistant", "content": messages[-2]["content"]}
    r = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 5},
        headers={"X-Request-Id": "agent-1-2"},
    )
    usage = r.json()["usage"]
    turn1 = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    # Everything computed in turn 1 (prompt, reply, EOS but the last sampled) is reused.
    assert usage["prompt_tokens_details"]["cached_tokens"] == (turn1 - 1) // 32 * 32
    state = (await client.get("/_sim/state")).json()
    assert state["programs"]["agent-1"]["resident_blocks"] > 0


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "kind"),
    [
        pytest.param(
            "/v1/chat/completions",
            chat_body(model="nope"),
            404,
            "model",
            "NotFoundError",
            id="unknown-model",
        ),
        pytest.param(
            "/v1/completions",
            {"prompt": list(range(2100)), "max_tokens": 5},
            400,
            "input_tokens",
            "BadRequestError",
            id="prompt-too-long",
        ),
        pytest.param(
            "/v1/completions",
            {"prompt": [1, 2, 3], "max_tokens": 5000},
            400,
            "max_tokens",
            "BadRequestError",
            id="max-tokens-above-context",
        ),
        pytest.param(
            "/v1/completions",
            {"prompt": [1, 2, 3], "max_tokens": 0},
            400,
            "max_tokens",
            "BadRequestError",
            id="max-tokens-zero",
        ),
        pytest.param(
            "/v1/chat/completions",
            {"model": MODEL},
            400,
            "body.messages",
            "Bad Request",
            id="missing-messages",
        ),
        pytest.param(
            "/v1/chat/completions",
            {"messages": "x"},
            400,
            "body.messages",
            "Bad Request",
            id="messages-not-a-list",
        ),
        pytest.param(
            "/v1/chat/completions",
            {"messages": []},
            400,
            None,
            "BadRequestError",
            id="empty-conversation",
        ),
        pytest.param(
            "/v1/completions", {"prompt": ""}, 400, "prompt", "BadRequestError", id="empty-prompt"
        ),
        pytest.param(
            "/v1/completions",
            {"prompt": [1], "stream_options": {"include_usage": True}},
            400,
            "stream_options",
            "BadRequestError",
            id="stream-options-without-stream",
        ),
    ],
)
async def test_errors_have_vllm_status_and_nested_body(
    client: httpx.AsyncClient, path: str, body: Any, status: int, param: str | None, kind: str
) -> None:
    r = await client.post(path, json=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert list(error) == ["message", "type", "param", "code"]
    assert (error["type"], error["param"], error["code"]) == (kind, param, status)


async def test_bad_json_and_unknown_routes(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", content=b"not json")
    assert (r.status_code, r.json()["error"]["param"]) == (400, "body.0")
    r = await client.post("/v1/embeddings", json={"input": "hi"})
    assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})
    r = await client.get("/v1/chat/completions")
    assert r.status_code == 405
    assert (await client.post("/reset_prefix_cache")).status_code == 404  # dev mode only


@pytest.mark.parametrize("sim", [{"compat": "0.9"}], indirect=True)
async def test_old_compat_flat_errors_and_max_tokens_overflow(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": list(range(2000)), "max_tokens": 100})
    assert r.status_code == 400
    assert list(r.json()) == ["object", "message", "type", "param", "code"]
    assert "'max_tokens' or 'max_completion_tokens' is too large" in r.json()["message"]
    assert (await client.get("/version")).json() == {"version": "0.9.2"}


async def test_current_compat_clamps_max_tokens(client: httpx.AsyncClient) -> None:
    body = {"prompt": list(range(2000)), "max_tokens": 100, "ignore_eos": True}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 48


@pytest.mark.parametrize("sim", [{"api_key": "s3cret"}], indirect=True)
async def test_api_key_guards_v1_only(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models")
    assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
    assert (await client.get("/metrics")).status_code == 200
    assert (await client.get("/health")).status_code == 200
    r = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200


async def test_models_health_version_load_ping(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    card = models["data"][0]
    assert (models["object"], card["id"], card["owned_by"]) == ("list", MODEL, "vllm")
    assert card["max_model_len"] == 2048
    assert card["parent"] is None
    assert card["permission"][0]["object"] == "model_permission"
    health = await client.get("/health")
    assert (health.status_code, health.content) == (200, b"")
    assert (await client.get("/version")).json() == {"version": "0.33.0"}
    assert (await client.get("/load")).json() == {"server_load": 0}
    assert (await client.post("/ping")).status_code == 200


async def test_tokenize_matches_prompt_tokens_and_detokenize(client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "count these words please"}]
    tok = (await client.post("/tokenize", json={"model": MODEL, "messages": messages})).json()
    assert list(tok) == ["count", "max_model_len", "tokens", "token_strs"]
    r = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == tok["count"] == len(tok["tokens"])
    plain = (await client.post("/tokenize", json={"prompt": "hello world"})).json()
    back = (await client.post("/detokenize", json={"tokens": plain["tokens"]})).json()
    assert back == {"prompt": "hello world"}


@pytest.mark.parametrize("sim", [{"enable_request_id_headers": True}], indirect=True)
async def test_request_id_header_echo(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions", json=chat_body(max_tokens=1), headers={"X-Request-Id": "prog-1-3"}
    )
    assert r.headers["x-request-id"] == "prog-1-3"


@pytest.mark.parametrize("sim", [{"dev_mode": True}], indirect=True)
async def test_dev_mode_endpoints(client: httpx.AsyncClient) -> None:
    await client.post("/v1/completions", json={"prompt": list(range(100)), "max_tokens": 1})
    assert (await client.get("/_sim/state")).json()["blocks"]["cached_free"] == 3
    assert (await client.post("/reset_prefix_cache")).json() == {"success": True}
    assert (await client.get("/_sim/state")).json()["blocks"]["cached_free"] == 0
    assert (await client.post("/sleep")).status_code == 200
    assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
    assert (await client.post("/wake_up")).status_code == 200
    assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}


async def test_output_tokens_header_sets_the_stop(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions", json=chat_body(max_tokens=50), headers={"X-Sim-Output-Tokens": "7"}
    )
    body = r.json()
    assert (body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]) == ("stop", 7)
    ignore = await client.post(
        "/v1/chat/completions",
        json=chat_body(max_tokens=9, ignore_eos=True),
        headers={"X-Sim-Output-Tokens": "7"},
    )
    assert ignore.json()["usage"]["completion_tokens"] == 9
