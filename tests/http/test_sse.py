"""The OpenAI usage tap, pure: it reads usage wherever the stream is split and hides the usage
chunk only when the client did not ask for it."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from thunderproxy.http.sse import UsageTap, usage_from
from thunderproxy.programs import StepUsage

USAGE = {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}
CONTENT = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
USAGE_CHUNK = b"data: " + json.dumps({"choices": [], "usage": USAGE}).encode() + b"\n\n"
DONE = b"data: [DONE]\n\n"
STREAM = CONTENT + USAGE_CHUNK + DONE


def feed_split(tap: UsageTap, data: bytes, cuts: list[int]) -> bytes:
    out = b""
    start = 0
    for cut in sorted(set(cuts)):
        out += tap.feed(data[start:cut])
        start = cut
    out += tap.feed(data[start:])
    return out + tap.flush()


@settings(deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=8))
def test_usage_is_read_however_the_stream_is_split(cuts: list[int]) -> None:
    shown = UsageTap(hide_usage_chunk=False)
    assert feed_split(shown, STREAM, cuts) == STREAM
    assert shown.usage == StepUsage(12, 3, 8)
    hidden = UsageTap(hide_usage_chunk=True)
    assert feed_split(hidden, STREAM, cuts) == CONTENT + DONE
    assert hidden.usage == StepUsage(12, 3, 8)


def test_an_error_event_is_remembered() -> None:
    tap = UsageTap(hide_usage_chunk=False)
    tap.feed(b'data: {"error": {"message": "EngineCore died"}}\n\n')
    assert tap.error == "EngineCore died"


def test_usage_from_bodies_without_usage_or_with_wrong_types() -> None:
    assert usage_from({"usage": USAGE}) == StepUsage(12, 3, 8)
    assert usage_from({"usage": {"prompt_tokens": "12"}}) is None
    assert usage_from({"choices": []}) is None
    assert usage_from([1, 2]) is None
