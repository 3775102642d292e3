"""What every protocol shares: the neutral Usage, error bodies, body checks, and the SSE tap.

Each protocol module (openai_chat, anthropic, responses) turns its request into a ``Prepared``
(model, stream flag, prompt size, the body to send) and reads its own stream with a subclass of
``SseTap``. The tap is fed the upstream bytes in whatever splits they arrive, keeps a scan offset so
no byte is searched twice, and gives up reading (but keeps relaying) once one event grows past
``MAX_EVENT_BYTES``.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequest
from ..programs import StepUsage

#: The neutral token counts of one call. It is the scheduler's own record, so a tap's result goes
#: to ``end_step`` without conversion.
Usage = StepUsage

#: Largest single SSE event relayed (one chunk of one answer is a few hundred bytes, but a
#: ``response.completed`` event repeats the whole answer, and a tool call's arguments can come as
#: one delta of megabytes: at 1 MiB such answers were cut). An event is held until it ends, so
#: this is also what one stream may hold in memory. Past it the stream ends with the protocol's
#: error event and the step says why (PROTOCOLS.md).
MAX_EVENT_BYTES = 32 << 20

#: Token counts above this are a backend bug, not a prompt: no model has a context this long.
MAX_TOKENS = 100_000_000

#: Deepest nesting of arrays and objects the proxy reads, in a request body or in JSON held in
#: one of its strings (tool-call arguments, ``metadata.user_id``). Python's parser and encoder
#: recurse, so past ~1,000 levels they raise RecursionError; a bound well below keeps every later
#: walk (hashing, re-encoding) safe. A chat request needs ~6.
MAX_NESTING = 64

#: An SSE event ends at a blank line; "\r\n" line ends are allowed.
_EVENT_END = re.compile(rb"\r?\n\r?\n")
#: A boundary is at most 4 bytes, so a search resumes this far before where the last one stopped.
_BOUNDARY_OVERLAP = 3


class Protocol(enum.StrEnum):
    """The wire protocols the proxy schedules. The value is what audit rows and metrics show."""

    CHAT = "chat"  # OpenAI /v1/chat/completions
    COMPLETIONS = "completions"  # OpenAI /v1/completions (legacy, same stream format as chat)
    MESSAGES = "messages"  # Anthropic /v1/messages
    RESPONSES = "responses"  # OpenAI /v1/responses


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready to become a call: what the scheduler and the relay need."""

    protocol: Protocol
    model: str | None
    stream: bool
    #: Characters of prompt text (system, messages, tool schemas): the basis of token estimates.
    prompt_chars: int
    #: The body to send upstream (a copy; the client's body is never changed).
    body: dict[str, Any]
    #: Chat only: the proxy asked for the usage chunk the client did not, so the tap removes it.
    hide_usage: bool = False


def without_empty_tools(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` without ``tools: []`` (and the ``tool_choice`` that then chooses among none).
    An empty list offers nothing, and vLLM refuses it with a 400 ("`tools` must not be an empty
    array"); Claude Code sends one on its small background calls. A copy; ``body`` is kept."""
    if body.get("tools") != []:
        return body
    return {k: v for k, v in body.items() if k not in ("tools", "tool_choice")}


# --- JSON inside strings -----------------------------------------------------------------------


class TooDeep(ValueError):
    """JSON nested past ``MAX_NESTING`` levels."""


def deeper_than(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than ``limit`` levels deep (the top level is 1)."""
    level = [value] if isinstance(value, dict | list) else []
    depth = 1
    while level:
        if depth > limit:
            return True
        children: list[Any] = []
        for node in level:
            children.extend(node.values() if isinstance(node, dict) else node)
        level = [child for child in children if isinstance(child, dict | list)]
        depth += 1
    return False


def load_embedded(text: str, limit: int = MAX_NESTING) -> Any:
    """JSON held in a string (tool-call arguments, a session id), parsed with its nesting bounded.

    ValueError if it is not JSON; ``TooDeep`` (a ValueError) if it nests more than ``limit``
    levels, so a caller that treats unparseable text as text treats it the same way.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(f"nests arrays and objects more than {limit} levels deep") from None
    # Few brackets cannot nest deep: the walk is skipped for almost every string.
    if text.count("[") + text.count("{") > limit and deeper_than(value, limit):
        raise TooDeep(f"nests arrays and objects more than {limit} levels deep")
    return value


# --- errors ------------------------------------------------------------------------------------

#: Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_ANTHROPIC_KNOWN = frozenset(_ANTHROPIC_TYPES.values()) | {"api_error"}


def anthropic_error_type(status: int, error_type: str) -> str:
    """``error_type`` if Anthropic's clients know it, else the type Anthropic uses for ``status``
    (the proxy's own types, such as ``backend_timeout``, mean nothing to an Anthropic SDK)."""
    if error_type in _ANTHROPIC_KNOWN:
        return error_type
    return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def _error_payload(
    protocol: Protocol, status: int, error_type: str, message: str, param: str | None
) -> dict[str, Any]:
    if protocol is Protocol.MESSAGES:
        return {
            "type": "error",
            "error": {"type": anthropic_error_type(status, error_type), "message": message},
        }
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_body(
    protocol: Protocol, status: int, error_type: str, message: str, *, param: str | None = None
) -> bytes:
    """A JSON error body in ``protocol``'s own shape: Anthropic's
    ``{"type": "error", "error": {"type", "message"}}`` or OpenAI's
    ``{"error": {"message", "type", "param", "code"}}``."""
    return json.dumps(_error_payload(protocol, status, error_type, message, param)).encode()


def sse_error_event(
    protocol: Protocol, status: int, error_type: str, message: str, *, param: str | None = None
) -> bytes:
    """What a stream that already answered 200 ends with when the call fails mid-way, in the form
    that protocol's clients read: vLLM's ``data: {"error": ...}`` then ``[DONE]`` for chat and
    completions, an ``error`` event for Anthropic, and Responses' ``error`` event."""
    if protocol is Protocol.MESSAGES:
        payload = json.dumps(_error_payload(protocol, status, error_type, message, param))
        return f"event: error\ndata: {payload}\n\n".encode()
    if protocol is Protocol.RESPONSES:
        # The OpenAI SDK's ResponseErrorEvent: code is a string there.
        event = {"type": "error", "code": error_type, "message": message, "param": param}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    body = json.dumps(_error_payload(protocol, status, error_type, message, param))
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()


# --- body checks -------------------------------------------------------------------------------


def check_bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be true or false.", param=name)
    return value is True


def check_model(body: dict[str, Any], *, required: bool) -> str | None:
    model = body.get("model")
    if model is None and not required:
        return None
    if not isinstance(model, str) or not model.strip():
        raise InvalidRequest(
            "'model' must be a non-empty string naming a served model (GET /v1/models lists them).",
            param="model",
        )
    return model


def check_positive_int(body: dict[str, Any], name: str, *, required: bool) -> None:
    value = body.get(name)
    if value is None and not required:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"'{name}' must be a positive integer.", param=name)


def check_list(body: dict[str, Any], name: str, *, required: bool, what: str) -> list[Any]:
    value = body.get(name)
    if value is None and not required:
        return []
    if not isinstance(value, list) or (required and not value):
        raise InvalidRequest(f"'{name}' must be a non-empty list of {what}.", param=name)
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidRequest(f"'{name}[{index}]' must be an object ({what}).", param=name)
    return value


def text_chars(value: Any) -> int:
    """Characters of text in a content value: a string, or a list of parts with ``text``."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        total = 0
        for part in value:
            if isinstance(part, str):
                total += len(part)
            elif isinstance(part, dict):
                for key in ("text", "thinking"):
                    if isinstance(part.get(key), str):
                        total += len(part[key])
                if "content" in part:  # Anthropic tool_result blocks nest their content
                    total += text_chars(part["content"])
        return total
    return 0


def schema_chars(tools: Any) -> int:
    """Characters of tool schemas: the template renders them into the prompt, often at length."""
    if not isinstance(tools, list) or not tools:
        return 0
    return len(json.dumps(tools, separators=(",", ":"), ensure_ascii=False))


# --- usage -------------------------------------------------------------------------------------


def _count(value: Any) -> int | None:
    # bool is an int in Python; a backend that sends true has sent no count.
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def checked_usage(prompt: Any, completion: Any, cached: Any) -> tuple[Usage | None, str | None]:
    """Usage from raw counts: non-integers count as missing, negative counts refuse the whole
    reading (usage None and an error), counts past ``MAX_TOKENS`` are clamped, and cached tokens
    never exceed the prompt."""
    counts = [_count(prompt), _count(completion), _count(cached)]
    if any(c is not None and c < 0 for c in counts):
        return None, (
            f"upstream reported negative token counts (prompt={prompt}, completion={completion}, "
            f"cached={cached}); the usage of this call is unknown"
        )
    p, c, k = (None if v is None else min(v, MAX_TOKENS) for v in counts)
    if p is None:
        return None, None
    note = None
    if any(v is not None and v > MAX_TOKENS for v in counts):
        note = (
            f"upstream reported token counts past {MAX_TOKENS:,} (prompt={prompt}, "
            f"completion={completion}, cached={cached}); clamped"
        )
    if k is not None:
        k = min(k, p)
    return Usage(prompt_tokens=p, completion_tokens=c, cached_tokens=k), note


# --- the streaming tap -------------------------------------------------------------------------


@dataclass(frozen=True)
class SseEvent:
    """One parsed SSE event: its ``event:`` name (None if absent) and its ``data:`` lines joined."""

    name: str | None
    data: bytes


def parse_event(raw: bytes) -> SseEvent:
    name: str | None = None
    data: list[bytes] = []
    for line in raw.splitlines():
        if line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode("utf-8", "replace")
    return SseEvent(name, b"\n".join(data))


def json_data(event: SseEvent) -> dict[str, Any] | None:
    """The event's data as a JSON object, or None (``[DONE]``, keep-alives, malformed data)."""
    if not event.data or event.data == b"[DONE]":
        return None
    try:
        payload = json.loads(event.data)
    except (ValueError, RecursionError):  # malformed, or nested past what Python can parse
        return None
    return payload if isinstance(payload, dict) else None


class SseTap:
    """Feed it a stream's bytes; it returns the bytes to forward and reads usage along the way.

    Subclasses implement ``_on_event``; it returns True for an event the client must not see. With
    ``hide`` False nothing is ever removed. Either way complete events are forwarded as they end
    and a partial one is held until its blank line (a client cannot read it before): so an event
    past ``max_event_bytes`` is dropped whole, and the client's stream stays parseable up to the
    error event that replaces it.

    After the stream: ``usage`` (None if never reported), ``error`` (the upstream's own error
    event, a negative usage report, or an over-long event), and ``content_started`` (the stream
    has carried generated output: the moment the gateway takes as the first token).
    """

    def __init__(self, *, hide: bool = False, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.hide = hide
        self.max_event_bytes = max_event_bytes
        self.error: str | None = None
        self.content_started = False
        #: The protocol's own end of stream has passed (``[DONE]``, ``message_stop``, the final
        #: response event): the call is complete even if the connection is not closed yet.
        self.complete = False
        #: Responses only: the id a later ``previous_response_id`` names.
        self.response_id: str | None = None
        self.usage: Usage | None = None
        self._buffer = bytearray()
        self._scan_from = 0  # boundaries before this offset of _buffer were already searched
        self._overflowed = False
        self._refused = False

    def feed(self, chunk: bytes) -> bytes:
        if self._overflowed:
            return chunk
        if (
            chunk[-2:] == b"\n\n"
            and chunk[-3:-2] not in b"\r\n"  # (an empty slice is "in": too short, not taken)
            and not self._buffer
            and len(chunk) <= self.max_event_bytes
            and self._passes(chunk)
        ):
            # The relay's common chunk: whole events, none of which can matter. With nothing
            # held back and the chunk ending in a blank line that follows event text, its
            # events end exactly where it does; ``_passes`` found no marker of anything read.
            # So each event would be relayed unread and whole: relayed as one piece instead.
            return chunk
        self._buffer += chunk
        kept = bytearray()
        start = 0
        while True:
            match = _EVENT_END.search(self._buffer, max(start, self._scan_from - _BOUNDARY_OVERLAP))
            if match is None:
                break
            if match.start() - start > self.max_event_bytes:
                return self._overflow(kept)
            raw = bytes(self._buffer[start : match.start()])
            hidden = self._inspect(raw) and self.hide
            if not hidden:
                kept += self._buffer[start : match.end()]
            start = match.end()
        if start:
            # Only this chunk's trailing partial event is copied: each byte at most once.
            del self._buffer[:start]
        self._scan_from = len(self._buffer)
        # The partial event may hold up to 3 bytes of its closing blank line.
        if len(self._buffer) > self.max_event_bytes + _BOUNDARY_OVERLAP:
            return self._overflow(kept)
        return bytes(kept)

    def flush(self) -> bytes:
        """Whatever trails the last complete event when the stream ends."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        self._scan_from = 0
        if not rest:
            return b""
        if len(rest.rstrip(b"\r\n")) > self.max_event_bytes:
            self._give_up()
            return b""
        if self._inspect(rest) and self.hide:
            return b""  # an event the client must not see
        return rest

    def _overflow(self, kept: bytearray) -> bytes:
        """The event held in the buffer is too long: it is dropped, the complete events before it
        go out, and nothing more of the stream is read."""
        self._give_up()
        self._buffer.clear()
        return bytes(kept)

    def _give_up(self) -> None:
        self._overflowed = True
        # What was read before is only part of the call's usage: report none rather than part.
        self.usage = None
        self._refused = True
        self.error = (
            f"an upstream SSE event grew past {self.max_event_bytes} bytes, the most the proxy "
            "relays; the stream was ended there (its usage is unknown)"
        )

    def _passes(self, chunk: bytes) -> bool:
        """Whether every event in ``chunk`` (whole events only) is one ``_on_event`` would
        neither read nor hide: a byte scan for the markers of what it reads. A chunk that
        names one, or any chunk before the first token, is read event by event."""
        return False

    def _skippable(self, data: bytes, *, collecting: bool) -> bool:
        """After the first token, an event that names neither usage nor an error matters only
        for answer collection: its JSON need not be parsed."""
        return (
            self.content_started
            and not collecting
            and b'"usage"' not in data
            and b'"error"' not in data
        )

    @property
    def overflowed(self) -> bool:
        """An event grew past ``max_event_bytes``: the stream cannot be read any further."""
        return self._overflowed

    def answer(self) -> Any:
        """The streamed answer in the shape ``ProgramRecognizer.observe_answer`` takes."""
        raise NotImplementedError

    def _inspect(self, raw: bytes) -> bool:
        if not raw.strip():
            return False
        return self._on_event(parse_event(raw))

    def _on_event(self, event: SseEvent) -> bool:
        raise NotImplementedError

    def _set_usage(self, prompt: Any, completion: Any, cached: Any) -> None:
        self._accept(*checked_usage(prompt, completion, cached))

    def _accept(self, usage: Usage | None, error: str | None) -> None:
        if self._refused:
            return  # one negative report makes the whole call's usage unknown
        if error is not None:
            self.error = error
        if usage is None and error is not None:
            self.usage = None
            self._refused = True
        elif usage is not None:
            self.usage = usage
