"""The HTTP backend's boundary: httpx and trio errors become the BackendError tree, naming the
backend; credentials in a backend URL are never shown."""

from __future__ import annotations

import httpx
import pytest
import trio

from thunderproxy.backends import HttpBackend, map_httpx_errors, redact_url
from thunderproxy.errors import (
    BackendError,
    BackendProtocolError,
    BackendTimeout,
    BackendUnavailable,
)

REQUEST = httpx.Request("GET", "http://b")


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (trio.TooSlowError(), BackendTimeout),
        (httpx.ReadTimeout("t", request=REQUEST), BackendTimeout),
        (httpx.ConnectTimeout("t", request=REQUEST), BackendTimeout),
        (httpx.ConnectError("refused", request=REQUEST), BackendUnavailable),
        (httpx.RemoteProtocolError("cut", request=REQUEST), BackendUnavailable),
        (httpx.ReadError("reset", request=REQUEST), BackendUnavailable),
        (httpx.WriteError("reset", request=REQUEST), BackendUnavailable),
        (httpx.DecodingError("gzip", request=REQUEST), BackendProtocolError),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.__name__,
)
def test_transport_errors_map_to_ours(raised: Exception, expected: type[BackendError]) -> None:
    with pytest.raises(expected) as caught, map_httpx_errors("http://b:1"):
        raise raised
    assert caught.value.backend == "http://b:1"
    assert "http://b:1" in caught.value.message


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://user:pw@gpu0:8000/v1", "http://gpu0:8000/v1"),
        ("https://token@[::1]:9/x?q=1", "https://[::1]:9/x?q=1"),
        ("http://gpu0:8000", "http://gpu0:8000"),
    ],
)
def test_credentials_are_redacted(url: str, shown: str) -> None:
    assert redact_url(url) == shown


async def test_credentials_go_to_the_backend_only_as_basic_auth() -> None:
    backend = HttpBackend("http://user:pw@127.0.0.1:9")
    try:
        assert backend.name == "http://127.0.0.1:9"
        assert "pw" not in str(backend.client.base_url)
        request = backend.client.build_request("GET", "/health")
        flow = backend.client.auth.auth_flow(request)
        assert next(flow).headers["authorization"].startswith("Basic ")
    finally:
        await backend.aclose()
