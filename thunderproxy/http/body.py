"""A request body as the client sent it, and the bytes the backend gets for it.

An agent's request carries its whole history, often hundreds of kilobytes: parsing it and
serialising it again for the backend each cost about as much as the rest of the proxy's work
before the first token (docs/BENCHMARKS.md, "Per call: the work before the first byte"). What
the edge changes is at the top level only (``program_id`` taken out, usage reporting forced, an
alias's served model), so :func:`read_body` keeps where each top-level member's value lies in
the client's bytes, and :meth:`Body.encode` sends those bytes again for every member that is
still the very object parsed, serialising only the members that changed.

``read_body`` accepts and refuses exactly what ``proxy.parse_json_object`` does, with the same
errors: anything its own scan of the top level does not take (another encoding, a duplicate
key, a refusal to explain) goes through ``parse_json_object`` itself, and such a body is then
serialised whole, as before.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from .proxy import parse_json_object
from .validate import MAX_JSON_DEPTH, deeper_than

_WHITESPACE = re.compile(r"[ \t\n\r]*")
#: json's own string scanner (C), which its typed interface does not name.
_scanstring: Callable[[str, int, bool], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Body:
    """A parsed JSON object and, when its bytes can be reused, the client's bytes, their text
    and each top-level member's span in that text."""

    value: dict[str, Any]
    raw: bytes = b""
    text: str = ""
    spans: dict[str, tuple[int, int]] | None = None

    def encode(self, body: dict[str, Any]) -> bytes:
        """``body`` (this one, or one made from it) as JSON bytes for the backend."""
        if self.spans is None:
            return json.dumps(body).encode()
        spans = self._byte_spans
        raw = memoryview(self.raw)
        # One join, and views of the client's bytes: a history of hundreds of kilobytes is
        # copied once, into the body sent (each copy is a fresh allocation the kernel zeroes).
        parts: list[bytes | memoryview] = []
        for key, value in body.items():
            span = spans.get(key)
            parts.append(b", " if parts else b"{")
            parts.append(json.dumps(key).encode())
            parts.append(b": ")
            if span is not None and value is self.value[key]:
                parts.append(raw[span[0] : span[1]])
            else:
                parts.append(json.dumps(value).encode())
        parts.append(b"}" if parts else b"{}")
        return b"".join(parts)

    @cached_property
    def _byte_spans(self) -> dict[str, tuple[int, int]]:
        """The members' spans in the raw bytes. ASCII text has the bytes' offsets; otherwise
        every other part of the text is encoded to measure it, from the front up to the
        largest member (an agent's history) and from the back down to it, and that member,
        most of the body, is never encoded again."""
        assert self.spans is not None
        text, raw = self.text, self.raw
        if len(text) == len(raw):
            return self.spans
        order = sorted(self.spans.items(), key=lambda item: item[1][0])
        largest = max(range(len(order)), key=lambda i: order[i][1][1] - order[i][1][0])
        out: dict[str, tuple[int, int]] = {}
        char, byte = 0, 0
        for key, (start, end) in order[:largest]:
            byte += _utf8_len(text[char:start])
            out[key] = (byte, byte + _utf8_len(text[start:end]))
            char, byte = end, out[key][1]
        first = byte + _utf8_len(text[char : order[largest][1][0]])
        char, byte = len(text), len(raw)
        for key, (start, end) in reversed(order[largest + 1 :]):
            byte -= _utf8_len(text[end:char])
            out[key] = (byte - _utf8_len(text[start:end]), byte)
            char, byte = start, out[key][0]
        last = byte - _utf8_len(text[order[largest][1][1] : char])
        out[order[largest][0]] = (first, last)
        return out


def _utf8_len(text: str) -> int:
    """The bytes ``text`` came from (decoded as json.loads decodes, surrogates passed)."""
    return len(text.encode("utf-8", "surrogatepass"))


def read_body(raw: bytes) -> Body:
    """``raw`` as a JSON object (``parse_json_object``'s checks and errors), with what
    :meth:`Body.encode` needs to send its unchanged members as they came."""
    scanned = _scan(raw)
    if scanned is None:
        return Body(parse_json_object(raw))
    return scanned


def _scan(raw: bytes) -> Body | None:
    """The top-level object member by member (each value parsed by json's own scanner, under
    the strict checks of ``validate.load_json``); None for anything else."""
    if json.detect_encoding(raw) != "utf-8":
        return None
    try:
        text = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
    refused = False

    def non_finite(_text: str) -> None:
        nonlocal refused
        refused = True

    def parse_float(number: str) -> float | None:
        value = float(number)
        if math.isfinite(value):
            return value
        non_finite(number)
        return None

    decoder = json.JSONDecoder(parse_constant=non_finite, parse_float=parse_float)
    scan_once: Callable[[str, int], tuple[Any, int]] = decoder.scan_once  # type: ignore[attr-defined]
    value: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    try:
        at = _WHITESPACE.match(text, 0).end()  # type: ignore[union-attr]
        if text[at : at + 1] != "{":
            return None
        at = _WHITESPACE.match(text, at + 1).end()  # type: ignore[union-attr]
        if text[at : at + 1] == "}":
            at += 1
        else:
            while True:
                if text[at : at + 1] != '"':
                    return None
                key, at = _scanstring(text, at + 1, True)
                at = _WHITESPACE.match(text, at).end()  # type: ignore[union-attr]
                if text[at : at + 1] != ":":
                    return None
                start = _WHITESPACE.match(text, at + 1).end()  # type: ignore[union-attr]
                member, at = scan_once(text, start)
                if key in value:
                    return None  # sent twice: json keeps the last, the bytes hold both
                value[key] = member
                spans[key] = (start, at)
                at = _WHITESPACE.match(text, at).end()  # type: ignore[union-attr]
                separator = text[at : at + 1]
                at = _WHITESPACE.match(text, at + 1).end()  # type: ignore[union-attr]
                if separator == "}":
                    break
                if separator != ",":
                    return None
        if _WHITESPACE.match(text, at).end() != len(text):  # type: ignore[union-attr]
            return None
    except (ValueError, StopIteration, RecursionError):
        return None
    if refused:
        return None  # parse_json_object names the number and where it is
    # (No count of brackets first, as load_json makes: on a long history counting them costs
    # more than measuring the depth.)
    if deeper_than(value, MAX_JSON_DEPTH):
        return None  # and how deep
    return Body(value, raw, text, spans)
