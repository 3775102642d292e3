"""is_streaming follows its four rules (SSE, NDJSON, chunked, a content type naming "stream"),
and nothing else makes a body a stream."""

from __future__ import annotations

import pytest

from thunderproxy.http.streaming import is_streaming


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({"Content-Type": "text/event-stream"}, id="sse"),
        pytest.param({"content-type": "text/event-stream; charset=utf-8"}, id="sse-params"),
        pytest.param({"Content-Type": "application/x-ndjson"}, id="ndjson"),
        pytest.param(
            {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}, id="chunked"
        ),  # fmt: skip
        pytest.param([("transfer-encoding", "gzip, chunked")], id="chunked-last-coding"),
        pytest.param({"Content-Type": "application/octet-Stream"}, id="stream-in-type"),
        pytest.param({"Content-Type": "application/vnd.example.stream+json"}, id="vendor"),
    ],
)
def test_streams(headers: object) -> None:
    assert is_streaming(headers)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="no-headers"),
        pytest.param({"Content-Type": "application/json"}, id="json"),
        pytest.param({"Content-Type": "application/json", "Content-Length": "12"}, id="sized"),
        pytest.param({"Content-Type": "text/plain", "Transfer-Encoding": "identity"}, id="ident"),
        pytest.param({"X-Stream": "true"}, id="stream-only-in-another-header"),
    ],
)
def test_not_streams(headers: object) -> None:
    assert not is_streaming(headers)  # type: ignore[arg-type]
