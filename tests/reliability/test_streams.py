"""Bounded streams, end to end: an upstream event without end ends the stream cleanly as a
backend fault, and impossible usage counts are noted, not believed. (The taps themselves, split
anywhere, linear in the bytes, with their caps, are tested in tests/protocols.)"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import query, running_proxy, wait_for
from tests.fuzzbackend import Answer, FuzzBackend, serve_fuzz_backend
from thunderproxy.protocols.base import MAX_TOKENS
from thunderproxy.runtime import RunningProxy

USAGE = {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}

#: The smallest chat a backend accepts (an empty conversation is refused at the edge).
HELLO = [{"role": "user", "content": "hi"}]


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
    request = {"messages": HELLO, "stream": True, "program_id": "huge"}
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
            assert "larger than the proxy relays" in error["message"]
            health = await client.get("/health")
            assert health.status_code == 200
    db = tmp_path / "audit.db"
    # The step's own row, not a count of records: its program's transitions and decisions are
    # written in no fixed order beside it (waiting for four records once read the db first).
    await wait_for(lambda: bool(query(db, "SELECT 1 FROM steps WHERE program_id = 'huge'")))
    row = step_row(db, "huge")
    assert row["status"] == 502
    assert "larger than the proxy relays" in row["error"]


async def test_an_endless_event_with_nothing_hidden_is_dropped_before_the_error(
    fuzz: FuzzBackend, proxy: RunningProxy
) -> None:
    # With the usage chunk asked for, nothing is hidden; the endless event is still held, not
    # relayed in part, so the error event is an event of its own that the client's SSE parser
    # reads, after the complete events before it.
    fuzz.answers["half"] = Answer(
        content_type="text/event-stream",
        pieces=(CONTENT[0], b'data: {"choices": [{"delta": {"content": "'),
        filler=b"y" * 65_536,
        filler_count=540,  # 35 MB, past the 32 MiB bound, never ended
    )
    request = {
        "messages": HELLO,
        "stream": True,
        "stream_options": {"include_usage": True},
        "program_id": "half",
    }
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        r = await client.post("/v1/chat/completions", json=request, headers={"x-fuzz-case": "half"})
    assert r.content.startswith(CONTENT[0])
    assert b"yyyy" not in r.content
    events = r.content.split(b"\n\n")
    assert events[-1] == b""
    assert events[-2] == b"data: [DONE]"
    error = json.loads(events[-3].removeprefix(b"data: "))["error"]
    assert error["code"] == 502


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
            json={"messages": HELLO, "stream": True, "program_id": "negative"},
            headers={"x-fuzz-case": "negative"},
        )
        assert streamed.content == CONTENT[0] + b"data: [DONE]\n\n"
        plain = await client.post(
            "/v1/chat/completions",
            json={"messages": HELLO, "program_id": "huge"},
            headers={"x-fuzz-case": "huge"},
        )
        assert plain.status_code == 200
    db = tmp_path / "audit.db"
    await wait_for(lambda: len(query(db, "SELECT * FROM steps")) == 2)
    negative = step_row(db, "negative")
    assert (negative["status"], negative["prompt_tokens"]) == (200, None)
    assert "negative token counts" in negative["error"]
    huge = step_row(db, "huge")
    assert (huge["status"], huge["prompt_tokens"]) == (200, MAX_TOKENS)
    assert "clamped" in huge["error"]


def sse_named(name: str, payload: Any) -> bytes:
    return f"event: {name}\n".encode() + event(payload)


#: One event of 16 MiB: a tool call's arguments or a file's text in one delta, or a Responses
#: ``response.completed`` repeating a long answer. At a 1 MiB bound they were cut.
BIG = "y" * (16 << 20)

BIG_STREAMS = {
    "/v1/chat/completions": b"".join(
        [
            CONTENT[0],
            event({"choices": [{"delta": {"content": BIG}}]}),
            USAGE_CHUNK,
            b"data: [DONE]\n\n",
        ]
    ),
    "/v1/messages": b"".join(
        [
            sse_named(
                "message_start",
                {"type": "message_start", "message": {"usage": {"input_tokens": 5}}},
            ),
            sse_named(
                "content_block_delta",
                {"type": "content_block_delta", "delta": {"type": "text_delta", "text": BIG}},
            ),
            sse_named("message_delta", {"type": "message_delta", "usage": {"output_tokens": 2}}),
            sse_named("message_stop", {"type": "message_stop"}),
        ]
    ),
    "/v1/responses": b"".join(
        [
            sse_named(
                "response.output_text.delta", {"type": "response.output_text.delta", "delta": "a"}
            ),
            sse_named(
                "response.completed",
                {
                    "type": "response.completed",
                    "response": {
                        "id": "resp_big",
                        "output": [{"type": "message", "content": [{"text": BIG}]}],
                        "usage": {"input_tokens": 5, "output_tokens": 2},
                    },
                },
            ),
        ]
    ),
}


@pytest.mark.parametrize("path", list(BIG_STREAMS))
async def test_a_16_mib_event_is_relayed_whole_on_every_protocol(
    fuzz: FuzzBackend, proxy: RunningProxy, tmp_path: Path, path: str
) -> None:
    stream = BIG_STREAMS[path]
    fuzz.answers["big"] = Answer(content_type="text/event-stream", pieces=(stream,))
    request: dict[str, Any] = {"messages": HELLO, "stream": True, "max_tokens": 8}
    if path == "/v1/chat/completions":
        request["stream_options"] = {"include_usage": True}  # else the usage chunk is hidden
    if path == "/v1/responses":
        request = {"input": "hi", "stream": True}
    headers = {"x-fuzz-case": "big", "x-program-id": "big"}
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
            r = await client.post(path, json={"model": "m", **request}, headers=headers)
    assert r.status_code == 200
    assert r.content == stream
    db = tmp_path / "audit.db"
    await wait_for(lambda: bool(query(db, "SELECT 1 FROM steps WHERE program_id = 'big'")))
    row = step_row(db, "big")
    assert (row["status"], row["error"]) == (200, None)
