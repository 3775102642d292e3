"""Request checks, prompt sizes, forced usage, and error bodies in each protocol's own shape."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from thunderproxy.errors import InvalidRequest
from thunderproxy.protocols import (
    ROUTES,
    UNSCHEDULED_ROUTES,
    Protocol,
    error_body,
    prepare,
    sse_error_event,
)
from thunderproxy.protocols.anthropic import prepare_count_tokens
from thunderproxy.protocols.base import parse_event

USER = {"role": "user", "content": "List the files."}
TOOL = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("protocol", "body", "param"),
    [
        pytest.param(Protocol.CHAT, {"model": "m"}, "messages", id="chat-no-messages"),
        pytest.param(Protocol.CHAT, {"messages": []}, "messages", id="chat-empty-messages"),
        pytest.param(Protocol.CHAT, {"messages": ["hi"]}, "messages", id="chat-message-not-object"),
        pytest.param(
            Protocol.CHAT, {"messages": [{"content": "x"}]}, "messages", id="chat-no-role"
        ),
        pytest.param(
            Protocol.CHAT, {"messages": [USER], "stream": "yes"}, "stream", id="chat-stream"
        ),
        pytest.param(
            Protocol.CHAT,
            {"messages": [USER], "stream_options": 1},
            "stream_options",
            id="chat-options",
        ),
        pytest.param(Protocol.CHAT, {"messages": [USER], "model": 3}, "model", id="chat-model"),
        pytest.param(Protocol.CHAT, {"messages": [USER], "tools": {}}, "tools", id="chat-tools"),
        pytest.param(Protocol.COMPLETIONS, {"prompt": 5}, "prompt", id="completions-prompt"),
        pytest.param(
            Protocol.MESSAGES, {"max_tokens": 5, "messages": [USER]}, "model", id="messages-model"
        ),
        pytest.param(
            Protocol.MESSAGES, {"model": "m", "messages": [USER]}, "max_tokens", id="messages-max"
        ),
        pytest.param(
            Protocol.MESSAGES,
            {"model": "m", "max_tokens": 0, "messages": [USER]},
            "max_tokens",
            id="messages-max-zero",
        ),
        pytest.param(
            Protocol.MESSAGES,
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": 3}]},
            "messages",
            id="messages-content",
        ),
        pytest.param(
            Protocol.MESSAGES,
            {"model": "m", "max_tokens": 5, "messages": [USER], "system": 1},
            "system",
            id="messages-system",
        ),
        pytest.param(Protocol.RESPONSES, {"model": "m"}, "input", id="responses-no-input"),
        pytest.param(
            Protocol.RESPONSES,
            {"input": "hi", "previous_response_id": "r1", "previous_response": {"id": "r1"}},
            "previous_response_id",
            id="responses-both-previous",
        ),
        pytest.param(
            Protocol.RESPONSES,
            {"input": "hi", "instructions": ["x"]},
            "instructions",
            id="responses-instr",
        ),
    ],
)
def test_what_no_backend_takes_is_refused_with_the_field_named(
    protocol: Protocol, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        prepare(protocol, body)
    assert caught.value.param == param
    assert param in caught.value.message or "program" in caught.value.message


def test_chat_forces_usage_on_streams_and_leaves_the_client_body_alone() -> None:
    body = {"model": "m", "messages": [USER], "stream": True, "stream_options": {"x": 1}}
    before = copy.deepcopy(body)
    prepared = prepare(Protocol.CHAT, body)
    assert body == before
    assert prepared.body["stream_options"] == {"x": 1, "include_usage": True}
    assert prepared.hide_usage
    assert prepared.stream
    assert prepared.model == "m"


def test_chat_that_asked_for_usage_keeps_it() -> None:
    body = {"messages": [USER], "stream": True, "stream_options": {"include_usage": True}}
    assert not prepare(Protocol.CHAT, body).hide_usage


def test_unstreamed_chat_is_sent_as_it_came() -> None:
    prepared = prepare(Protocol.CHAT, {"messages": [USER]})
    assert prepared.body == {"messages": [USER]}
    assert not prepared.stream
    assert not prepared.hide_usage


def test_prompt_chars_count_system_messages_and_tool_schemas() -> None:
    tools_chars = len(json.dumps([TOOL], separators=(",", ":")))
    chat = prepare(
        Protocol.CHAT,
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "abc"}]},
            ],
            "tools": [TOOL],
        },
    )
    assert chat.prompt_chars == len("Be brief.") + 3 + tools_chars
    messages = prepare(
        Protocol.MESSAGES,
        {
            "model": "m",
            "max_tokens": 9,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                USER,
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}],
                },
            ],
        },
    )
    assert messages.prompt_chars == len("Be brief.") + len(USER["content"]) + 2
    responses = prepare(
        Protocol.RESPONSES,
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "abc"}]},
                {"type": "function_call", "name": "ls", "arguments": "{}", "call_id": "c"},
                {"type": "function_call_output", "call_id": "c", "output": "a.py"},
            ],
        },
    )
    assert responses.prompt_chars == len("Be brief.") + 3 + 2 + 4


def test_messages_and_responses_need_nothing_forced() -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [USER], "stream": True}
    assert prepare(Protocol.MESSAGES, body).body == body
    assert prepare(Protocol.RESPONSES, {"input": "hi", "stream": True}).body == {
        "input": "hi",
        "stream": True,
    }


def test_count_tokens_is_checked_but_not_scheduled() -> None:
    assert UNSCHEDULED_ROUTES["/v1/messages/count_tokens"] is Protocol.MESSAGES
    assert "/v1/messages/count_tokens" not in ROUTES
    assert prepare_count_tokens({"model": "m", "messages": [USER]}).model == "m"
    with pytest.raises(InvalidRequest):
        prepare_count_tokens({"messages": [USER]})


def test_anthropic_error_body_shape() -> None:
    body = json.loads(error_body(Protocol.MESSAGES, 400, "invalid_request_error", "bad"))
    assert body == {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}


@pytest.mark.parametrize(
    ("status", "ours", "theirs"),
    [
        (429, "queue_full", "rate_limit_error"),
        (504, "backend_timeout", "api_error"),
        (503, "no_backend_available", "overloaded_error"),
        (401, "unauthorized", "authentication_error"),
        (413, "payload_too_large", "request_too_large"),
    ],
)
def test_anthropic_clients_get_types_they_know(status: int, ours: str, theirs: str) -> None:
    body = json.loads(error_body(Protocol.MESSAGES, status, ours, "m"))
    assert body["error"]["type"] == theirs


@pytest.mark.parametrize("protocol", [Protocol.CHAT, Protocol.COMPLETIONS, Protocol.RESPONSES])
def test_openai_error_body_shape(protocol: Protocol) -> None:
    body = json.loads(error_body(protocol, 400, "invalid_request_error", "bad", param="model"))
    assert body == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "model", "code": 400}
    }


def test_sse_error_events_parse_as_each_protocol_expects() -> None:
    chat = sse_error_event(Protocol.CHAT, 502, "backend_unavailable", "gone")
    first, done, _ = chat.split(b"\n\n")
    assert json.loads(parse_event(first).data)["error"]["message"] == "gone"
    assert parse_event(done).data == b"[DONE]"

    messages = parse_event(sse_error_event(Protocol.MESSAGES, 504, "backend_timeout", "slow"))
    assert messages.name == "error"
    assert json.loads(messages.data) == {
        "type": "error",
        "error": {"type": "api_error", "message": "slow"},
    }

    responses = parse_event(sse_error_event(Protocol.RESPONSES, 502, "backend_unavailable", "gone"))
    assert responses.name == "error"
    event = json.loads(responses.data)
    assert event["type"] == "error"
    assert event["message"] == "gone"
    assert event["code"] == "backend_unavailable"
