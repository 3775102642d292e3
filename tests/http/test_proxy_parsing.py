"""The OpenAI edge's request parsing, pure: program ids, bodies, prompt size."""

from __future__ import annotations

from typing import Any

import pytest

from thunderproxy.errors import InvalidRequest
from thunderproxy.http.proxy import (
    DEFAULT_PROGRAM,
    MAX_PROGRAM_ID_CHARS,
    context_chars,
    extract_program_id,
    forward_headers,
    parse_json_object,
)


def test_the_body_wins_over_extra_body_and_the_header_and_both_are_stripped() -> None:
    body: dict[str, Any] = {"program_id": "a", "extra_body": {"program_id": "b"}, "model": "m"}
    assert extract_program_id(body, "c") == "a"
    assert body == {"model": "m"}  # extra_body emptied, so dropped: the backend sees neither


def test_extra_body_then_the_header_then_the_default() -> None:
    body: dict[str, Any] = {"extra_body": {"program_id": "b", "keep": 1}}
    assert extract_program_id(body, "c") == "b"
    assert body == {"extra_body": {"keep": 1}}
    assert extract_program_id({}, "c") == "c"
    assert extract_program_id({}, None) == DEFAULT_PROGRAM


@pytest.mark.parametrize("bad", ["", "  ", 7, None, ["x"], "x" * (MAX_PROGRAM_ID_CHARS + 1)])
def test_a_program_id_that_is_not_a_short_string_is_refused(bad: Any) -> None:
    with pytest.raises(InvalidRequest) as caught:
        extract_program_id({"program_id": bad}, None)
    assert caught.value.param == "program_id"


@pytest.mark.parametrize(
    ("raw", "needle"),
    [(b'{"a": "\xc3\x28"}', "UTF-8"), (b"{", "not valid JSON"), (b"[1]", "JSON object")],
)
def test_bodies_that_are_not_json_objects_are_refused_by_name(raw: bytes, needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        parse_json_object(raw)


def test_prompt_characters_count_text_only() -> None:
    chat = {
        "messages": [
            {"role": "system", "content": "abc"},
            {"role": "user", "content": [{"type": "text", "text": "de"}, {"type": "image"}]},
            "not a message",
        ]
    }
    assert context_chars(chat) == 5
    assert context_chars({"prompt": "abcd"}) == 4
    assert context_chars({"prompt": ["ab", 3, "c"]}) == 3
    assert context_chars({}) == 0


def test_hop_by_hop_headers_and_the_ones_connection_lists_are_not_forwarded() -> None:
    headers = [
        ("Connection", "keep-alive, X-Secret-Hop"),
        ("X-Secret-Hop", "1"),
        ("Transfer-Encoding", "chunked"),
        ("Host", "proxy"),
        ("Authorization", "Bearer k"),
    ]
    assert forward_headers(headers) == [("Authorization", "Bearer k")]
