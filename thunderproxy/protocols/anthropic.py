"""Anthropic ``/v1/messages`` (and ``/v1/messages/count_tokens``): checks, usage and the tap.

Nothing needs forcing upstream: a Messages stream reports usage by itself, in ``message_start``
(input and cache tokens) and ``message_delta`` (output tokens, cumulative; newer servers repeat the
input counts there). vLLM's own Messages endpoint asks its engine for usage on every streamed call.

Anthropic counts ``input_tokens`` *without* the cached part: the whole prompt is
``input_tokens + cache_read_input_tokens + cache_creation_input_tokens``. vLLM reports the whole
prompt as ``input_tokens`` and no cache fields, which the same sum reads correctly.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequest
from .base import (
    MAX_EVENT_BYTES,
    Prepared,
    Protocol,
    SseEvent,
    SseTap,
    Usage,
    check_bool,
    check_list,
    check_model,
    check_positive_int,
    checked_usage,
    json_data,
    schema_chars,
    text_chars,
    without_empty_tools,
)
from .openai_chat import canonical_arguments, content_parts, tool_call_value

#: Claude Code puts a per-request billing hash in a system block that starts with this; it would
#: make every request look new, so it is not part of the prompt's identity (vLLM drops it too).
BILLING_HEADER_PREFIX = "x-anthropic-billing-header"

#: Streamed blocks whose deltas are generated output.
_OUTPUT_DELTAS = frozenset({"text_delta", "input_json_delta", "thinking_delta"})


def _check_messages(body: dict[str, Any]) -> list[Any]:
    messages = check_list(body, "messages", required=True, what="messages")
    for index, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise InvalidRequest(
                f'\'messages[{index}].role\' must be "user" or "assistant".', param="messages"
            )
        content = message.get("content")
        if not isinstance(content, str | list):
            raise InvalidRequest(
                f"'messages[{index}].content' must be a string or a list of content blocks.",
                param="messages",
            )
    system = body.get("system")
    if system is not None and not isinstance(system, str | list):
        raise InvalidRequest("'system' must be a string or a list of text blocks.", param="system")
    return messages


def _prompt_chars(body: dict[str, Any], messages: list[Any]) -> int:
    return (
        text_chars(body.get("system"))
        + sum(text_chars(m.get("content")) for m in messages)
        + schema_chars(body.get("tools"))
    )


def prepare_messages(body: dict[str, Any]) -> Prepared:
    """Check a Messages request (``model``, ``max_tokens`` and ``messages`` are required by every
    backend that serves it); raises InvalidRequest with the remedy."""
    model = check_model(body, required=True)
    check_positive_int(body, "max_tokens", required=True)
    messages = _check_messages(body)
    check_list(body, "tools", required=False, what="tool definitions")
    stream = check_bool(body, "stream")
    return Prepared(Protocol.MESSAGES, model, stream, _prompt_chars(body, messages), dict(body))


def prepare_count_tokens(body: dict[str, Any]) -> Prepared:
    """Check a ``count_tokens`` request. It generates nothing, so it needs no scheduling: the
    gateway passes it straight to a backend (the program's own, if known)."""
    model = check_model(body, required=True)
    messages = _check_messages(body)
    sent = without_empty_tools(dict(body))
    return Prepared(Protocol.MESSAGES, model, False, _prompt_chars(body, messages), sent)


def _usage_counts(usage: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "input_tokens",
        "output_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
    )
    return {key: usage[key] for key in keys if key in usage}


def _to_usage(counts: dict[str, Any]) -> tuple[Usage | None, str | None]:
    ints = {
        key: value
        for key, value in counts.items()
        if isinstance(value, int) and not isinstance(value, bool)
    }
    if any(value < 0 for value in ints.values()):
        return None, (
            f"upstream reported negative token counts ({counts}); the usage of this call is unknown"
        )
    if "input_tokens" not in ints:
        return None, None
    cached = ints.get("cache_read_input_tokens")
    prompt = ints["input_tokens"] + (cached or 0) + ints.get("cache_creation_input_tokens", 0)
    return checked_usage(prompt, ints.get("output_tokens"), cached)


def usage_from(payload: Any) -> tuple[Usage | None, str | None]:
    """Usage (and a refusal) from a non-streamed Messages response."""
    if not isinstance(payload, dict) or not isinstance(payload.get("usage"), dict):
        return None, None
    return _to_usage(_usage_counts(payload["usage"]))


def answer_from_body(payload: Any) -> dict[str, Any] | None:
    """The assistant message of a non-streamed Messages answer."""
    if not isinstance(payload, dict) or not isinstance(payload.get("content"), list):
        return None
    return {"role": "assistant", "content": payload["content"]}


class MessagesTap(SseTap):
    """The Messages stream tap: usage from ``message_start`` and ``message_delta``, errors from
    ``error`` events, content from the first generated delta. Nothing is hidden."""

    def __init__(
        self, *, collect_answer: bool = False, max_event_bytes: int = MAX_EVENT_BYTES
    ) -> None:
        super().__init__(hide=False, max_event_bytes=max_event_bytes)
        self.collect_answer = collect_answer
        self._counts: dict[str, Any] = {}
        self._blocks: dict[int, dict[str, Any]] = {}
        self._json: dict[int, list[str]] = {}

    def answer(self) -> dict[str, Any]:
        """The streamed assistant message, as the client will send it back next turn."""
        content = []
        for index, block in sorted(self._blocks.items()):
            if index in self._json:
                block = {**block, "input": canonical_arguments("".join(self._json[index]))}
            content.append(block)
        return {"role": "assistant", "content": content}

    def _passes(self, chunk: bytes) -> bool:
        # As ``_skippable``, for a whole chunk; an ``error`` event's name counts too, and the
        # end (``message_stop``) must be seen.
        return (
            self.content_started
            and not self.collect_answer
            and b'"usage"' not in chunk
            and b"error" not in chunk
            and b"message_stop" not in chunk
        )

    def _on_event(self, event: SseEvent) -> bool:
        data = event.data
        if event.name == "message_stop" or b'"message_stop"' in data:
            self.complete = True
            return False
        if self._skippable(data, collecting=self.collect_answer):
            return False
        payload = json_data(event)
        if payload is None:
            return False
        kind = payload.get("type", event.name)
        if kind == "error":
            error = payload.get("error")
            message = error.get("message") if isinstance(error, dict) else error
            self.error = str(message)
        elif kind == "message_start":
            message = payload.get("message")
            if isinstance(message, dict) and isinstance(message.get("usage"), dict):
                self._read_usage(message["usage"])
        elif kind == "message_delta":
            if isinstance(payload.get("usage"), dict):
                self._read_usage(payload["usage"])
        elif kind == "content_block_delta":
            delta = payload.get("delta")
            if isinstance(delta, dict):
                if delta.get("type") in _OUTPUT_DELTAS:
                    self.content_started = True
                if self.collect_answer:
                    self._collect_delta(payload.get("index"), delta)
        elif kind == "content_block_start" and self.collect_answer:
            block = payload.get("content_block")
            index = payload.get("index")
            if isinstance(block, dict) and isinstance(index, int):
                self._blocks[index] = dict(block)
        return False

    def _read_usage(self, usage: dict[str, Any]) -> None:
        # message_delta carries cumulative counts; a field it leaves out keeps its start value.
        self._counts.update(_usage_counts(usage))
        self._accept(*_to_usage(self._counts))

    def _collect_delta(self, index: Any, delta: dict[str, Any]) -> None:
        if not isinstance(index, int):
            return
        block = self._blocks.setdefault(index, {"type": "text", "text": ""})
        if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
            block["text"] = block.get("text", "") + delta["text"]
        elif delta.get("type") == "input_json_delta" and isinstance(delta.get("partial_json"), str):
            self._json.setdefault(index, []).append(delta["partial_json"])


# --- normalisation for program recognition -----------------------------------------------------


def _block_value(block: Any) -> Any:
    """One content block as a comparable value; thinking and cache markers are left out (they
    are not the conversation, and Claude Code moves ``cache_control`` every turn)."""
    if isinstance(block, str):
        return block.strip() or None
    if not isinstance(block, dict):
        return block
    kind = block.get("type")
    if kind == "text":
        raw = block.get("text")
        text = raw.strip() if isinstance(raw, str) else ""
        if text.startswith(BILLING_HEADER_PREFIX):
            return None
        return text or None
    if kind in ("thinking", "redacted_thinking"):
        return None
    if kind == "tool_use":
        return [
            "tool_use",
            *tool_call_value(block.get("name"), block.get("id"), block.get("input")),
        ]
    if kind == "tool_result":
        return ["tool_result", content_parts(block.get("content"))]
    return {k: v for k, v in block.items() if k not in ("cache_control", "id")}


def _content_values(content: Any) -> list[Any]:
    blocks = [content] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        return []
    values = (_block_value(b) for b in blocks)
    return [v for v in values if v is not None]


def message_element(message: Any) -> Any:
    if not isinstance(message, dict):
        return ["?", message]
    return [message.get("role"), _content_values(message.get("content"))]


def chain_elements(body: dict[str, Any]) -> list[Any]:
    """The request's prompt as comparable values: the system prompt, then one per message."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    return [["system", _content_values(body.get("system"))]] + [
        message_element(m) for m in messages
    ]


def answer_elements(answer: Any) -> list[Any]:
    if isinstance(answer, str):
        answer = {"role": "assistant", "content": answer}
    return [message_element(answer)] if isinstance(answer, dict) else []
