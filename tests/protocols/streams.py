"""Upstream streams in the shapes vLLM and the hosted APIs send, for the taps to read."""

from __future__ import annotations

import json
from typing import Any


def sse(payload: Any, event: str | None = None, *, crlf: bool = False) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    text = (f"event: {event}\n" if event else "") + f"data: {data}\n\n"
    return (text.replace("\n", "\r\n") if crlf else text).encode()


def chunk(delta: dict[str, Any], *, finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


CHAT_USAGE = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "model": "m",
    "choices": [],
    "usage": {
        "prompt_tokens": 120,
        "completion_tokens": 9,
        "total_tokens": 129,
        "prompt_tokens_details": {"cached_tokens": 96},
    },
}


def chat_events(*, crlf: bool = False) -> list[bytes]:
    """A vLLM chat stream: role chunk, text, a tool call in two pieces, the usage chunk, DONE."""
    call_start = {"index": 0, "id": "call_1", "type": "function"}
    call_start["function"] = {"name": "read_file", "arguments": '{"path": '}
    call_rest = {"index": 0, "function": {"arguments": '"a.py"}'}}
    return [
        sse(chunk({"role": "assistant", "content": ""}), crlf=crlf),
        sse(chunk({"content": "Let me "}), crlf=crlf),
        sse(chunk({"content": "look."}), crlf=crlf),
        sse(chunk({"tool_calls": [call_start]}), crlf=crlf),
        sse(chunk({"tool_calls": [call_rest]}, finish="tool_calls"), crlf=crlf),
        sse(CHAT_USAGE, crlf=crlf),
        sse("[DONE]", crlf=crlf),
    ]


CHAT_ANSWER = {
    "role": "assistant",
    "content": "Let me look.",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
        }
    ],
}


def messages_events() -> list[bytes]:
    """An Anthropic Messages stream with a cache hit, text, a tool call and a ping."""
    start_usage = {
        "input_tokens": 20,
        "cache_read_input_tokens": 100,
        "cache_creation_input_tokens": 4,
        "output_tokens": 1,
    }
    message = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
    message |= {"model": "m", "stop_reason": None, "usage": start_usage}
    tool = {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {}}

    def delta(index: int, body: dict[str, Any]) -> bytes:
        return sse(
            {"type": "content_block_delta", "index": index, "delta": body}, "content_block_delta"
        )

    return [
        sse({"type": "message_start", "message": message}, "message_start"),
        sse(
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            "content_block_start",
        ),
        sse({"type": "ping"}, "ping"),
        delta(0, {"type": "text_delta", "text": "Let me "}),
        delta(0, {"type": "text_delta", "text": "look."}),
        sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
        sse(
            {"type": "content_block_start", "index": 1, "content_block": tool},
            "content_block_start",
        ),
        delta(1, {"type": "input_json_delta", "partial_json": '{"path": '}),
        delta(1, {"type": "input_json_delta", "partial_json": '"a.py"}'}),
        sse({"type": "content_block_stop", "index": 1}, "content_block_stop"),
        sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use"},
                "usage": {"output_tokens": 15},
            },
            "message_delta",
        ),
        sse({"type": "message_stop"}, "message_stop"),
    ]


MESSAGES_ANSWER = {
    "role": "assistant",
    "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.py"}},
    ],
}

RESPONSE_OUTPUT = [
    {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "hm"}],
    },
    {
        "type": "message",
        "id": "msg_1",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
    },
    {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "read_file",
        "arguments": '{"path": "a.py"}',
        "status": "completed",
    },
]

RESPONSE_USAGE = {
    "input_tokens": 300,
    "input_tokens_details": {"cached_tokens": 256},
    "output_tokens": 12,
    "output_tokens_details": {"reasoning_tokens": 3},
    "total_tokens": 312,
}


def responses_events() -> list[bytes]:
    created = {
        "id": "resp_1",
        "object": "response",
        "status": "in_progress",
        "output": [],
        "usage": None,
    }
    done = {**created, "status": "completed", "output": RESPONSE_OUTPUT, "usage": RESPONSE_USAGE}
    return [
        sse(
            {"type": "response.created", "sequence_number": 0, "response": created},
            "response.created",
        ),
        sse(
            {"type": "response.in_progress", "sequence_number": 1, "response": created},
            "response.in_progress",
        ),
        sse(
            {
                "type": "response.output_item.added",
                "sequence_number": 2,
                "output_index": 1,
                "item": {"type": "message"},
            },
            "response.output_item.added",
        ),
        sse(
            {
                "type": "response.output_text.delta",
                "sequence_number": 3,
                "item_id": "msg_1",
                "output_index": 1,
                "content_index": 0,
                "delta": "Let me look.",
            },
            "response.output_text.delta",
        ),
        sse(
            {"type": "response.completed", "sequence_number": 9, "response": done},
            "response.completed",
        ),
    ]
