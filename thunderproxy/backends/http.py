"""``HttpBackend``: a backend over HTTP, one long-lived ``httpx.AsyncClient`` (never one per
request), and the one boundary where httpx's exceptions become ours."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import trio

from ..errors import BackendProtocolError, BackendTimeout, BackendUnavailable
from ..urls import redact_url
from .base import UpstreamRequest


@contextmanager
def map_httpx_errors(backend: str) -> Iterator[None]:
    """Translate httpx and trio timeout errors into the BackendError tree, naming the backend
    (``backend`` is the redacted URL: messages reach clients and the audit db)."""
    try:
        yield
    except trio.TooSlowError:
        raise BackendTimeout(
            f"Backend {backend} did not answer in time; it may be overloaded or hung "
            "(see --first-byte-timeout and --read-timeout).",
            backend=backend,
        ) from None
    except httpx.TimeoutException as exc:
        raise BackendTimeout(
            f"Backend {backend} timed out ({type(exc).__name__}); check that it is running.",
            backend=backend,
        ) from exc
    except (
        httpx.ConnectError,
        httpx.RemoteProtocolError,
        httpx.ReadError,
        httpx.WriteError,
    ) as exc:
        raise BackendUnavailable(
            f"Backend {backend} is unreachable or dropped the connection "
            f"({type(exc).__name__}); check that it is running.",
            backend=backend,
        ) from exc
    except httpx.HTTPError as exc:
        raise BackendProtocolError(
            f"Backend {backend} failed: {type(exc).__name__}", backend=backend
        ) from exc


class HttpResponse:
    """An ``httpx.Response`` opened with ``stream=True``, its errors mapped."""

    def __init__(self, response: httpx.Response, name: str) -> None:
        self._response = response
        self._name = name
        self._chunks: AsyncIterator[bytes] | None = None

    @property
    def status_code(self) -> int:
        return self._response.status_code

    @property
    def headers(self) -> Sequence[tuple[str, str]]:
        return self._response.headers.multi_items()

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        self._chunks = chunks = self._response.aiter_raw()
        while True:
            with map_httpx_errors(self._name):
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    return
            yield chunk

    async def aread(self) -> bytes:
        with map_httpx_errors(self._name):
            return await self._response.aread()

    async def aclose(self) -> None:
        # Shielded: this runs while being cancelled (the client left). Closing the response
        # closes its connection, which is how vLLM learns to abort the request.
        with trio.CancelScope(shield=True):
            if self._chunks is not None:
                await self._chunks.aclose()  # type: ignore[attr-defined]
            await self._response.aclose()


class HttpBackend:
    """An OpenAI-compatible server at ``url`` (credentials in the URL are sent, never shown)."""

    def __init__(
        self, url: str, *, connect_timeout: float = 10.0, max_connections: int = 1024
    ) -> None:
        parts = urlsplit(url)
        auth = None
        if parts.username is not None or parts.password is not None:
            auth = httpx.BasicAuth(parts.username or "", parts.password or "")
        self.name = redact_url(url)
        self.client = httpx.AsyncClient(
            base_url=self.name,
            auth=auth,
            # Read and first-byte budgets are enforced by the gateway with trio deadlines,
            # because a long prefill and a silent mid-stream gap need different limits.
            timeout=httpx.Timeout(None, connect=connect_timeout),
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=30.0,
            ),
            follow_redirects=False,
        )

    async def send(self, request: UpstreamRequest) -> HttpResponse:
        upstream = self.client.build_request(
            request.method, request.target, content=request.content, headers=request.headers
        )
        with map_httpx_errors(self.name):
            response = await self.client.send(upstream, stream=True)
        return HttpResponse(response, self.name)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.client.aclose()
