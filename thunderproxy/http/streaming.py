"""Whether an upstream response is a stream, by four rules (``is_streaming``). Passthrough
relays every answer chunk by chunk; a plain one also keeps the backend's Content-Length."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

Headers = Mapping[str, str] | Iterable[tuple[str, str]]

#: Content types that are streams whatever else the headers say.
STREAM_TYPES = ("text/event-stream", "application/x-ndjson")


def _items(headers: Headers) -> Iterable[tuple[str, str]]:
    return headers.items() if isinstance(headers, Mapping) else headers


def is_streaming(headers: Headers) -> bool:
    """True for SSE, NDJSON, chunked transfer encoding, or any content type naming "stream".

    Header names are matched case-insensitively, and the content type without its parameters
    (``text/event-stream; charset=utf-8`` is SSE). A client may be reading such a body as it is
    produced.
    """
    content_type = ""
    chunked = False
    for name, value in _items(headers):
        key = name.lower()
        if key == "content-type":
            content_type = value.split(";", 1)[0].strip().lower()
        elif key == "transfer-encoding":
            chunked = chunked or "chunked" in value.lower()
    return content_type in STREAM_TYPES or chunked or "stream" in content_type
