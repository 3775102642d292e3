"""OpenAI ``/v1/chat/completions`` and ``/v1/completions``: checks, usage and the stream tap.

Streamed usage only arrives if the request asks for it (``stream_options.include_usage``), so
``prepare_chat`` always asks, and the tap removes the usage-only chunk when the client did not.
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
    checked_usage,
    json_data,
    load_embedded,
    schema_chars,
    text_chars,
)

#: Delta fields that carry generated output (reasoning models stream ``reasoning_content`` or
#: ``reasoning`` before any ``content``).
_OUTPUT_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls")


def _force_usage(body: dict[str, Any], stream: bool) -> tuple[dict[str, Any], bool]:
    """The body with ``stream_options.include_usage`` on, and whether the client lacked it."""
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
    if not stream:
        return dict(body), False
    options = options or {}
    hide = options.get("include_usage") is not True
    return {**body, "stream_options": {**options, "include_usage": True}}, hide


def prepare_chat(body: dict[str, Any]) -> Prepared:
    """Check a chat request and force usage reporting; raises InvalidRequest with the remedy."""
    model = check_model(body, required=False)
    messages = check_list(body, "messages", required=True, what="chat messages")
    for index, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise InvalidRequest(
                f"'messages[{index}].role' must be a string such as \"user\".", param="messages"
            )
    tools = check_list(body, "tools", required=False, what="tool definitions")
    stream = check_bool(body, "stream")
    sent, hide = _force_usage(body, stream)
    chars = sum(text_chars(m.get("content")) for m in messages) + schema_chars(tools)
    return Prepared(Protocol.CHAT, model, stream, chars, sent, hide_usage=hide)


def prepare_completions(body: dict[str, Any]) -> Prepared:
    """Check a legacy completions request and force usage reporting."""
    model = check_model(body, required=False)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars = len(prompt)
    elif isinstance(prompt, list) and prompt:
        # A list of strings, or of token ids (which count as no characters).
        chars = sum(len(p) for p in prompt if isinstance(p, str))
    else:
        raise InvalidRequest(
            "'prompt' must be a string or a non-empty list of strings or token ids.",
            param="prompt",
        )
    stream = check_bool(body, "stream")
    sent, hide = _force_usage(body, stream)
    return Prepared(Protocol.COMPLETIONS, model, stream, chars, sent, hide_usage=hide)


def usage_from(payload: Any) -> tuple[Usage | None, str | None]:
    """Usage (and a refusal) from a chat or completions response or chunk's ``usage`` field."""
    if not isinstance(payload, dict) or not isinstance(payload.get("usage"), dict):
        return None, None
    usage = payload["usage"]
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return checked_usage(usage.get("prompt_tokens"), usage.get("completion_tokens"), cached)


def answer_from_body(payload: Any) -> dict[str, Any] | None:
    """The assistant message of a non-streamed chat answer (its first choice)."""
    if not isinstance(payload, dict):
        return None
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message")
    return message if isinstance(message, dict) else None


def _has_output(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    if isinstance(choice.get("text"), str) and choice["text"]:
        return True  # legacy completions
    delta = choice.get("delta")
    return isinstance(delta, dict) and any(delta.get(field) for field in _OUTPUT_FIELDS)


class ChatTap(SseTap):
    """The chat/completions stream tap.

    Reads usage from any chunk that has it (the last one wins, so ``continuous_usage_stats``
    works too), hides the usage-only chunk (``choices == []``) when ``hide_usage_chunk``, and, with
    ``collect_answer``, rebuilds the first choice's assistant message for program recognition.
    """

    def __init__(
        self,
        *,
        hide_usage_chunk: bool,
        collect_answer: bool = False,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        super().__init__(hide=hide_usage_chunk, max_event_bytes=max_event_bytes)
        self.hide_usage_chunk = hide_usage_chunk
        self.collect_answer = collect_answer
        self._text: list[str] = []
        # Per tool-call index: its id, and the function's name and arguments as streamed.
        self._calls: dict[int, dict[str, Any]] = {}

    def answer(self) -> dict[str, Any]:
        """The streamed assistant message, as the client will send it back next turn."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._text)}
        if self._calls:
            message["tool_calls"] = [
                {
                    "id": slot.get("id"),
                    "type": "function",
                    "function": {k: v for k, v in slot.items() if k != "id"},
                }
                for _, slot in sorted(self._calls.items())
            ]
        return message

    def _passes(self, chunk: bytes) -> bool:
        # As ``_skippable``, for a whole chunk, and without ``[DONE]``: the end must be seen.
        return (
            self.content_started
            and not self.collect_answer
            and b'"usage"' not in chunk
            and b'"error"' not in chunk
            and b"[DONE]" not in chunk
        )

    def _on_event(self, event: SseEvent) -> bool:
        data = event.data
        if data == b"[DONE]":
            self.complete = True
            return False
        if self._skippable(data, collecting=self.collect_answer):
            return False
        payload = json_data(event)
        if payload is None:
            return False
        error = payload.get("error")
        if error:
            message = error.get("message") if isinstance(error, dict) else error
            self.error = str(message)
        choices = payload.get("choices")
        if isinstance(choices, list) and choices:
            if not self.content_started and any(_has_output(c) for c in choices):
                self.content_started = True
            if self.collect_answer:
                self._collect(choices[0])
        if isinstance(payload.get("usage"), dict):
            usage = payload["usage"]
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            self._set_usage(usage.get("prompt_tokens"), usage.get("completion_tokens"), cached)
            return choices == []
        return False

    def _collect(self, choice: Any) -> None:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            return
        if isinstance(choice.get("text"), str):
            self._text.append(choice["text"])
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        if isinstance(delta.get("content"), str):
            self._text.append(delta["content"])
        calls = delta.get("tool_calls")
        if not isinstance(calls, list):
            return
        for call in calls:
            if not isinstance(call, dict):
                continue
            index = call.get("index", 0)
            slot = self._calls.setdefault(index if isinstance(index, int) else 0, {})
            if isinstance(call.get("id"), str) and call["id"]:
                slot["id"] = call["id"]
            function = call.get("function")
            if not isinstance(function, dict):
                continue
            if isinstance(function.get("name"), str):
                slot["name"] = slot.get("name", "") + function["name"]
            if isinstance(function.get("arguments"), str):
                slot["arguments"] = slot.get("arguments", "") + function["arguments"]


# --- normalisation for program recognition -----------------------------------------------------


def canonical_arguments(arguments: Any) -> Any:
    """Tool-call arguments as a value, so key order and spacing cannot break a match: clients
    often parse the model's JSON string and serialise it again."""
    if isinstance(arguments, str):
        try:
            return load_embedded(arguments)
        except ValueError:  # not JSON, or nested too deep to hash safely: compared as text
            return arguments.strip()
    return arguments


def content_parts(content: Any) -> list[Any]:
    """A message content as comparable parts: text (stripped, since some clients trim answers)
    and any other part (images) as its JSON value."""
    if isinstance(content, str):
        text = content.strip()
        return [text] if text else []
    parts: list[Any] = []
    if isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                text = part.strip()
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                text = part["text"].strip()
            else:
                parts.append(part)
                continue
            if text:
                parts.append(text)
    return parts


def tool_call_value(name: Any, call_id: Any, arguments: Any) -> list[Any]:
    """A tool call as a comparable value: its name and id. Clients send the id back exactly (the
    tool's result refers to it) and the server makes it unique, while the arguments may come back
    re-serialised, or, cut off at the token limit, parsed differently by each SDK. Without an id
    the arguments stand in."""
    if isinstance(call_id, str) and call_id:
        return [name, call_id]
    return [name, canonical_arguments(arguments)]


def message_element(message: Any) -> Any:
    """One chat message as a comparable value. Reasoning is left out: clients do not send it
    back."""
    if not isinstance(message, dict):
        return ["?", message]
    calls = message.get("tool_calls")
    call_values = []
    if isinstance(calls, list):
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                call_values.append(
                    tool_call_value(function.get("name"), call.get("id"), function.get("arguments"))
                )
    return [message.get("role"), content_parts(message.get("content")), call_values]


def chain_elements(body: dict[str, Any]) -> list[Any]:
    """The request's prompt as a list of comparable values, one per message."""
    messages = body.get("messages")
    return [message_element(m) for m in messages] if isinstance(messages, list) else []


def answer_elements(answer: Any) -> list[Any]:
    """The answer (an assistant message, or its text) as the elements it adds to the prompt."""
    if isinstance(answer, str):
        answer = {"role": "assistant", "content": answer}
    return [message_element(answer)] if isinstance(answer, dict) else []
