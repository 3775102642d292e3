"""The request checks both HTTP paths ask (http/checks.py), alone: each verdict, and the head's
size counted as Quart's request counts it, so that a head is refused on the fast path exactly
when it is through Quart."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from quart_trio.asgi import TrioASGIHTTPConnection

from thunderproxy.config import Settings
from thunderproxy.errors import (
    HeadersTooLarge,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    ShuttingDown,
    ThunderproxyError,
    describe,
)
from thunderproxy.http.app import ThunderproxyApp
from thunderproxy.http.checks import (
    Bounds,
    body_too_large,
    declared_length,
    declared_too_large,
    header_items,
    header_size,
    needs_backend,
    needs_client,
    quart_refusal,
    refuse_head,
    request_line_size,
)

BOUNDS = Bounds(max_header_bytes=400, max_body_bytes=1000, client_timeout=5.0)


def scope(
    headers: list[tuple[bytes, bytes]],
    *,
    version: str = "1.1",
    client: tuple[str, int] | None = ("127.0.0.1", 5000),
    query: bytes = b"",
) -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": query,
        "headers": headers,
        "http_version": version,
        "client": client,
    }


def quart_head_size(asgi_scope: dict[str, Any]) -> int:
    """What the Quart path counted before the checks were one module: the request line and
    every header of Quart's own request."""
    connection = TrioASGIHTTPConnection(ThunderproxyApp("test"), asgi_scope)  # type: ignore[arg-type]
    request = connection._create_request_from_scope(lambda message: None)  # type: ignore[arg-type]
    headers = sum(len(name) + len(value) + 4 for name, value in request.headers.items())
    return request_line_size(asgi_scope) + headers


names = st.sampled_from([b"host", b"content-type", b"x-api-key", b"remote-addr", b"accept"])
values = st.binary(max_size=30).map(lambda b: bytes(c for c in b if 32 <= c < 127))


@given(
    headers=st.lists(st.tuples(names, values), max_size=6),
    version=st.sampled_from(["1.0", "1.1", "2"]),
    client=st.sampled_from([None, ("127.0.0.1", 1), ("::1", 2)]),
    query=st.sampled_from([b"", b"a=1&b=2"]),
)
def test_the_head_is_counted_as_quarts_request_counts_it(
    headers: list[tuple[bytes, bytes]],
    version: str,
    client: tuple[str, int] | None,
    query: bytes,
) -> None:
    asgi = scope(headers, version=version, client=client, query=query)
    assert header_size(header_items(asgi), asgi) == quart_head_size(asgi)


def test_quarts_own_headers_are_counted() -> None:
    asgi = scope([(b"host", b"h")], client=None)
    line = request_line_size(asgi)
    assert line == len("POST /v1/chat/completions HTTP/1.1\r\n")
    remote = len("Remote-Addr") + len("<local>") + 4
    assert header_size(header_items(asgi), asgi) == line + len("host") + 1 + 4 + remote
    # HTTP/1.0 without a Host: Quart's request has an empty one.
    old = scope([], version="1.0", client=None)
    assert header_size([], old) == request_line_size(old) + remote + len("Host") + 4


def test_a_draining_proxy_refuses_before_the_head_is_measured() -> None:
    huge = scope([(b"x", b"v" * 1000)])
    verdict = refuse_head(huge, header_items(huge), draining=True, bounds=BOUNDS)
    assert isinstance(verdict, ShuttingDown)
    assert describe(verdict)[0] == 503


def test_a_head_past_the_bound_is_refused_and_one_within_is_not() -> None:
    small = scope([(b"content-type", b"application/json")])
    assert refuse_head(small, header_items(small), draining=False, bounds=BOUNDS) is None
    size = header_size(header_items(small), small)
    at_bound = Bounds(size, 1000, 5.0)
    assert refuse_head(small, header_items(small), draining=False, bounds=at_bound) is None
    under = Bounds(size - 1, 1000, 5.0)
    verdict = refuse_head(small, header_items(small), draining=False, bounds=under)
    assert isinstance(verdict, HeadersTooLarge)
    assert verdict.message == (
        f"Request headers are {size} bytes, more than {size - 1} (see --max-header-bytes)."
    )


@pytest.mark.parametrize(
    ("value", "refused"),
    [
        ("1000", False),
        ("1001", True),
        ("0999", False),
        ("0001000", True),  # more digits than the bound has: refused by its length alone
        ("9" * 5000, True),  # so never int()'d
        ("\u00b2", False),  # a digit to str.isdigit, not to int(): left to the body's count
        ("12a", False),
        ("", False),
    ],
)
def test_a_declared_length_past_the_bound_is_refused_before_the_body(
    value: str, refused: bool
) -> None:
    verdict = declared_too_large([("Content-Length", value)], BOUNDS)
    assert isinstance(verdict, PayloadTooLarge) is refused
    assert declared_length([("content-length", "5"), ("Content-Length", value)]) == value
    assert declared_length([("accept", "*/*")]) is None


def test_a_body_past_the_bound_is_refused_as_it_comes() -> None:
    assert body_too_large(1000, BOUNDS) is None
    verdict = body_too_large(1001, BOUNDS)
    assert isinstance(verdict, PayloadTooLarge)
    assert verdict.message == "Request body is larger than 1000 bytes (see --max-body-bytes)."


@pytest.mark.parametrize(
    ("endpoint", "backend", "client"),
    [
        ("llm.chat_completions", True, True),
        ("llm.list_models", True, True),
        ("passthrough.passthrough", True, True),
        ("council.page", False, True),
        ("readouts.health", False, False),
        ("admin.release_program", False, False),
        (None, False, False),  # no route matched: Quart's 404 or 405
    ],
)
def test_which_routes_need_a_backend_and_a_clients_key(
    endpoint: str | None, backend: bool, client: bool
) -> None:
    assert needs_backend(endpoint) is backend
    assert needs_client(endpoint) is client


@pytest.mark.parametrize(
    ("status", "kind", "message"),
    [
        (413, PayloadTooLarge, "Request body is larger than 1000 bytes (see --max-body-bytes)."),
        (408, RequestTimeout, "Request body not received within 5.0 s (see --client-timeout)."),
        (405, MethodNotAllowed, "PUT is not allowed on /health."),
        (404, NotFound, "quart's text"),
        (400, InvalidRequest, "quart's text"),
        (500, ThunderproxyError, "quart's text"),
    ],
)
def test_quarts_own_refusals_are_said_as_ours(
    status: int, kind: type[ThunderproxyError], message: str
) -> None:
    ours = quart_refusal(status, "quart's text", "PUT", "/health", BOUNDS)
    assert type(ours) is kind
    assert ours.message == message
    assert describe(ours)[0] == status


def test_the_bounds_are_the_settings() -> None:
    settings = Settings(max_header_bytes=123, max_body_bytes=456, client_timeout=7.5)
    assert Bounds.of(settings) == Bounds(123, 456, 7.5)
