"""``MockBackend``: a backend built from a handler, the one double of a model server that the
tests (and the measurements that need no server) share."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from thunderproxy.backends import UpstreamRequest
from thunderproxy.backends.mock import MockBackend, MockResponse


async def test_a_mock_backend_answers_through_its_handler_and_keeps_what_passed() -> None:
    backend = MockBackend(lambda request: MockResponse.json({"path": request.target}))
    response = await backend.send(UpstreamRequest("GET", "/v1/models"))
    assert response.status_code == 200
    assert await response.aread() == b'{"path": "/v1/models"}'
    await response.aclose()
    assert [r.target for r in backend.sent] == ["/v1/models"]
    assert backend.responses == [response]
    assert response.closed  # type: ignore[attr-defined]


async def test_a_mock_backend_without_a_handler_sends_nothing() -> None:
    with pytest.raises(AssertionError, match="not to be sent anything"):
        await MockBackend().send(UpstreamRequest("POST", "/v1/chat/completions"))


async def test_a_silence_in_a_mock_answer_takes_its_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def slow(request: UpstreamRequest) -> MockResponse:
        await trio.sleep(2.0)
        return MockResponse(200, chunks=[b"a", 5.0, b"b"])

    began = trio.current_time()
    response = await MockBackend(slow).send(UpstreamRequest("GET", "/"))
    assert [chunk async for chunk in response.aiter_raw()] == [b"a", b"b"]
    assert trio.current_time() - began == pytest.approx(7.0)


async def test_a_mock_backend_told_not_to_keep_keeps_nothing() -> None:
    backend = MockBackend(lambda request: MockResponse(204), keep=False)
    for _ in range(3):
        assert (await backend.send(UpstreamRequest("GET", "/"))).status_code == 204
    assert (backend.sent, backend.responses) == ([], [])
