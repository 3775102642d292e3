"""``MockBackend``: a :class:`Backend` built from a handler function, in the spirit of httpx's
``MockTransport``, for tests and for measurements that drive the gateway or the scheduler with
no model server behind them.

The handler gets each :class:`UpstreamRequest` and returns the answer (a ``MockResponse``, or
any ``UpstreamResponse``), directly or awaited; it may raise a ``BackendError`` as a backend
does, or sleep (trio time) to be slow. The backend keeps what it was sent and what it answered,
in order (``keep=False``: nothing, for a measurement that makes many calls). Built with no
handler, it fails any send: for code that must send nothing.

    backend = MockBackend(lambda request: MockResponse(200, chunks=[b'{"ok": true}']))
    pool.attach("http://mock", backend, models=["m"])
"""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from .base import UpstreamRequest, UpstreamResponse

Handler = Callable[[UpstreamRequest], UpstreamResponse | Awaitable[UpstreamResponse]]


@dataclass
class MockResponse:
    """An answer given piece by piece: ``chunks`` are the body's pieces as the backend sends
    them, and a number among them is a silence of that many seconds (trio time) before the
    next. ``closed`` says whether the reader closed it."""

    status_code: int = 200
    headers: Sequence[tuple[str, str]] = ()
    chunks: Sequence[bytes | float] = ()
    closed: bool = field(default=False, init=False)

    @classmethod
    def json(cls, body: Any, status_code: int = 200) -> MockResponse:
        """One JSON body, as a server answers a plain request."""
        return cls(status_code, [("content-type", "application/json")], [json.dumps(body).encode()])

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            if isinstance(chunk, bytes):
                yield chunk
            else:
                await trio.sleep(chunk)

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    async def aclose(self) -> None:
        self.closed = True


def _sends_nothing(request: UpstreamRequest) -> UpstreamResponse:
    raise AssertionError(
        f"this backend is not to be sent anything, but was sent {request.method} {request.target}"
    )


class MockBackend:
    """A backend whose every answer ``handler`` gives; ``sent`` and ``responses`` record them
    unless ``keep`` is False."""

    def __init__(self, handler: Handler = _sends_nothing, *, keep: bool = True) -> None:
        self.handler = handler
        self.keep = keep
        self.sent: list[UpstreamRequest] = []
        self.responses: list[UpstreamResponse] = []

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        if self.keep:
            self.sent.append(request)
        answer = self.handler(request)
        response = await answer if inspect.isawaitable(answer) else answer
        if self.keep:
            self.responses.append(response)
        return response
