"""Input Python's json accepts but the proxy cannot keep: lone surrogates in identifiers,
NaN/Infinity, nesting without bound. Each is a 400 naming the field, before anything acts on
it, and the proxy keeps serving."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import query, running_proxy, wait_for
from tests.fakebackend import FakeBackend
from thunderproxy.errors import InvalidRequest
from thunderproxy.http.validate import MAX_JSON_DEPTH, check_identifier, load_json
from thunderproxy.runtime import RunningProxy

#: The smallest chat a backend accepts (an empty conversation is refused at the edge).
HELLO = [{"role": "user", "content": "hi"}]


def nested(depth: int) -> bytes:
    return b"[" * (depth - 1) + b"{}" + b"]" * (depth - 1)


def test_strict_json_accepts_ordinary_bodies() -> None:
    body = b'{"messages": [{"role": "user", "content": "[[[{{"}], "temperature": 0.5}'
    assert load_json(body)["temperature"] == 0.5
    assert load_json(nested(MAX_JSON_DEPTH)) is not None
    assert load_json(b'"\\ud83d\\ude00"') == "😀"  # a surrogate pair is one character


@pytest.mark.parametrize(
    ("raw", "phrase", "param"),
    [
        pytest.param(b'{"temperature": NaN}', "NaN at temperature", "temperature", id="nan"),
        pytest.param(b'{"a": [1, -Infinity]}', "-Infinity at a[1]", "a[1]", id="neg-inf"),
        pytest.param(b'{"a": {"b": 1e999}}', "1e999 at a.b", "a.b", id="overflowing-float"),
        pytest.param(b"Infinity", "the top level", None, id="top-level"),
        pytest.param(nested(MAX_JSON_DEPTH + 1), "more than 64 levels", None, id="depth-65"),
        pytest.param(b"[" * 100_000, "more than 64 levels", None, id="depth-100000"),
    ],
)
def test_strict_json_refuses(raw: bytes, phrase: str, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as caught:
        load_json(raw)
    assert phrase in caught.value.message
    assert caught.value.param == param


def test_identifiers_must_be_unicode_text() -> None:
    assert check_identifier("task-😀", "program_id") == "task-😀"
    with pytest.raises(InvalidRequest) as caught:
        check_identifier("ab\udc80", "model")
    assert caught.value.param == "model"
    assert "'\\udc80' at character 2" in caught.value.message
    caught.value.message.encode("utf-8")  # the message itself is sendable


@pytest.fixture
async def proxy(backend: FakeBackend, tmp_path: Path) -> AsyncIterator[RunningProxy]:
    async with running_proxy(tmp_path / "audit.db", backends=backend.url, datasette=False) as p:
        yield p


MSGS = b'"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param(b'{"program_id": "\\ud800", ' + MSGS + b"}", "program_id", id="pid-body"),
        pytest.param(
            b'{"extra_body": {"program_id": "x\\udfff"}, ' + MSGS + b"}",
            "program_id",
            id="pid-extra-body",
        ),
        pytest.param(b'{"model": "\\ud800", ' + MSGS + b"}", "model", id="model"),
        pytest.param(b'{"user": "u\\udbff", ' + MSGS + b"}", "user", id="user"),
        pytest.param(b'{"temperature": NaN, ' + MSGS + b"}", "temperature", id="nan"),
        pytest.param(b'{"max_tokens": Infinity, ' + MSGS + b"}", "max_tokens", id="infinity"),
        pytest.param(b'{"tools": ' + nested(80) + b", " + MSGS + b"}", None, id="deep"),
    ],
)
async def test_refused_at_the_edge_and_the_proxy_keeps_serving(
    proxy: RunningProxy, backend: FakeBackend, tmp_path: Path, body: bytes, param: str | None
) -> None:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        r = await client.post("/v1/chat/completions", content=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param
        assert error["type"] == "invalid_request_error"
        assert backend.received == []
        ok = await client.post(
            "/v1/chat/completions", json={"messages": HELLO, "program_id": "after"}
        )
        assert ok.status_code == 200
    await wait_for(lambda: proxy.audit.written >= 1 and proxy.audit.statistics().queued == 0)
    await wait_for(lambda: len(query(tmp_path / "audit.db", "SELECT * FROM rejections")) == 1)
    assert proxy.audit.dropped == 0


async def test_header_bytes_reach_the_backend_as_sent(
    proxy: RunningProxy, backend: FakeBackend
) -> None:
    headers = [
        (b"x-note", "Grüße".encode()),  # UTF-8
        (b"x-legacy", b"caf\xe9"),  # latin-1, not UTF-8
        (b"x-program-id", "täsk-😀".encode()),
    ]
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        r = await client.post("/v1/chat/completions", json={"messages": HELLO}, headers=headers)
        assert r.status_code == 200, r.text
        # The server hands values over as latin-1; encoding them back gives the bytes sent.
        seen = {k.lower(): v.encode("latin-1") for k, v in backend.headers[-1].items()}
        assert seen["x-note"] == "Grüße".encode()
        assert seen["x-legacy"] == b"caf\xe9"
        assert "x-program-id" not in seen
        assert "täsk-😀" in (await client.get("/programs")).json()


async def test_a_program_id_header_that_is_not_utf8_is_refused(
    proxy: RunningProxy, backend: FakeBackend
) -> None:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        r = await client.post(
            "/v1/chat/completions", json={"messages": HELLO}, headers=[(b"x-program-id", b"\xff")]
        )
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "x-program-id"
        assert "not UTF-8" in r.json()["error"]["message"]
        assert backend.received == []
