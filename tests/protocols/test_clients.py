"""What the official SDKs make of the proxy's error bodies and mid-stream error events, and of
the streams the taps read: each protocol's clients must see an error where they look for one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from thunderproxy.protocols import MessagesTap, Protocol, error_body, sse_error_event

from .streams import chat_events, chunk, messages_events, responses_events, sse


def handler(status: int, content: bytes, *, stream: bool) -> Callable[[Any], Any]:
    """One canned answer, for either SDK's transport (they run on httpx and httpx2)."""
    content_type = "text/event-stream" if stream else "application/json"

    def respond(request: Any) -> Any:
        response_class = httpx2.Response if isinstance(request, httpx2.Request) else httpx.Response
        return response_class(status, content=content, headers={"content-type": content_type})

    return respond


def openai_client(status: int, content: bytes, *, stream: bool) -> openai.OpenAI:
    transport = httpx.MockTransport(handler(status, content, stream=stream))
    http = httpx.Client(transport=transport)
    return openai.OpenAI(
        base_url="http://proxy/v1", api_key="unused", http_client=http, max_retries=0
    )


def anthropic_client(status: int, content: bytes, *, stream: bool) -> anthropic.Anthropic:
    # The Anthropic SDK runs on httpx2, a fork with the same API.
    transport = httpx2.MockTransport(handler(status, content, stream=stream))
    http = httpx2.Client(transport=transport)
    return anthropic.Anthropic(
        base_url="http://proxy", api_key="unused", http_client=http, max_retries=0
    )


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGE = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}


def test_openai_sdk_reads_the_chat_error_body() -> None:
    body = error_body(Protocol.CHAT, 400, "invalid_request_error", "bad model", param="model")
    client = openai_client(400, body, stream=False)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**CHAT)
    assert caught.value.body == {
        "message": "bad model",
        "type": "invalid_request_error",
        "param": "model",
        "code": 400,
    }


def test_openai_sdk_raises_the_mid_stream_chat_error() -> None:
    stream = sse(chunk({"content": "par"})) + sse_error_event(
        Protocol.CHAT, 502, "backend_unavailable", "backend went away"
    )
    client = openai_client(200, stream, stream=True)
    parts = client.chat.completions.create(**CHAT, stream=True)
    assert next(parts).choices[0].delta.content == "par"
    with pytest.raises(openai.APIError, match="backend went away"):
        next(parts)


def test_openai_sdk_reads_the_whole_chat_stream() -> None:
    client = openai_client(200, b"".join(chat_events()), stream=True)
    parts = list(client.chat.completions.create(**CHAT, stream=True))
    assert parts[-1].usage is not None
    assert parts[-1].usage.prompt_tokens == 120


def test_openai_sdk_sees_the_responses_error_event() -> None:
    created, *_ = responses_events()
    stream = created + sse_error_event(Protocol.RESPONSES, 504, "backend_timeout", "too slow")
    client = openai_client(200, stream, stream=True)
    events = list(client.responses.create(model="m", input="hi", stream=True))
    assert [e.type for e in events] == ["response.created", "error"]
    assert events[-1].message == "too slow"


def test_openai_sdk_reads_the_whole_responses_stream() -> None:
    client = openai_client(200, b"".join(responses_events()), stream=True)
    events = list(client.responses.create(model="m", input="hi", stream=True))
    final = events[-1]
    assert final.type == "response.completed"
    assert final.response.usage is not None
    assert final.response.usage.input_tokens == 300


@pytest.mark.parametrize(
    ("status", "error_type", "exception"),
    [
        (400, "invalid_request_error", anthropic.BadRequestError),
        (429, "queue_full", anthropic.RateLimitError),
        (504, "backend_timeout", anthropic.InternalServerError),
    ],
)
def test_anthropic_sdk_reads_the_messages_error_body(
    status: int, error_type: str, exception: type[anthropic.APIStatusError]
) -> None:
    client = anthropic_client(
        status, error_body(Protocol.MESSAGES, status, error_type, "no"), stream=False
    )
    with pytest.raises(exception) as caught:
        client.messages.create(**MESSAGE)
    assert caught.value.body["error"]["message"] == "no"


def test_anthropic_sdk_raises_the_mid_stream_error() -> None:
    start, block_start = messages_events()[:2]
    stream = (
        start + block_start + sse_error_event(Protocol.MESSAGES, 502, "backend_unavailable", "gone")
    )
    client = anthropic_client(200, stream, stream=True)
    with pytest.raises(anthropic.APIStatusError) as caught:
        list(client.messages.create(**MESSAGE, stream=True))
    assert caught.value.body == {"type": "error", "error": {"type": "api_error", "message": "gone"}}


def test_the_messages_tap_agrees_with_the_anthropic_sdk() -> None:
    events = messages_events()
    client = anthropic_client(200, b"".join(events), stream=True)
    with client.messages.stream(**MESSAGE) as stream:
        final = stream.get_final_message()
    tap = MessagesTap(collect_answer=True)
    for event in events:
        tap.feed(event)
    usage = final.usage
    assert tap.usage is not None
    cache_read = usage.cache_read_input_tokens or 0
    cache_write = usage.cache_creation_input_tokens or 0
    assert tap.usage.prompt_tokens == usage.input_tokens + cache_read + cache_write
    assert tap.usage.completion_tokens == usage.output_tokens
    assert tap.usage.cached_tokens == cache_read
    sdk_blocks = [block.model_dump(exclude_none=True) for block in final.content]
    tap_blocks = tap.answer()["content"]
    assert [b["type"] for b in sdk_blocks] == [b["type"] for b in tap_blocks]
    assert sdk_blocks[0]["text"] == tap_blocks[0]["text"]
    assert sdk_blocks[1]["input"] == tap_blocks[1]["input"]
