"""``HttpBackend``: a backend over HTTP, one long-lived ``httpx.AsyncClient`` (never one per
request), and the one boundary where httpx's exceptions become ours."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from urllib.parse import urlsplit

import httpx
import trio

from .. import descriptors
from ..errors import BackendProtocolError, BackendTimeout, BackendUnavailable
from ..urls import redact_url
from .base import UpstreamRequest, UpstreamResponse
from .h1 import H1Pool, out_of_descriptors


def mapped_error(backend: str, exc: BaseException) -> BaseException:
    """The BackendError that httpx's or trio's ``exc`` means, naming the backend (``backend``
    is the redacted URL: messages reach clients and the audit db); ``exc`` itself when it is
    neither's."""
    if isinstance(exc, trio.TooSlowError):
        return BackendTimeout(
            f"Backend {backend} did not answer in time; it may be overloaded or hung "
            "(see --first-byte-timeout and --read-timeout).",
            backend=backend,
        )
    if isinstance(exc, httpx.TimeoutException):
        return BackendTimeout(
            f"Backend {backend} timed out ({type(exc).__name__}); check that it is running.",
            backend=backend,
        )
    out = descriptors.out_error(exc) if isinstance(exc, httpx.ConnectError) else None
    if out is not None:
        return out_of_descriptors(backend, out)
    if isinstance(
        exc, httpx.ConnectError | httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError
    ):
        return BackendUnavailable(
            f"Backend {backend} is unreachable or dropped the connection "
            f"({type(exc).__name__}); check that it is running.",
            backend=backend,
        )
    if isinstance(exc, httpx.HTTPError):
        return BackendProtocolError(
            f"Backend {backend} failed: {type(exc).__name__}", backend=backend
        )
    return exc


@contextmanager
def map_httpx_errors(backend: str) -> Iterator[None]:
    """Translate httpx and trio timeout errors into the BackendError tree, naming the backend."""
    try:
        yield
    except (trio.TooSlowError, httpx.HTTPError) as exc:
        error = mapped_error(backend, exc)
        if isinstance(exc, trio.TooSlowError):
            raise error from None
        raise error from exc


#: Clients per backend. httpcore's pool scans every connection it holds on each request and
#: each release (a poll() syscall per idle one), so one pool's cost per request grows with the
#: number of streams in flight; requests are spread over this many pools instead.
POOL_SHARDS = 16


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
        # The body as httpcore hands it over: httpx's own aiter_raw only re-chunks (no size is
        # asked here) and counts bytes, one more generator per chunk. One try around the loop
        # maps errors; a context manager per chunk would cost a generator frame each time.
        self._chunks = chunks = self._response.stream.__aiter__()  # type: ignore[union-attr]
        try:
            async for chunk in chunks:
                yield chunk
        except (trio.TooSlowError, httpx.HTTPError) as exc:
            raise mapped_error(self._name, exc) from exc

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


@cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for every httpx client of the process: each client would otherwise load
    the CA bundle itself, some 0.2 s of CPU each, and a backend has several clients."""
    return httpx.create_ssl_context()


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
        shards = max(1, min(POOL_SHARDS, max_connections))
        per_shard = max(1, max_connections // shards)
        self.clients = [
            httpx.AsyncClient(
                base_url=self.name,
                auth=auth,
                # Read and first-byte budgets are enforced by the gateway with trio deadlines,
                # because a long prefill and a silent mid-stream gap need different limits.
                timeout=httpx.Timeout(None, connect=connect_timeout),
                limits=httpx.Limits(
                    max_connections=per_shard,
                    max_keepalive_connections=per_shard,
                    keepalive_expiry=30.0,
                ),
                follow_redirects=False,
                verify=tls_context(),
            )
            for _ in range(shards)
        ]
        self._next = 0
        #: The relay's own client for plain-HTTP POSTs (h1.py says why); None for HTTPS.
        self.h1: H1Pool | None = None
        if urlsplit(url).scheme == "http":
            self.h1 = H1Pool(url, connect_timeout=connect_timeout, max_connections=max_connections)

    @property
    def client(self) -> httpx.AsyncClient:
        """The first of the backend's clients (they differ only in their pools)."""
        return self.clients[0]

    def _pick(self) -> httpx.AsyncClient:
        # Round robin: streams of similar length leave the pools equally full.
        self._next = (self._next + 1) % len(self.clients)
        return self.clients[self._next]

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        if self.h1 is not None and request.method == "POST":
            return await self.h1.send(request)
        # Header values go out as the bytes the client sent: the server decoded them as latin-1,
        # so encoding them back the same way is exact (httpx would encode text as ASCII and fail
        # on any other byte).
        headers = [
            (name.encode("latin-1", "replace"), value.encode("latin-1", "replace"))
            for name, value in request.headers
        ]
        client = self._pick()
        upstream = client.build_request(
            request.method, request.target, content=request.content, headers=headers
        )
        with map_httpx_errors(self.name):
            response = await client.send(upstream, stream=True)
        return HttpResponse(response, self.name)

    async def aclose(self) -> None:
        if self.h1 is not None:
            self.h1.close()
        with trio.CancelScope(shield=True):
            for client in self.clients:
                await client.aclose()
