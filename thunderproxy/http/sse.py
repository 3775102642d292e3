"""Watching an OpenAI-style SSE stream for usage, with the option to hide the usage chunk.

The proxy always asks the backend for ``stream_options.include_usage`` so it learns every step's
token counts; when the client did not ask for that chunk, it is removed from what the client sees.
Complete events are passed on as soon as they arrive: nothing waits beyond an event's own end.
What a backend reports is not trusted: one event is bounded in size, usage counts in range.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import BackendProtocolError
from ..programs import StepUsage

_EVENT_END = re.compile(rb"\r?\n\r?\n")
#: Longest event end (``\r\n\r\n``) less one: how far back a new chunk may complete one.
_END_OVERLAP = 3
#: Most bytes of one upstream SSE event held while waiting for its end. vLLM's chunks are a few
#: hundred bytes; an event this long is a broken or hostile backend, and the stream is cut.
MAX_EVENT_BYTES = 1 << 20
#: Largest token count taken as reported; larger counts are clamped to it and noted.
MAX_USAGE_TOKENS = 2**31
#: Longest upstream error message kept for the audit log.
MAX_ERROR_CHARS = 500
_COUNTS = ("prompt_tokens", "completion_tokens", "cached_tokens")


def _count(value: Any) -> int | None:
    # bool is an int in Python, never a token count.
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_usage(payload: Any) -> tuple[StepUsage | None, str | None]:
    """StepUsage from a response or chunk object's ``usage`` field, and a note when the counts
    were not believable: a negative count drops the usage (a backend fault), a count past
    MAX_USAGE_TOKENS is clamped to it."""
    if not isinstance(payload, dict):
        return None, None
    usage = payload.get("usage")
    if not isinstance(usage, dict) or _count(usage.get("prompt_tokens")) is None:
        return None, None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    counts = {
        "prompt_tokens": _count(usage["prompt_tokens"]),
        "completion_tokens": _count(usage.get("completion_tokens")),
        "cached_tokens": _count(cached),
    }
    negative = [name for name in _COUNTS if (counts[name] or 0) < 0]
    if negative:
        return None, f"backend reported negative usage ({', '.join(negative)}); usage ignored"
    huge = [name for name in _COUNTS if (counts[name] or 0) > MAX_USAGE_TOKENS]
    note = None
    if huge:
        note = f"backend reported usage over 2^31 tokens ({', '.join(huge)}); clamped to 2^31"
        counts = {k: None if v is None else min(v, MAX_USAGE_TOKENS) for k, v in counts.items()}
    return StepUsage(**counts), note


def usage_from(payload: Any) -> StepUsage | None:
    """StepUsage from a response or chunk object's ``usage`` field, if it has a believable one."""
    return read_usage(payload)[0]


def load_backend_json(content: bytes | bytearray) -> Any:
    """A backend's JSON, or ValueError; nesting too deep for the parser is a ValueError too."""
    try:
        return json.loads(content)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None


def usage_from_body(content: bytes) -> tuple[StepUsage | None, str | None]:
    """Usage of a non-streamed 200 answer, and a note on what was wrong with it, if anything."""
    try:
        payload = load_backend_json(content)
    except ValueError:
        return None, "backend answered 200 with a body that is not JSON"
    return read_usage(payload)


class UsageTap:
    """Feed it the stream's bytes; it returns the bytes to forward and remembers the usage.

    Only whole events are passed on, each as soon as its end arrives, with its own bytes (the
    hidden usage chunk left out). The unfinished event is the only thing held: each byte is
    searched for an event end once, and past ``max_event_bytes`` the stream is refused with
    BackendProtocolError.
    """

    def __init__(self, *, hide_usage_chunk: bool, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.hide_usage_chunk = hide_usage_chunk
        self.max_event_bytes = max_event_bytes
        self.usage: StepUsage | None = None
        self.upstream_error: str | None = None
        self.usage_note: str | None = None
        self._partial = bytearray()

    @property
    def error(self) -> str | None:
        """What the step's ``error`` column says: the backend's error event and any usage note."""
        parts = [part for part in (self.upstream_error, self.usage_note) if part]
        return "; ".join(parts) or None

    def feed(self, chunk: bytes) -> bytes:
        buffer = self._partial
        # Only the tail can complete an event end begun in the bytes already searched.
        pos = max(0, len(buffer) - _END_OVERLAP)
        buffer += chunk
        out = bytearray()
        start = 0
        while (match := _EVENT_END.search(buffer, pos)) is not None:
            event = bytes(buffer[start : match.start()])
            if not (self._inspect(event) and self.hide_usage_chunk):
                out += buffer[start : match.end()]
            start = pos = match.end()
        del buffer[:start]
        if len(buffer) > self.max_event_bytes:
            size = len(buffer)
            buffer.clear()
            raise BackendProtocolError(
                f"The backend sent {size} bytes of one SSE event without ending it (the limit is "
                f"{self.max_event_bytes}); the stream was cut there. vLLM and SGLang never send "
                "such events: check what answers at the backend URL."
            )
        return bytes(out)

    def flush(self) -> bytes:
        """Whatever trails the last complete event when the stream ends."""
        rest = bytes(self._partial)
        self._partial.clear()
        usage_only = bool(rest.strip()) and self._inspect(rest)
        if usage_only and self.hide_usage_chunk:
            return b""  # the hidden usage chunk
        return rest

    def _inspect(self, event: bytes) -> bool:
        """Record usage or an error in this event; True if it is a usage-only chunk."""
        if b'"usage"' not in event and b'"error"' not in event:
            return False
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            try:
                payload = load_backend_json(line[5:])
            except ValueError:
                continue
            if not isinstance(payload, dict):
                continue
            if "error" in payload:
                error = payload["error"]
                message = error.get("message") if isinstance(error, dict) else error
                self.upstream_error = str(message)[:MAX_ERROR_CHARS]
            usage, note = read_usage(payload)
            if note is not None:
                self.usage_note = note
            if usage is not None:
                self.usage = usage
            if isinstance(payload.get("usage"), dict):
                # The usage-only chunk is hidden even when its counts were not believed.
                return payload.get("choices") == []
        return False
