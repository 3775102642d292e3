"""An httpx client over any backend (``BackendTransport``): what worker mode's benchmark is
handed, so that its requests go through the backend seam."""

from __future__ import annotations

import httpx
import pytest

from thunderproxy.backends import UpstreamRequest
from thunderproxy.backends.mock import MockBackend, MockResponse
from thunderproxy.backends.transport import backend_client
from thunderproxy.errors import BackendTimeout, BackendUnavailable


async def test_an_httpx_client_over_a_backend_sends_through_it() -> None:
    backend = MockBackend(lambda request: MockResponse.json({"echo": request.content.decode()}))
    async with backend_client(backend, "http://gpu0:8000/prefix") as client:
        assert str(client.base_url) == "http://gpu0:8000/prefix/"
        response = await client.post("/v1/chat/completions?x=1", json={"a": 1})
    assert response.json() == {"echo": '{"a":1}'}
    (sent,) = backend.sent
    # The path below the backend's own URL: the backend adds its base path itself.
    assert (sent.method, sent.target) == ("POST", "/v1/chat/completions?x=1")
    names = {name.lower() for name, _ in sent.headers}
    assert "content-type" in names
    assert not names & {"host", "content-length", "connection"}  # the backend writes those


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (BackendUnavailable("Backend b refused", backend="b"), httpx.ConnectError),
        (BackendTimeout("Backend b was silent", backend="b"), httpx.ReadTimeout),
    ],
)
async def test_a_backend_error_reaches_the_client_as_httpx_s_own(
    error: Exception, expected: type[Exception]
) -> None:
    def fail(request: UpstreamRequest) -> MockResponse:
        raise error

    async with backend_client(MockBackend(fail), "http://b") as client:
        with pytest.raises(expected, match="Backend b"):
            await client.get("/metrics")


async def test_a_body_cut_mid_way_is_httpx_s_error_too() -> None:
    class Cut(MockResponse):
        async def aiter_raw(self):  # type: ignore[no-untyped-def]
            yield b"part"
            raise BackendUnavailable("Backend b dropped the connection", backend="b")

    async with backend_client(MockBackend(lambda request: Cut(200)), "http://b") as client:
        with pytest.raises(httpx.ConnectError, match="dropped"):
            await client.get("/v1/models")
