"""The taps' fast path: a chunk of whole events that names nothing a tap reads is relayed
without being parsed, and everything the tap reports is what reading each event reports."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderproxy.protocols import ChatTap, MessagesTap, ResponsesTap, SseTap, Usage, base

from .streams import chat_events, chunk, messages_events, responses_events, sse


def tokens(count: int, *, crlf: bool = False) -> list[bytes]:
    return [sse(chunk({"content": f" t{k}"}), crlf=crlf) for k in range(count)]


def usage_only(prompt: int, completion: int) -> bytes:
    # A usage-only chunk spaced as no json.dumps writes it: no space after "data:", spaces
    # around the colons and inside the empty list.
    return (
        b'data:{"id" : "c", "choices" : [ ] , "usage" : {"prompt_tokens" : %d, '
        b'"completion_tokens" : %d}}\n\n' % (prompt, completion)
    )


def chat_stream(crlf: bool = False) -> list[bytes]:
    events = chat_events(crlf=crlf)
    # Tokens after the first content, the usage chunk, [DONE]: the shape the fast path sees.
    return events[:3] + tokens(12, crlf=crlf) + events[3:]


def state(tap: SseTap) -> tuple[Any, ...]:
    return (tap.usage, tap.error, tap.content_started, tap.complete, tap.overflowed)


def slow(tap: SseTap, monkeypatch: pytest.MonkeyPatch) -> SseTap:
    """The same tap, made to read every event (the behaviour the fast path must keep)."""
    monkeypatch.setattr(tap, "_passes", lambda _chunk: False)
    return tap


def relay(tap: SseTap, pieces: list[bytes]) -> tuple[list[bytes], bytes]:
    out = [tap.feed(piece) for piece in pieces]
    return out, tap.flush()


def grouped(events: list[bytes], groups: list[int]) -> list[bytes]:
    """The events joined into reads of whole events, ``groups`` events at a time."""
    pieces, at = [], 0
    for size in groups:
        if at >= len(events):
            break
        pieces.append(b"".join(events[at : at + size]))
        at += size
    if at < len(events):
        pieces.append(b"".join(events[at:]))
    return pieces


TAPS: list[tuple[str, Callable[[bool, bool], SseTap], Callable[[bool], list[bytes]]]] = [
    (
        "chat",
        lambda hide, collect: ChatTap(hide_usage_chunk=hide, collect_answer=collect),
        chat_stream,
    ),
    (
        "messages",
        lambda hide, collect: MessagesTap(collect_answer=collect),
        lambda _: messages_events(),
    ),
    ("responses", lambda hide, collect: ResponsesTap(), lambda _: responses_events()),
]


@settings(max_examples=200, deadline=None)
@given(
    which=st.sampled_from(range(len(TAPS))),
    groups=st.lists(st.integers(min_value=1, max_value=6), max_size=30),
    hide=st.booleans(),
    collect=st.booleans(),
    crlf=st.booleans(),
    cap=st.sampled_from([base.MAX_EVENT_BYTES, 400]),
)
def test_whole_event_reads_relay_and_report_as_reading_each_event(
    which: int, groups: list[int], hide: bool, collect: bool, crlf: bool, cap: int
) -> None:
    _, make, stream = TAPS[which]
    events = stream(crlf)
    pieces = grouped(events, groups)
    fast = make(hide, collect)
    fast.max_event_bytes = cap
    with pytest.MonkeyPatch.context() as patch:
        reference = slow(make(hide, collect), patch)
        reference.max_event_bytes = cap
        expected = relay(reference, pieces)
    assert relay(fast, pieces) == expected
    assert state(fast) == state(reference)
    assert fast.answer() == reference.answer()


def test_token_chunks_after_the_first_are_not_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[bytes] = []
    original = base.parse_event

    def counting(raw: bytes) -> base.SseEvent:
        parsed.append(raw)
        return original(raw)

    monkeypatch.setattr(base, "parse_event", counting)
    tap = ChatTap(hide_usage_chunk=True)
    head = chat_events()[:2]  # the role chunk, then the first content
    for event in head:
        assert tap.feed(event) == event
    assert tap.content_started
    assert len(parsed) == 2
    for event in tokens(20):
        assert tap.feed(event) == event
    assert len(parsed) == 2  # relayed unread
    assert tap.feed(usage_only(7, 20)) == b""  # hidden: read
    assert tap.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
    assert len(parsed) == 4
    assert tap.usage == Usage(prompt_tokens=7, completion_tokens=20, cached_tokens=None)
    assert tap.complete


def test_a_usage_marker_split_across_two_reads_is_read_and_hidden() -> None:
    tap = ChatTap(hide_usage_chunk=True)
    before = chat_events()[:2] + tokens(3)
    event = usage_only(11, 3)
    cut = event.index(b'"usage"') + 3  # the marker itself is cut: '"us' | 'age"'
    out = [tap.feed(e) for e in before]
    out.append(tap.feed(before[-1] + event[:cut]))  # one more token, then half the usage
    out.append(tap.feed(event[cut:]))
    assert b"".join(out) == b"".join(before) + before[-1]
    assert tap.usage == Usage(prompt_tokens=11, completion_tokens=3, cached_tokens=None)


def test_a_token_read_that_ends_mid_event_is_held_then_relayed_whole() -> None:
    tap = ChatTap(hide_usage_chunk=True)
    for event in chat_events()[:2]:
        tap.feed(event)
    first, second = tokens(2)
    assert tap.feed(first + second[:9]) == first
    assert tap.feed(second[9:]) == second


def test_the_last_usage_wins_when_every_chunk_carries_one() -> None:
    """``continuous_usage_stats``: each token chunk has usage; none of them may be skipped."""
    tap = ChatTap(hide_usage_chunk=True)
    out = []
    for k in range(1, 6):
        payload = chunk({"content": f" t{k}"})
        payload["usage"] = {"prompt_tokens": 5, "completion_tokens": k}
        event = sse(payload)
        out.append(tap.feed(event))
        assert out[-1] == event  # a chunk with choices is never hidden
    assert tap.usage == Usage(prompt_tokens=5, completion_tokens=5, cached_tokens=None)


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: ChatTap(hide_usage_chunk=False), sse({"error": {"message": "boom"}})),
        (MessagesTap, sse({"type": "error", "error": {"message": "boom"}}, "error")),
        (ResponsesTap, sse({"type": "error", "code": "x", "message": "boom"}, "error")),
    ],
)
def test_an_error_after_the_first_token_is_read(make: Callable[[], SseTap], error: bytes) -> None:
    tap = make()
    content = {
        ChatTap: sse(chunk({"content": "hi"})),
        MessagesTap: sse(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "hi"},
            },
            "content_block_delta",
        ),
        ResponsesTap: sse({"type": "response.output_text.delta", "delta": "hi"}),
    }[type(tap)]
    tap.feed(content)
    assert tap.content_started
    tap.feed(content + error)  # the error read together with a token before it
    assert tap.error == "boom"


def test_generated_text_that_names_a_marker_is_read_not_mistaken() -> None:
    tap = ChatTap(hide_usage_chunk=True)
    for event in chat_events()[:2]:
        tap.feed(event)
    text = sse(chunk({"content": 'the "usage" of [DONE] and "error"'}))
    assert tap.feed(text) == text
    assert tap.usage is None
    assert tap.error is None
    assert not tap.complete


def test_a_read_ending_in_blank_lines_after_a_blank_line_takes_the_reading_path() -> None:
    """``\\n\\n\\n`` leaves a partial line the next event starts with: read as before."""
    tap = ChatTap(hide_usage_chunk=True)
    for event in chat_events()[:2]:
        tap.feed(event)
    token = tokens(1)[0]
    assert tap.feed(token + b"\n") == token
    usage = usage_only(1, 1)
    assert tap.feed(usage) == b""  # the held newline went with the hidden event, as before
    assert tap.usage == Usage(prompt_tokens=1, completion_tokens=1, cached_tokens=None)
