"""Watching an OpenAI-style SSE stream for usage, with the option to hide the usage chunk.

The proxy always asks the backend for ``stream_options.include_usage`` so it learns every step's
token counts; when the client did not ask for that chunk, it is removed from what the client sees.
Complete events are passed on as soon as they arrive: nothing waits beyond an event's own end.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from ..errors import ThunderproxyError
from ..programs import StepUsage
from .errors import sse_error_event

if TYPE_CHECKING:
    from ..gateway import Call

_EVENT_END = re.compile(rb"\r?\n\r?\n")


def usage_from(payload: Any) -> StepUsage | None:
    """StepUsage from a response or chunk object's ``usage`` field, if it has one."""
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    completion = usage.get("completion_tokens")
    return StepUsage(
        prompt_tokens=usage["prompt_tokens"],
        completion_tokens=completion if isinstance(completion, int) else None,
        cached_tokens=cached if isinstance(cached, int) else None,
    )


class UsageTap:
    """Feed it the stream's bytes; it returns the bytes to forward and remembers the usage."""

    def __init__(self, *, hide_usage_chunk: bool) -> None:
        self.hide_usage_chunk = hide_usage_chunk
        self.usage: StepUsage | None = None
        self.error: str | None = None
        self._partial = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._partial + chunk if self._partial else chunk
        events = _EVENT_END.split(data)
        self._partial = events.pop()
        if not self.hide_usage_chunk:
            # Nothing to remove: pass the bytes on untouched and only read along.
            for event in events:
                self._inspect(event)
            return chunk
        kept = [event for event in events if not self._inspect(event)]
        return b"".join(event + b"\n\n" for event in kept)

    def flush(self) -> bytes:
        """Whatever trails the last complete event when the stream ends."""
        rest, self._partial = self._partial, b""
        usage_only = bool(rest.strip()) and self._inspect(rest)
        if not self.hide_usage_chunk or usage_only:
            return b""  # already forwarded as it arrived, or the hidden usage chunk
        return rest

    def _inspect(self, event: bytes) -> bool:
        """Record usage or an error in this event; True if it is a usage-only chunk."""
        if b'"usage"' not in event and b'"error"' not in event:
            return False
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            try:
                payload = json.loads(line[5:])
            except ValueError:
                continue
            if not isinstance(payload, dict):
                continue
            if "error" in payload:
                error = payload["error"]
                message = error.get("message") if isinstance(error, dict) else error
                self.error = str(message)
            usage = usage_from(payload)
            if usage is not None:
                self.usage = usage
                return payload.get("choices") == []
        return False


class OpenAIWire:
    """Chat and text completions (OpenAI's API as vLLM and SGLang serve it)."""

    def tap(self, call: Call) -> UsageTap:
        return UsageTap(hide_usage_chunk=call.hide_usage)

    def usage_from_body(self, body: bytes) -> StepUsage | None:
        return usage_from(json.loads(body))

    def error_event(self, error: ThunderproxyError) -> bytes:
        return sse_error_event(error)


OPENAI = OpenAIWire()
