"""The checks a request passes before a route has it, pure: one module that both HTTP paths ask
(Quart's hooks, http/app.py; the raw-ASGI LLM routes, http/fastpath.py), so that a request is
refused on the one exactly when, and as, it is on the other.

Each check returns its verdict: the error to refuse the request with (from errors.py's tree, so
that its status, type and ``rejections`` row follow from the one table), or None to let it on.
What a path does with a refusal is its own: Quart's hooks raise it to the app's error handler,
the fast path answers it itself; both record it with ``RejectionRecord.refused``.

The checks, in the order both paths make them:

1. ``refuse_head``: 503 while draining (``ShuttingDown``), then 431 past ``--max-header-bytes``
   (the request line and the headers, with the ``Remote-Addr`` header Quart's request adds to
   them: ``header_size``);
2. the body's bounds: 413 past ``--max-body-bytes`` (``declared_too_large`` from its
   ``Content-Length`` before a byte is read, ``body_too_large`` as it comes), 408 when it is
   slower than ``--client-timeout``, and ``body_incomplete`` for a client that left before it
   was whole (Quart enforces the first two itself: ``quart_refusal`` says them as ours);
3. a configured client's key on the routes that reach a backend or run a council job
   (``needs_client``; the key is ``Clients.identify``'s, http/clients.py);
4. readiness on the routes that need a backend (``needs_backend``; ``Readiness.reason``).

Both paths refuse the last two only once the body is read, so the connection stays usable.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import Settings
from ..errors import (
    BodyIncomplete,
    HeadersTooLarge,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    ShuttingDown,
    ThunderproxyError,
)

#: The blueprints whose routes reach a backend: refused until the backends are ready.
BACKEND_BLUEPRINTS = frozenset({"llm", "passthrough"})
#: The blueprints whose routes are a configured client's (``[clients]``): those that reach a
#: backend, and the council's, whose jobs do.
CLIENT_BLUEPRINTS = BACKEND_BLUEPRINTS | {"council"}


@dataclass(frozen=True)
class Bounds:
    """What a request may be: ``--max-header-bytes``, ``--max-body-bytes``, and the seconds its
    body may take (``--client-timeout``)."""

    max_header_bytes: int
    max_body_bytes: int
    client_timeout: float

    @classmethod
    def of(cls, settings: Settings) -> Bounds:
        return cls(settings.max_header_bytes, settings.max_body_bytes, settings.client_timeout)


def payload_too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"Request body is larger than {limit} bytes (see --max-body-bytes).")


def body_incomplete(received: int, declared: str | None) -> BodyIncomplete:
    of = f" of the {declared} its Content-Length declared" if declared is not None else ""
    return BodyIncomplete(
        f"The client closed the connection after sending {received} body bytes{of}, before "
        "its body was whole; nothing was sent to a backend."
    )


def body_too_slow(timeout: float) -> RequestTimeout:
    return RequestTimeout(f"Request body not received within {timeout} s (see --client-timeout).")


def headers_too_large(size: int, limit: int) -> HeadersTooLarge:
    return HeadersTooLarge(
        f"Request headers are {size} bytes, more than {limit} (see --max-header-bytes)."
    )


def shutting_down() -> ShuttingDown:
    return ShuttingDown(
        "thunderproxy is shutting down (SIGTERM/SIGINT) and did not start this request; "
        "retry it after Retry-After, on another instance or once this one is back."
    )


def header_items(scope: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The ASGI scope's headers as text, as sent (latin-1 keeps every byte)."""
    return [(n.decode("latin-1"), v.decode("latin-1")) for n, v in scope["headers"]]


def request_line_size(scope: Mapping[str, Any]) -> int:
    """The request line's bytes (``POST /path?query HTTP/1.1``, CRLF): part of the head the
    limit bounds. Left out, a 60 KB URL passed a limit of 8 KB."""
    target = len(scope.get("raw_path") or scope["path"].encode())
    query = scope.get("query_string") or b""
    if query:
        target += 1 + len(query)
    return len(scope["method"]) + 1 + target + len(" HTTP/1.1\r\n")


def header_size(items: Sequence[tuple[str, str]], scope: Mapping[str, Any]) -> int:
    """The request head's size as ``--max-header-bytes`` counts it: the request line and the
    headers. Quart's request adds headers of its own, which the limit has always counted on
    its path: ``Remote-Addr``, and an empty ``Host`` to an HTTP/1.0 request without one. Counted
    here for both paths, so that a head is refused on one exactly when it is on the other."""
    size = sum(len(name) + len(value) + 4 for name, value in items)
    remote = (scope.get("client") or ["<local>"])[0]
    size += len("Remote-Addr") + len(remote) + 4
    if scope.get("http_version", "1.1") < "1.1" and not any(
        name.lower() == "host" for name, _ in items
    ):
        size += len("Host") + 4
    return request_line_size(scope) + size


def refuse_head(
    scope: Mapping[str, Any],
    items: Sequence[tuple[str, str]],
    *,
    draining: bool,
    bounds: Bounds,
) -> ThunderproxyError | None:
    """Before anything is read: refused while draining, then past the header bound."""
    if draining:
        return shutting_down()
    size = header_size(items, scope)
    if size > bounds.max_header_bytes:
        return headers_too_large(size, bounds.max_header_bytes)
    return None


def declared_length(items: Iterable[tuple[str, str]]) -> str | None:
    """The ``Content-Length`` header's value as sent, the last one's; None without one."""
    declared: str | None = None
    for name, value in items:
        if name.lower() == "content-length":
            declared = value
    return declared


def declared_too_large(items: Iterable[tuple[str, str]], bounds: Bounds) -> PayloadTooLarge | None:
    """413 for a body whose ``Content-Length`` already says it is past the bound."""
    limit = bounds.max_body_bytes
    for name, value in items:
        # ASCII digits only (``"²".isdigit()`` holds, and ``int("²")`` raises), compared by
        # length first (``int`` refuses more than 4,300 digits).
        if (
            name.lower() == "content-length"
            and value.isascii()
            and value.isdigit()
            and (len(value) > len(str(limit)) or int(value) > limit)
        ):
            return payload_too_large(limit)
    return None


def body_too_large(size: int, bounds: Bounds) -> PayloadTooLarge | None:
    """413 once the body read so far is past the bound."""
    return payload_too_large(bounds.max_body_bytes) if size > bounds.max_body_bytes else None


def _blueprint(endpoint: str | None) -> str:
    return (endpoint or "").rpartition(".")[0]


def needs_backend(endpoint: str | None) -> bool:
    """Whether the route ``endpoint`` (Quart's name, ``blueprint.function``) reaches a backend,
    and is refused until the backends are ready."""
    return _blueprint(endpoint) in BACKEND_BLUEPRINTS


def needs_client(endpoint: str | None) -> bool:
    """Whether the route ``endpoint`` is a configured client's, with ``[clients]``."""
    return _blueprint(endpoint) in CLIENT_BLUEPRINTS


def quart_refusal(
    status: int, text: str, method: str, path: str, bounds: Bounds
) -> ThunderproxyError:
    """Quart's own refusals (413 body too large, 408 body too slow, 405, 404, ...) as ours:
    ``status`` and ``text`` are its HTTPException's code and description."""
    if status == 413:
        return payload_too_large(bounds.max_body_bytes)
    if status == 408:
        return body_too_slow(bounds.client_timeout)
    if status == 405:
        return MethodNotAllowed(f"{method} is not allowed on {path}.")
    if status == 404:
        return NotFound(text)
    if status >= 500:
        return ThunderproxyError(text)  # a fault of ours, not of the request
    return InvalidRequest(text)
