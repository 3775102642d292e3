"""``BackendTransport``: an httpx transport that sends through a :class:`Backend`, for code whose
interface is an ``httpx.AsyncClient`` (worker mode's startup benchmark, whose user-written
``--benchmark`` functions are handed one) while its requests still go through the seam.

The client's base URL is the backend's own (what its functions were promised); the transport
sends each request's path below it as the ``UpstreamRequest`` target, so the backend adds its
own base path, credentials and connection handling exactly as for the gateway's calls. The
backend's errors (the ``BackendError`` tree) come out as httpx's transport errors, which is what
an httpx client's caller expects to catch; the message still names the backend.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx

from ..errors import BackendError, BackendProtocolError, BackendTimeout, BackendUnavailable
from .base import Backend, UpstreamRequest, UpstreamResponse

#: Request headers httpx writes for its own connection that the backend writes itself.
_OWN = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})


def _httpx_error(error: BackendError, request: httpx.Request) -> httpx.TransportError:
    if isinstance(error, BackendTimeout):
        return httpx.ReadTimeout(error.message, request=request)
    if isinstance(error, BackendUnavailable):
        return httpx.ConnectError(error.message, request=request)
    if isinstance(error, BackendProtocolError):
        return httpx.RemoteProtocolError(error.message, request=request)
    return httpx.TransportError(error.message, request=request)


class _Body(httpx.AsyncByteStream):
    """The backend's answer body as httpx reads it, its errors translated; closed once."""

    def __init__(self, response: UpstreamResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except BackendError as exc:
            raise _httpx_error(exc, self._request) from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class BackendTransport(httpx.AsyncBaseTransport):
    """Sends an httpx client's requests through ``backend``, reached at ``base_url``."""

    def __init__(self, backend: Backend, base_url: str) -> None:
        self.backend = backend
        self._base_path = urlsplit(base_url).path.rstrip("/")

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        target = request.url.raw_path.decode("ascii")
        if self._base_path and target.startswith(self._base_path + "/"):
            target = target[len(self._base_path) :]
        headers = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in request.headers.raw
            if name.decode("latin-1").lower() not in _OWN
        ]
        content = await request.aread()
        try:
            response = await self.backend.send(
                UpstreamRequest(request.method, target, headers, content)
            )
        except BackendError as exc:
            raise _httpx_error(exc, request) from exc
        return httpx.Response(
            response.status_code,
            headers=list(response.headers),
            stream=_Body(response, request),
            request=request,
        )


def backend_client(backend: Backend, base_url: str) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` whose base URL is ``base_url`` and whose every request goes
    through ``backend`` (no timeouts of its own: the backend keeps its connect timeout, and
    callers bound the rest with trio deadlines). Closing it leaves the backend open."""
    return httpx.AsyncClient(
        base_url=base_url, transport=BackendTransport(backend, base_url), timeout=None
    )
