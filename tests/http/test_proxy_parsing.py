"""The edges' shared request parsing, pure: bodies and forwarded headers. (Program ids and
prompt sizes are the protocols' and the recognizer's: tests/protocols.)"""

from __future__ import annotations

import pytest

from thunderproxy.errors import InvalidRequest
from thunderproxy.http.proxy import forward_headers, parse_json_object


@pytest.mark.parametrize(
    ("raw", "needle"),
    [(b'{"a": "\xc3\x28"}', "UTF-8"), (b"{", "not valid JSON"), (b"[1]", "JSON object")],
)
def test_bodies_that_are_not_json_objects_are_refused_by_name(raw: bytes, needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        parse_json_object(raw)


def test_hop_by_hop_headers_and_the_ones_connection_lists_are_not_forwarded() -> None:
    headers = [
        ("Connection", "keep-alive, X-Secret-Hop"),
        ("X-Secret-Hop", "1"),
        ("Transfer-Encoding", "chunked"),
        ("Host", "proxy"),
        ("Authorization", "Bearer k"),
    ]
    assert forward_headers(headers) == [("Authorization", "Bearer k")]
