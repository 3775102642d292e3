"""Bounded streams: the usage tap reads each byte once, holds at most one unfinished event of
bounded size, and does not believe impossible usage counts."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import query, running_proxy, wait_for
from tests.fuzzbackend import Answer, FuzzBackend, serve_fuzz_backend
from thunderproxy.errors import BackendProtocolError
from thunderproxy.http import sse
from thunderproxy.http.sse import (
    MAX_USAGE_TOKENS,
    UsageTap,
    read_usage,
    usage_from_body,
)
from thunderproxy.programs import StepUsage
from thunderproxy.runtime import RunningProxy

USAGE = {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}


def event(payload: Any, end: bytes = b"\n\n") -> bytes:
    return b"data: " + json.dumps(payload).encode() + end


CONTENT = [
    event({"choices": [{"delta": {"content": "he"}}]}),
    b": keep-alive comment\r\n\r\n",
    event({"choices": [{"delta": {"content": "llo"}}]}, b"\r\n\r\n"),
    event({"choices": [{"delta": {"content": "!"}}]}, b"\n\r\n"),
]
USAGE_CHUNK = event({"choices": [], "usage": USAGE}, b"\r\n\n")
STREAM = b"".join(CONTENT) + USAGE_CHUNK + b"data: [DONE]\n\n"


def run_tap(tap: UsageTap, pieces: list[bytes]) -> bytes:
    return b"".join(tap.feed(piece) for piece in pieces) + tap.flush()


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *cuts})
    return [data[a:b] for a, b in zip(points, points[1:], strict=False)]


@settings(max_examples=300, deadline=None)
@given(cuts=st.lists(st.integers(0, len(STREAM)), max_size=12), hide=st.booleans())
def test_any_chunk_split_gives_the_same_stream_and_usage(cuts: list[int], hide: bool) -> None:
    tap = UsageTap(hide_usage_chunk=hide)
    out = run_tap(tap, split(STREAM, cuts))
    assert out == (STREAM.replace(USAGE_CHUNK, b"") if hide else STREAM)
    assert tap.usage == StepUsage(12, 3, 8)
    assert tap.error is None


def test_only_whole_events_are_passed_on() -> None:
    tap = UsageTap(hide_usage_chunk=False)
    first = CONTENT[0]
    assert tap.feed(first[:-1]) == b""
    assert tap.feed(first[-1:] + b"data: {") == first
    assert tap.flush() == b"data: {"  # a tail with no end still reaches the client, at the end


class CountingPattern:
    """The real event-end pattern, counting the bytes each search may look at."""

    def __init__(self, pattern: re.Pattern[bytes]) -> None:
        self.pattern = pattern
        self.scanned = 0

    def search(self, data: bytearray, pos: int) -> re.Match[bytes] | None:
        self.scanned += len(data) - pos
        return self.pattern.search(data, pos)


def test_scanning_is_linear_in_the_bytes_relayed(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = CountingPattern(sse._EVENT_END)
    monkeypatch.setattr(sse, "_EVENT_END", counter)
    tap = UsageTap(hide_usage_chunk=True)
    event_bytes = b'data: {"choices": [{"delta": {"content": "' + b"x" * 200_000 + b'"}}]}\n\n'
    pieces = [event_bytes[i : i + 100] for i in range(0, len(event_bytes), 100)]
    assert run_tap(tap, pieces) == event_bytes
    # Rescanning the held event on every chunk would be ~2,000 x 100 KB = 200 MB.
    assert counter.scanned <= len(event_bytes) + 4 * len(pieces)


def test_an_unterminated_event_past_the_bound_is_refused() -> None:
    tap = UsageTap(hide_usage_chunk=False, max_event_bytes=1000)
    assert tap.feed(CONTENT[0]) == CONTENT[0]
    tap.feed(b"data: " + b"a" * 900)
    with pytest.raises(BackendProtocolError) as caught:
        tap.feed(b"a" * 200)
    assert "1106 bytes of one SSE event without ending it (the limit is 1000)" in str(caught.value)
    assert tap.flush() == b""  # nothing of the refused event is held or passed on


def test_a_huge_unterminated_event_is_refused_at_the_default_bound() -> None:
    tap = UsageTap(hide_usage_chunk=True)
    chunk = b"x" * 65_536
    # 50 MB, as a broken backend sent it: refused once just past the bound, in linear time.
    for _ in range(sse.MAX_EVENT_BYTES // len(chunk)):
        assert tap.feed(chunk) == b""
    with pytest.raises(BackendProtocolError):
        tap.feed(chunk)


@pytest.mark.parametrize(
    ("usage", "expected", "note"),
    [
        pytest.param(USAGE, StepUsage(12, 3, 8), None, id="ordinary"),
        pytest.param({"prompt_tokens": -1}, None, "negative usage (prompt_tokens)", id="neg"),
        pytest.param(
            {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": -3}},
            None,
            "negative usage (cached_tokens)",
            id="neg-cached",
        ),
        pytest.param(
            {"prompt_tokens": 2**64, "completion_tokens": 2**31 + 1},
            StepUsage(MAX_USAGE_TOKENS, MAX_USAGE_TOKENS, None),
            "over 2^31 tokens (prompt_tokens, completion_tokens); clamped",
            id="huge",
        ),
        pytest.param({"prompt_tokens": True}, None, None, id="bool"),
        pytest.param({"prompt_tokens": 1.5}, None, None, id="float"),
        pytest.param({"prompt_tokens": 4, "completion_tokens": "x"}, StepUsage(4), None, id="str"),
    ],
)
def test_usage_counts_are_checked(
    usage: dict[str, Any], expected: StepUsage | None, note: str | None
) -> None:
    got, got_note = read_usage({"usage": usage})
    assert got == expected
    assert (got_note is None) == (note is None)
    if note is not None:
        assert got_note is not None
        assert note in got_note


def test_a_stream_with_negative_usage_hides_the_chunk_and_notes_it() -> None:
    bad = event({"choices": [], "usage": {"prompt_tokens": -5}})
    tap = UsageTap(hide_usage_chunk=True)
    out = run_tap(tap, [CONTENT[0], bad, b"data: [DONE]\n\n"])
    assert out == CONTENT[0] + b"data: [DONE]\n\n"
    assert tap.usage is None
    assert tap.error == "backend reported negative usage (prompt_tokens); usage ignored"


def test_upstream_error_and_usage_note_are_both_kept() -> None:
    tap = UsageTap(hide_usage_chunk=False)
    tap.feed(event({"choices": [], "usage": {"prompt_tokens": 2**40}}))
    tap.feed(event({"error": {"message": "engine died \ud800"}}))
    assert tap.usage == StepUsage(MAX_USAGE_TOKENS)
    assert tap.error == (
        "engine died \ud800; backend reported usage over 2^31 tokens (prompt_tokens); "
        "clamped to 2^31"
    )


@pytest.mark.parametrize(
    ("body", "usage", "note"),
    [
        pytest.param(json.dumps({"usage": USAGE}).encode(), StepUsage(12, 3, 8), None, id="ok"),
        pytest.param(b"[" * 100_000, None, "not JSON", id="too-deep"),
        pytest.param(b"\xff", None, "not JSON", id="bytes"),
        pytest.param(b'{"usage": {"prompt_tokens": -2}}', None, "negative", id="negative"),
    ],
)
def test_non_streamed_bodies_get_the_same_checks(
    body: bytes, usage: StepUsage | None, note: str | None
) -> None:
    got, got_note = usage_from_body(body)
    assert got == usage
    assert (got_note is None) == (note is None)
    if note is not None:
        assert got_note is not None
        assert note in got_note


# --- end to end, through a running proxy -------------------------------------------------------


@pytest.fixture
async def fuzz(nursery: trio.Nursery) -> FuzzBackend:
    state = FuzzBackend()
    await nursery.start(serve_fuzz_backend, state)
    return state


@pytest.fixture
async def proxy(fuzz: FuzzBackend, tmp_path: Path) -> AsyncIterator[RunningProxy]:
    async with running_proxy(tmp_path / "audit.db", backends=fuzz.url, datasette=False) as p:
        yield p


def step_row(db: Path, program_id: str) -> dict[str, Any]:
    rows = query(db, "SELECT * FROM steps WHERE program_id = ?", program_id)
    assert len(rows) == 1
    return rows[0]


async def test_a_50mb_event_ends_the_stream_cleanly_as_a_backend_fault(
    fuzz: FuzzBackend, proxy: RunningProxy, tmp_path: Path
) -> None:
    first = CONTENT[0]
    fuzz.answers["huge"] = Answer(
        content_type="text/event-stream",
        pieces=(first, b'data: {"choices": [{"delta": {"content": "'),
        filler=b"y" * 65_536,
        filler_count=800,  # 50 MB, never ended
    )
    request = {"messages": [], "stream": True, "program_id": "huge"}
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
            r = await client.post(
                "/v1/chat/completions", json=request, headers={"x-fuzz-case": "huge"}
            )
            assert r.status_code == 200
            assert r.content.startswith(first)
            rest = r.content[len(first) :]
            assert rest.endswith(b"\n\ndata: [DONE]\n\n")
            error = json.loads(rest.split(b"\n\n")[0][len(b"data: ") :])["error"]
            assert error["code"] == 502
            assert "without ending it" in error["message"]
            health = await client.get("/health")
            assert health.status_code == 200
    await wait_for(lambda: proxy.audit.written >= 4)
    row = step_row(tmp_path / "audit.db", "huge")
    assert row["status"] == 502
    assert "without ending it" in row["error"]


async def test_impossible_usage_is_noted_not_believed(
    fuzz: FuzzBackend, proxy: RunningProxy, tmp_path: Path
) -> None:
    fuzz.answers["negative"] = Answer(
        content_type="text/event-stream",
        pieces=(
            CONTENT[0],
            event({"choices": [], "usage": {"prompt_tokens": -7}}),
            b"data: [DONE]\n\n",
        ),
    )
    fuzz.answers["huge"] = Answer(
        pieces=(json.dumps({"usage": {"prompt_tokens": 2**64}}).encode(),)
    )
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        streamed = await client.post(
            "/v1/chat/completions",
            json={"messages": [], "stream": True, "program_id": "negative"},
            headers={"x-fuzz-case": "negative"},
        )
        assert streamed.content == CONTENT[0] + b"data: [DONE]\n\n"
        plain = await client.post(
            "/v1/chat/completions",
            json={"messages": [], "program_id": "huge"},
            headers={"x-fuzz-case": "huge"},
        )
        assert plain.status_code == 200
    db = tmp_path / "audit.db"
    await wait_for(lambda: len(query(db, "SELECT * FROM steps")) == 2)
    negative = step_row(db, "negative")
    assert (negative["status"], negative["prompt_tokens"]) == (200, None)
    assert "negative usage" in negative["error"]
    huge = step_row(db, "huge")
    assert (huge["status"], huge["prompt_tokens"]) == (200, MAX_USAGE_TOKENS)
    assert "clamped to 2^31" in huge["error"]
