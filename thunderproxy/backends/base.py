"""The backend seam: one method, ``send``, in the spirit of httpx's transport.

Everything the proxy sends a model server goes through a :class:`Backend`: the gateway's calls,
the metrics poller's probes, the passthrough, and worker mode's startup benchmark (handed an
httpx client whose transport is the backend: ``transport.py``). ``HttpBackend`` speaks HTTP
(``h1.py`` for plain-HTTP POSTs, shared ``httpx.AsyncClient``s for the rest);
``EngineBackend`` drives the simulator in-process, so virtual-time runs use the same gateway,
poller and scheduler as a real proxy, on trio's MockClock; ``MockBackend`` (``mock.py``) answers
from a handler function.

A backend raises only the ``BackendError`` tree (errors.py): ``send`` and the response's reads
translate their transport's exceptions at this boundary.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class UpstreamRequest:
    """One request to a backend. ``target`` is the path with its query string."""

    method: str
    target: str
    headers: Sequence[tuple[str, str]] = ()
    content: bytes = b""


class UpstreamResponse(Protocol):
    """A backend's answer whose body has not been read yet; close it exactly once."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Sequence[tuple[str, str]]: ...

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives, chunk by chunk, undecoded."""
        ...

    async def aread(self) -> bytes: ...

    async def aclose(self) -> None:
        """Stop reading; for a request still running, this is how the backend learns to abort."""
        ...


class Backend(Protocol):
    """A model server, however it is reached."""

    async def send(self, request: UpstreamRequest) -> UpstreamResponse: ...


def header(response: UpstreamResponse, name: str, default: str = "") -> str:
    """The first value of header ``name`` (case-insensitive)."""
    wanted = name.lower()
    for key, value in response.headers:
        if key.lower() == wanted:
            return value
    return default
