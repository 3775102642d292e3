"""A request body read once at the edge: the same values, checks and errors as a whole parse,
and the client's own bytes sent again for the members the proxy did not change."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from thunderproxy.errors import InvalidRequest
from thunderproxy.http.body import read_body
from thunderproxy.http.proxy import parse_json_object
from thunderproxy.http.validate import MAX_JSON_DEPTH, _walk, deeper_than

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=12
)
objects = st.dictionaries(st.text(), values, max_size=6)


def dumped(body: dict[str, Any], style: int) -> bytes:
    """``body`` as different clients write it: spaced, compact, indented, raw UTF-8."""
    if style == 0:
        return json.dumps(body).encode()
    if style == 1:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    return (" \n" + json.dumps(body, indent=2, ensure_ascii=False) + "\r\n").encode()


@given(objects, st.integers(0, 2), st.data())
def test_the_body_sent_is_the_body_meant_whatever_changed(
    body: dict[str, Any], style: int, data: st.DataObject
) -> None:
    raw = dumped(body, style)
    parsed = read_body(raw)
    assert parsed.value == json.loads(raw) == parse_json_object(raw)
    assert json.loads(parsed.encode(parsed.value)) == body
    # As the edge changes a body: members taken out, added, replaced; the rest kept as parsed.
    changed = {k: v for k, v in parsed.value.items() if data.draw(st.booleans())}
    changed[data.draw(st.text())] = data.draw(values)
    assert json.loads(parsed.encode(changed)) == changed


def test_unchanged_members_go_out_as_the_client_wrote_them() -> None:
    raw = (
        b'{"model":"\xe2\x80\x99m",'
        b'"messages":[{"role":"user","content":"\xc3\xa9t\xc3\xa9 \\u00e9"}],'
        b'\n"program_id":"p", "user" :  "\xc3\xbc\xc3\x9f",  "n": [1, "\xf0\x9f\x98\x80"] }'
    )
    parsed = read_body(raw)
    sent = {k: v for k, v in parsed.value.items() if k != "program_id"}
    sent["stream_options"] = {"include_usage": True}
    out = parsed.encode(sent)
    for member in (
        b'"\xe2\x80\x99m"',
        b'[{"role":"user","content":"\xc3\xa9t\xc3\xa9 \\u00e9"}]',
        b'"\xc3\xbc\xc3\x9f"',
        b'[1, "\xf0\x9f\x98\x80"]',
    ):
        assert b": " + member in out
    assert b"program_id" not in out
    assert json.loads(out) == sent
    # A member that is no longer the object parsed is serialised, even if it looks the same.
    copy = {**sent, "messages": [dict(m) for m in sent["messages"]]}
    copy["messages"][0]["content"] = "other"
    assert json.loads(parsed.encode(copy))["messages"][0]["content"] == "other"


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[]",
        b'"text"',
        b"{",
        b'{"a": 1,}',
        b'{"a" 1}',
        b'{"a": 1} x',
        b'{"a": NaN}',
        b'{"a": [1, -Infinity]}',
        b'{"a": 1e999}',
        b'{"a": "\x01"}',
        b'{"a": "\xff"}',
        b'{"a": 1, "a": 2}',
        b'\xef\xbb\xbf{"a": 1}',
        '{"a": 1}'.encode("utf-16"),
        b'{"a": "\\ud800"}',
        b'{"a": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}",
        b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}",
        b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
)
def test_accepted_and_refused_as_a_whole_parse_is(raw: bytes) -> None:
    refused: InvalidRequest | None = None
    try:
        expected: Any = parse_json_object(raw)
    except InvalidRequest as exc:
        refused = exc
    if refused is not None:
        with pytest.raises(InvalidRequest) as caught:
            read_body(raw)
        assert (caught.value.message, caught.value.param) == (refused.message, refused.param)
        return
    parsed = read_body(raw)
    assert parsed.value == expected
    assert json.loads(parsed.encode(parsed.value)) == expected


nested = st.recursive(st.integers(), lambda inner: st.lists(inner, max_size=3), max_leaves=80)


@given(nested | st.lists(nested) | st.dictionaries(st.text(max_size=2), nested), st.integers(1, 8))
def test_the_depth_check_agrees_with_the_walk_that_names_where(value: Any, limit: int) -> None:
    import thunderproxy.http.validate as validate

    saved = validate.MAX_JSON_DEPTH
    validate.MAX_JSON_DEPTH = limit
    try:
        try:
            _walk(value)
            walked = False
        except InvalidRequest:
            walked = True
    finally:
        validate.MAX_JSON_DEPTH = saved
    assert deeper_than(value, limit) is walked
