"""The stream taps: same result however the bytes are split, linear scanning, the event cap,
refused usage, upstream errors, and the moment content starts."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderproxy.protocols import (
    MAX_TOKENS,
    ChatTap,
    MessagesTap,
    Protocol,
    ResponsesTap,
    SseTap,
    Usage,
    base,
    new_tap,
    prepare,
    read_usage,
    usage_from_body,
)

from .streams import (
    CHAT_ANSWER,
    CHAT_USAGE,
    MESSAGES_ANSWER,
    RESPONSE_OUTPUT,
    chat_events,
    chunk,
    messages_events,
    responses_events,
    sse,
)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:], strict=False)]


def run(tap: SseTap, pieces: list[bytes]) -> bytes:
    return b"".join(tap.feed(p) for p in pieces) + tap.flush()


cuts = st.lists(st.integers(min_value=0, max_value=4000), max_size=40)


@settings(max_examples=150, deadline=None)
@given(cuts=cuts, crlf=st.booleans(), hide=st.booleans())
def test_chat_tap_reads_the_same_whatever_the_split(
    cuts: list[int], crlf: bool, hide: bool
) -> None:
    events = chat_events(crlf=crlf)
    stream = b"".join(events)
    tap = ChatTap(hide_usage_chunk=hide, collect_answer=True)
    out = run(tap, split(stream, cuts))
    expected = b"".join(e for e in events if b'"usage"' not in e) if hide else stream
    assert out == expected
    assert tap.usage == Usage(prompt_tokens=120, completion_tokens=9, cached_tokens=96)
    assert tap.error is None
    assert tap.content_started
    assert tap.answer() == CHAT_ANSWER


@settings(max_examples=150, deadline=None)
@given(cuts=cuts)
def test_messages_tap_reads_the_same_whatever_the_split(cuts: list[int]) -> None:
    stream = b"".join(messages_events())
    tap = MessagesTap(collect_answer=True)
    assert run(tap, split(stream, cuts)) == stream
    # Anthropic's input_tokens leave out the cache: the prompt is all three counts together.
    assert tap.usage == Usage(prompt_tokens=124, completion_tokens=15, cached_tokens=100)
    assert tap.error is None
    assert tap.content_started
    assert tap.answer() == MESSAGES_ANSWER


@settings(max_examples=150, deadline=None)
@given(cuts=cuts)
def test_responses_tap_reads_the_same_whatever_the_split(cuts: list[int]) -> None:
    stream = b"".join(responses_events())
    tap = ResponsesTap()
    assert run(tap, split(stream, cuts)) == stream
    assert tap.usage == Usage(prompt_tokens=300, completion_tokens=12, cached_tokens=256)
    assert tap.response_id == "resp_1"
    assert tap.answer() == RESPONSE_OUTPUT
    assert tap.error is None
    assert tap.content_started


def test_without_hiding_each_event_is_forwarded_whole_as_soon_as_it_ends() -> None:
    # A partial event is held: a client cannot read it before its blank line anyway, and one
    # that grows past the bound is then dropped whole rather than cut (the client's SSE parser
    # would choke on the half it had).
    tap = ChatTap(hide_usage_chunk=False)
    stream = b"".join(chat_events())
    out = [tap.feed(piece) for piece in split(stream, [7, 100, 101, 350, 900])]
    assert b"".join(out) + tap.flush() == stream
    assert all(piece == b"" or piece.endswith(b"\n\n") for piece in out)
    first, second = chat_events()[:2]
    again = ChatTap(hide_usage_chunk=False)
    assert again.feed(first + second[:10]) == first
    assert again.feed(second[10:]) == second


def test_hiding_forwards_each_event_as_soon_as_it_ends() -> None:
    first, second = chat_events()[:2]
    tap = ChatTap(hide_usage_chunk=True)
    assert tap.feed(first + second[:10]) == first
    assert tap.feed(second[10:]) == second


@pytest.mark.parametrize(
    ("make", "events"),
    [
        pytest.param(lambda: ChatTap(hide_usage_chunk=False), chat_events, id="chat"),
        pytest.param(MessagesTap, messages_events, id="messages"),
        pytest.param(ResponsesTap, responses_events, id="responses"),
    ],
)
def test_content_starts_with_the_first_generated_output(
    make: Callable[[], SseTap], events: Callable[[], list[bytes]]
) -> None:
    tap = make()
    started = []
    for event in events():
        tap.feed(event)
        started.append(tap.content_started)
    first = started.index(True)
    assert not any(started[:first])
    assert all(started[first:])
    assert b"Let me" in events()[first]  # the first event with text, not the role or the start


def test_scanning_is_linear_in_the_bytes_fed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 200 KB event arriving 16 bytes at a time: every byte is searched a bounded number of
    times, not once per chunk (which would be some 6 GB of searching)."""
    scanned = 0
    real = base._EVENT_END

    class Counting:
        def search(self, buffer: bytearray, pos: int) -> re.Match[bytes] | None:
            nonlocal scanned
            match = real.search(buffer, pos)
            scanned += (match.end() if match else len(buffer)) - pos
            return match

    monkeypatch.setattr(base, "_EVENT_END", Counting())
    text = "x" * 200_000
    stream = sse(chunk({"content": text})) + sse(CHAT_USAGE) + sse("[DONE]")
    tap = ChatTap(hide_usage_chunk=True)
    out = run(tap, split(stream, list(range(0, len(stream), 16))))
    assert scanned <= 4 * len(stream)
    assert tap.usage is not None
    assert tap.usage.prompt_tokens == 120
    assert json.loads(out.split(b"\n\n")[0][6:])["choices"][0]["delta"]["content"] == text


@pytest.mark.parametrize("hide", [True, False])
def test_an_event_past_the_cap_is_dropped_whole_and_the_stream_given_up(hide: bool) -> None:
    tap = ChatTap(hide_usage_chunk=hide, max_event_bytes=256)
    huge = sse(chunk({"content": "y" * 1000}))
    rest = sse(CHAT_USAGE) + sse("[DONE]")
    before = sse(chunk({"content": "a"}))
    stream = before + huge + rest
    out = b""
    for piece in split(stream, list(range(0, len(stream), 50))):
        out += tap.feed(piece)
        if tap.overflowed:
            break  # the gateway ends the stream here with the protocol's error event
    assert out == before
    assert tap.error is not None
    assert "256 bytes" in tap.error
    assert tap.usage is None  # the usage chunk came after the stream was given up


def test_negative_usage_is_refused_for_the_whole_call() -> None:
    bad = {**CHAT_USAGE, "usage": {"prompt_tokens": -3, "completion_tokens": 2}}
    tap = ChatTap(hide_usage_chunk=False)
    run(tap, [sse(bad), sse(CHAT_USAGE)])
    assert tap.usage is None
    assert tap.error is not None
    assert "negative" in tap.error


def test_negative_anthropic_output_is_refused() -> None:
    events = messages_events()
    events[-2] = sse({"type": "message_delta", "delta": {}, "usage": {"output_tokens": -1}})
    tap = MessagesTap()
    run(tap, events)
    assert tap.usage is None
    assert tap.error is not None
    assert "negative" in tap.error


def test_absurd_counts_are_clamped_and_cached_never_exceeds_the_prompt() -> None:
    usage = {
        "prompt_tokens": 10**15,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 10**16},
    }
    tap = ChatTap(hide_usage_chunk=False)
    run(tap, [sse({"choices": [], "usage": usage})])
    assert tap.usage == Usage(
        prompt_tokens=MAX_TOKENS, completion_tokens=5, cached_tokens=MAX_TOKENS
    )


def test_non_integer_counts_are_missing_not_numbers() -> None:
    tap = ChatTap(hide_usage_chunk=False)
    run(tap, [sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": True}})])
    assert tap.usage == Usage(prompt_tokens=7, completion_tokens=None, cached_tokens=None)


@pytest.mark.parametrize(
    ("tap", "event", "message"),
    [
        pytest.param(
            ChatTap(hide_usage_chunk=True),
            sse({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}),
            "engine died",
            id="chat",
        ),
        pytest.param(
            MessagesTap(),
            sse(
                {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
                "error",
            ),
            "Overloaded",
            id="messages",
        ),
        pytest.param(
            ResponsesTap(),
            sse(
                {"type": "error", "code": "server_error", "message": "boom", "param": None}, "error"
            ),
            "boom",
            id="responses-error",
        ),
        pytest.param(
            ResponsesTap(),
            sse(
                {
                    "type": "response.failed",
                    "response": {
                        "id": "resp_9",
                        "error": {"code": "server_error", "message": "ran out"},
                    },
                },
                "response.failed",
            ),
            "ran out",
            id="responses-failed",
        ),
    ],
)
def test_upstream_error_events_are_reported(tap: SseTap, event: bytes, message: str) -> None:
    out = run(tap, split(event, [5, 17]))
    assert tap.error == message
    assert out == event  # errors are the client's to see too


def test_a_trailing_event_without_its_blank_line_is_still_read() -> None:
    tap = ChatTap(hide_usage_chunk=True)
    body = sse(chunk({"content": "hi"}))
    out = run(tap, [body, sse(CHAT_USAGE).rstrip(b"\n")])
    assert out == body
    assert tap.usage is not None
    assert tap.usage.completion_tokens == 9


def test_new_tap_follows_the_prepared_call() -> None:
    chat = prepare(Protocol.CHAT, {"messages": [{"role": "user", "content": "hi"}], "stream": True})
    tap = new_tap(chat)
    assert isinstance(tap, ChatTap)
    assert tap.hide_usage_chunk
    messages = prepare(
        Protocol.MESSAGES,
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert isinstance(new_tap(messages), MessagesTap)
    assert isinstance(new_tap(prepare(Protocol.RESPONSES, {"input": "hi"})), ResponsesTap)


def test_usage_from_non_streamed_bodies() -> None:
    chat = {
        "choices": [{"message": {"role": "assistant", "content": "x"}}],
        "usage": CHAT_USAGE["usage"],
    }
    assert usage_from_body(Protocol.CHAT, chat) == Usage(120, 9, 96)
    message = {
        "content": [],
        "usage": {"input_tokens": 10, "output_tokens": 4, "cache_read_input_tokens": 30},
    }
    assert usage_from_body(Protocol.MESSAGES, message) == Usage(40, 4, 30)
    response = {"id": "resp_1", "output": [], "usage": {"input_tokens": 8, "output_tokens": 2}}
    assert usage_from_body(Protocol.RESPONSES, response) == Usage(8, 2, None)
    assert usage_from_body(Protocol.CHAT, {"choices": []}) is None
    usage, problem = read_usage(
        Protocol.RESPONSES, {"usage": {"input_tokens": -1, "output_tokens": 2}}
    )
    assert usage is None
    assert problem is not None
    assert "negative" in problem


def test_a_null_error_field_is_no_error() -> None:
    tap = ChatTap(hide_usage_chunk=False)
    run(tap, [sse({**chunk({"content": "x"}), "error": None})])
    assert tap.error is None


def test_usage_read_before_an_over_long_event_is_not_reported_as_the_whole() -> None:
    events = messages_events()
    events.insert(
        3,
        sse(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "z" * 500},
            }
        ),
    )
    tap = MessagesTap(max_event_bytes=300)
    out = b""
    for event in events:
        out += tap.feed(event)
        if tap.overflowed:
            break
    assert out == b"".join(events[:3])
    assert tap.usage is None
    assert tap.error is not None


@settings(max_examples=150, deadline=None)
@given(cuts=cuts, cap=st.integers(min_value=40, max_value=1500), hide=st.booleans())
def test_whatever_the_cap_and_split_the_client_gets_the_stream(
    cuts: list[int], cap: int, hide: bool
) -> None:
    events = chat_events()
    events.insert(2, sse(chunk({"content": "w" * 700})))
    stream = b"".join(events)
    tap = ChatTap(hide_usage_chunk=hide, max_event_bytes=cap)
    out = b""
    for piece in split(stream, cuts):
        out += tap.feed(piece)
        if tap.overflowed:
            break  # the gateway ends the stream here
    else:
        out += tap.flush()
    overflowed = tap.error is not None
    too_long = [len(e) - 2 > cap for e in events]  # an event, less its blank line
    assert overflowed == any(too_long)
    # The client gets the complete events before the first too long, none of it.
    relayed = events[: too_long.index(True)] if overflowed else events
    if hide:
        relayed = [e for e in relayed if b'"usage"' not in e]
    assert out == b"".join(relayed)
    assert (tap.usage is None) == overflowed


def test_a_trailing_event_past_the_cap_is_dropped() -> None:
    tail = b"data: " + b"v" * 96  # 102 bytes, and the stream ends without a blank line
    tap = ChatTap(hide_usage_chunk=True, max_event_bytes=100)
    assert run(tap, [tail]) == b""
    assert tap.overflowed
    assert tap.error is not None
