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
            assert "larger than the proxy reads" in error["message"]
            health = await client.get("/health")
            assert health.status_code == 200
    db = tmp_path / "audit.db"
    # The step's own row, not a count of records: its program's transitions and decisions are
    # written in no fixed order beside it (waiting for four records once read the db first).
    await wait_for(lambda: bool(query(db, "SELECT 1 FROM steps WHERE program_id = 'huge'")))
    row = step_row(db, "huge")
    assert row["status"] == 502
    assert "larger than the proxy reads" in row["error"]


async def test_an_endless_event_relayed_as_it_came_is_closed_before_the_error(
    fuzz: FuzzBackend, proxy: RunningProxy
) -> None:
    # With the usage chunk asked for, nothing is hidden and bytes pass as they arrive, so part
    # of the endless event is already out when the bound is reached: the error event must still
    # be an event of its own, which the client's SSE parser reads.
    fuzz.answers["half"] = Answer(
        content_type="text/event-stream",
        pieces=(CONTENT[0], b'data: {"choices": [{"delta": {"content": "'),
        filler=b"y" * 65_536,
        filler_count=40,  # 2.6 MB, never ended
    )
    request = {
        "messages": HELLO,
        "stream": True,
        "stream_options": {"include_usage": True},
        "program_id": "half",
    }
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        r = await client.post("/v1/chat/completions", json=request, headers={"x-fuzz-case": "half"})
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
