"""Bad input at the HTTP boundary: each gets a clear OpenAI-style error with the right status,
nothing reaches the backend, the refusal is in the audit log, and no traceback leaks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import query, running_proxy
from tests.fakebackend import FakeBackend
from thunderproxy.runtime import RunningProxy

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "audit.db"


@pytest.fixture
async def proxy(backend: FakeBackend, db: Path) -> AsyncIterator[RunningProxy]:
    async with running_proxy(db, backends=backend.url, max_body_bytes=4096) as running:
        yield running


@pytest.fixture
async def client(proxy: RunningProxy) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as c:
        yield c


CASES = [
    pytest.param(b"{not json", 400, None, "not valid JSON", id="malformed-json"),
    pytest.param(b"[1, 2]", 400, None, "JSON object", id="not-an-object"),
    pytest.param(b'{"messages": [], "program_id": 7}', 400, "program_id", "string", id="pid-int"),
    pytest.param(
        b'{"messages": [], "program_id": ""}', 400, "program_id", "string", id="pid-empty"
    ),
    pytest.param(b'{"messages": "hi"}', 400, "messages", "list", id="messages-not-list"),
    pytest.param(b'{"messages": [], "program_id": "p"}', 400, "messages", "non-empty", id="empty"),
    pytest.param(
        b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}',
        400,
        "stream",
        "true or false",
        id="stream",
    ),
    pytest.param(
        b'{"messages": [{"role": "user", "content": "hi"}], "stream_options": 1}',
        400,
        "stream_options",
        "object",
        id="so",
    ),
    pytest.param(b'{"messages": ["\xff\xfe"]}', 400, None, "UTF-8", id="invalid-utf8"),
    pytest.param(b'{"messages": [], "x": "' + b"a" * 5000 + b'"}', 413, None, "4096", id="too-big"),
]


@pytest.mark.parametrize(("body", "status", "param", "phrase"), CASES)
async def test_bad_completion_bodies(
    client: httpx.AsyncClient,
    backend: FakeBackend,
    body: bytes,
    status: int,
    param: str | None,
    phrase: str,
) -> None:
    r = await client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["param"] == param
    assert phrase in error["message"]
    assert "Traceback" not in r.text
    assert backend.received == []


async def test_refusals_are_in_the_audit_log(backend: FakeBackend, db: Path) -> None:
    async with (
        running_proxy(db, backends=backend.url, max_body_bytes=4096) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        await client.post("/v1/chat/completions", content=b"{nope")
        await client.post("/v1/chat/completions", content=b"x" * 5000)
        await client.post("/programs/release", json={"program_id": "never-seen"})
    rows = query(db, "select method, path, status, error_type, program_id from rejections")
    assert rows == [
        {"method": "POST", "path": "/v1/chat/completions", "status": 400,
         "error_type": "invalid_request_error", "program_id": None},
        {"method": "POST", "path": "/v1/chat/completions", "status": 413,
         "error_type": "invalid_request_error", "program_id": None},
        {"method": "POST", "path": "/programs/release", "status": 404,
         "error_type": "not_found_error", "program_id": "never-seen"},
    ]  # fmt: skip


async def test_unknown_program_on_release(client: httpx.AsyncClient) -> None:
    r = await client.post("/programs/release", json={"program_id": "ghost"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "program_id"
    bad = await client.post("/programs/release", json={"program_id": ["ghost"]})
    assert bad.status_code == 400


async def test_huge_headers_are_refused_and_the_server_keeps_serving(
    backend: FakeBackend, db: Path
) -> None:
    async with running_proxy(db, backends=backend.url, max_header_bytes=8192) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as client:
            big = await client.post(
                "/v1/chat/completions", json=CHAT, headers={"X-Big": "a" * 20_000}
            )
            assert big.status_code == 431
            assert "--max-header-bytes" in big.json()["error"]["message"]
            # The request line is part of the head: a long URL counts as a long header does,
            # on the LLM routes (the fast path) and the others (Quart).
            for path in ("/v1/chat/completions", "/health"):
                long_url = await client.post(f"{path}?pad={'b' * 60_000}", json=CHAT)
                assert long_url.status_code == 431, (path, long_url.text[:200])
        # A head that never fits the server's buffer is cut off by the HTTP layer itself.
        host, port = proxy.url.removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000)
            answer = b""
            with trio.fail_after(5):
                while chunk := await stream.receive_some():
                    answer += chunk
        assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
        async with httpx.AsyncClient(base_url=proxy.url) as client:
            assert (await client.get("/health")).status_code == 200
    assert backend.received == []
