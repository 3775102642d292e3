"""The backend pool: one long-lived ``httpx.AsyncClient`` per backend (never one per request),
health as the metrics poller last saw it, and the one boundary where httpx errors become ours."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import httpx
import trio

from ..errors import (
    BackendError,
    BackendProtocolError,
    BackendTimeout,
    BackendUnavailable,
    NoBackendAvailable,
)
from .metrics import EngineSnapshot

#: Consecutive request timeouts after which a backend is treated as down until it answers again.
FAILURES_BEFORE_UNHEALTHY = 3


@dataclass
class Backend:
    url: str
    client: httpx.AsyncClient
    #: Optimistic until a poll or a request says otherwise, so the first request is not refused.
    healthy: bool = True
    snapshot: EngineSnapshot | None = None
    last_error: str | None = None
    last_poll_at: float | None = None
    in_flight: int = 0
    #: Consecutive failed requests; reset by any success.
    failures: int = field(default=0)

    def mark_failed(self, error: str) -> None:
        """The backend is down (refused a connection, failed its health check)."""
        self.healthy = False
        self.last_error = error
        self.failures += 1

    def record_failure(self, error: str) -> None:
        """A request failed in a way one slow request can explain (a timeout): only several in
        a row take the backend out of placement."""
        self.failures += 1
        self.last_error = error
        if self.failures >= FAILURES_BEFORE_UNHEALTHY:
            self.healthy = False

    def mark_ok(self) -> None:
        self.healthy = True
        self.failures = 0
        self.last_error = None

    @property
    def capacity_tokens(self) -> int | None:
        return None if self.snapshot is None else self.snapshot.capacity_tokens


class BackendPool:
    """The backends of one run, each with its own client; open with :func:`open_backend_pool`."""

    def __init__(self, *, connect_timeout: float = 10.0, max_connections: int = 1024) -> None:
        self.backends: dict[str, Backend] = {}
        self._connect_timeout = connect_timeout
        self._max_connections = max_connections

    def add(self, url: str) -> Backend:
        client = httpx.AsyncClient(
            base_url=url,
            # Read and first-byte budgets are enforced by the proxy with trio deadlines,
            # because a long prefill and a silent mid-stream gap need different limits.
            timeout=httpx.Timeout(None, connect=self._connect_timeout),
            limits=httpx.Limits(
                max_connections=self._max_connections,
                max_keepalive_connections=self._max_connections,
                keepalive_expiry=30.0,
            ),
            follow_redirects=False,
        )
        backend = self.backends[url] = Backend(url=url, client=client)
        return backend

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            for backend in self.backends.values():
                await backend.client.aclose()

    def __iter__(self) -> Iterator[Backend]:
        return iter(self.backends.values())

    def __len__(self) -> int:
        return len(self.backends)

    @property
    def urls(self) -> list[str]:
        return list(self.backends)

    def get(self, url: str | None) -> Backend | None:
        return None if url is None else self.backends.get(url)

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends.values() if b.healthy]

    def first_healthy(self) -> Backend:
        healthy = self.healthy()
        if not healthy:
            raise NoBackendAvailable(
                "No healthy backend: every backend failed its last health check "
                f"({', '.join(self.backends) or 'none configured'}); check that they are running."
            )
        return healthy[0]


@asynccontextmanager
async def open_backend_pool(
    urls: Sequence[str] = (),
    *,
    connect_timeout: float = 10.0,
    max_connections: int = 1024,
) -> AsyncIterator[BackendPool]:
    """A pool with one client per URL (more may be added); every client is closed on exit."""
    pool = BackendPool(connect_timeout=connect_timeout, max_connections=max_connections)
    try:
        for url in urls:
            pool.add(url)
        yield pool
    finally:
        await pool.aclose()


@contextmanager
def map_httpx_errors(backend: str) -> Iterator[None]:
    """Translate httpx and trio timeout errors into the BackendError tree, naming the backend."""
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
            f"Backend {backend} is unreachable or dropped the connection ({type(exc).__name__}: "
            f"{exc}); check that it is running.",
            backend=backend,
        ) from exc
    except httpx.HTTPError as exc:
        raise BackendProtocolError(
            f"Backend {backend} failed: {type(exc).__name__}: {exc}", backend=backend
        ) from exc


__all__ = [
    "Backend",
    "BackendError",
    "BackendPool",
    "map_httpx_errors",
    "open_backend_pool",
]
