"""Checks at the HTTP edge, pure: what a request may hold before anything acts on it.

Python's ``json`` accepts more than JSON: ``NaN``, ``Infinity``, ``1e999`` (read as infinity),
and ``"\\ud800"``, a lone surrogate, which is valid JSON but no Unicode text, so it cannot be
encoded again as UTF-8 (not into a header, not into SQLite). Identifiers the proxy keeps
(program id, model, user) must be text; numbers must be finite; nesting is bounded, so no
later walk over the body can recurse without limit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidRequest
from ..protocols.base import MAX_NESTING
from ..protocols.base import deeper_than as deeper_than

#: Deepest nesting of arrays and objects accepted in a request body (a chat request needs ~6).
MAX_JSON_DEPTH = MAX_NESTING
#: The largest integer SQLite stores: an event number or cursor past it names nothing there.
MAX_INDEX = 2**63 - 1
#: Body fields that name something the proxy records or forwards as an identifier.
IDENTIFIER_FIELDS = ("model", "user")


class _NonFinite:
    """Stands in for a NaN or infinite number while parsing, so its place can be named."""

    def __init__(self, text: str) -> None:
        self.text = text


def _path(parts: tuple[str | int, ...]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "the top level"


def _walk(value: Any) -> None:
    """Refuse a non-finite number or nesting past MAX_JSON_DEPTH, naming where it is."""
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(value, 1, ())]
    while stack:
        node, depth, parts = stack.pop()
        if isinstance(node, _NonFinite):
            where = _path(parts)
            raise InvalidRequest(
                f"Request body has {node.text} at {where}; JSON numbers must be finite: "
                "send a number or null.",
                param=where if parts else None,
            )
        if isinstance(node, dict):
            children: Any = node.items()
        elif isinstance(node, list):
            children = enumerate(node)
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequest(
                f"Request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep "
                f"(at {_path(parts)}); send a flatter body."
            )
        stack.extend((child, depth + 1, (*parts, key)) for key, child in children)


def load_json(raw: bytes | str) -> Any:
    """``raw`` parsed as strict JSON; InvalidRequest names what and where when it is not.

    Raises ``ValueError`` (``UnicodeDecodeError`` included) for text that is not JSON at all,
    as ``json.loads`` does.
    """
    seen_non_finite = False

    def non_finite(text: str) -> _NonFinite:
        nonlocal seen_non_finite
        seen_non_finite = True
        return _NonFinite(text)

    def parse_float(text: str) -> float | _NonFinite:
        number = float(text)
        return number if math.isfinite(number) else non_finite(text)

    try:
        value = json.loads(raw, parse_constant=non_finite, parse_float=parse_float)
    except RecursionError:
        raise InvalidRequest(
            f"Request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep; "
            "send a flatter body."
        ) from None
    # Counting brackets is a cheap bound: a body with few of them cannot be too deep. Past it,
    # the depth is measured level by level first; the walk that names where (building a path
    # for every node: most of the parse's cost on an agent's long history) runs only to refuse.
    brackets = (raw.count(b"[") + raw.count(b"{")) if isinstance(raw, bytes) else None
    if seen_non_finite or (
        (brackets is None or brackets > MAX_JSON_DEPTH) and deeper_than(value, MAX_JSON_DEPTH)
    ):
        _walk(value)
    return value


def check_identifier(value: str, field: str) -> str:
    """``value`` if it is Unicode text; InvalidRequest naming ``field`` if it holds an unpaired
    surrogate (every surrogate in a Python str from JSON is unpaired: pairs are joined)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"{field} holds an unpaired UTF-16 surrogate ({value[exc.start]!a} at character "
            f"{exc.start}), which is not Unicode text; send {field} as valid UTF-8.",
            param=field,
        ) from None
    return value


def header_text(value: str, header: str) -> str:
    """A header value used as an identifier, read as UTF-8.

    The server hands header values over decoded as latin-1 (every byte one character); an id
    sent as UTF-8 text is read back as that text, and bytes that are not UTF-8 are refused.
    """
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise InvalidRequest(
            f"The {header} header is not UTF-8 text; send it as UTF-8 (or ASCII).",
            param=header.lower(),
        ) from None


def check_identifiers(body: Mapping[str, Any]) -> None:
    """Every identifier field of a request body that is a string must be Unicode text."""
    for field in IDENTIFIER_FIELDS:
        value = body.get(field)
        if isinstance(value, str):
            check_identifier(value, field)


def parse_integer(raw: str, name: str, *, low: int = 0, high: int = MAX_INDEX) -> int:
    """A non-negative number a client sent as text (a query parameter, a header), checked before
    anything uses it: ASCII digits only (``int`` also takes ``"٣"`` and ``"1_000"``; ``isdigit``
    also passes ``"²"``, which ``int`` refuses) and within ``low..high``, so that a huge one
    cannot overflow SQLite mid-stream. InvalidRequest naming ``name`` otherwise."""
    text = raw.strip()
    # Length first: ``int`` of a long digit string costs time quadratic in its length.
    if (
        not text.isascii()
        or not text.isdigit()
        or len(text) > len(str(high))
        or not low <= (value := int(text)) <= high
    ):
        raise InvalidRequest(
            f"{name} must be an integer from {low} to {high}, got {raw[:40]!r}.", param=name
        )
    return value
