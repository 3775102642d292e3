"""OpenAI ``/v1/responses``: checks, usage and the stream tap.

Nothing needs forcing upstream: the final ``response.completed`` event (or ``response.incomplete``
/ ``response.failed``) always carries the response with its ``usage`` and ``output``. Its ``id`` is
what a later request names in ``previous_response_id``; the tap keeps it for program recognition.
vLLM keeps stored responses in the serving process, so a ``previous_response_id`` chain must stay
on the backend that answered it: recognising the chain as one program keeps it there.
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
    schema_chars,
    text_chars,
)
from .openai_chat import content_parts, tool_call_value

#: Events that carry the whole response, usage included.
_FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
_FINAL_MARKERS = (b"response.completed", b"response.incomplete", b"response.failed", b'"error"')


def _item_chars(item: Any) -> int:
    if not isinstance(item, dict):
        return 0
    return (
        text_chars(item.get("content"))
        + text_chars(item.get("output"))
        + (len(item["arguments"]) if isinstance(item.get("arguments"), str) else 0)
    )


def prepare_responses(body: dict[str, Any]) -> Prepared:
    """Check a Responses request; raises InvalidRequest with the remedy."""
    model = check_model(body, required=False)
    items = body.get("input")
    if isinstance(items, str):
        chars = len(items)
    elif isinstance(items, list):
        chars = sum(_item_chars(item) for item in items)
    else:
        raise InvalidRequest("'input' must be a string or a list of input items.", param="input")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise InvalidRequest(
            "'previous_response_id' must be the id of an earlier response.",
            param="previous_response_id",
        )
    if previous is not None and body.get("previous_response") is not None:
        raise InvalidRequest(
            "Set either 'previous_response_id' or 'previous_response', not both.",
            param="previous_response_id",
        )
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("'instructions' must be a string.", param="instructions")
    tools = check_list(body, "tools", required=False, what="tool definitions")
    stream = check_bool(body, "stream")
    chars += len(instructions or "") + schema_chars(tools)
    return Prepared(Protocol.RESPONSES, model, stream, chars, dict(body))


def usage_from(payload: Any) -> tuple[Usage | None, str | None]:
    """Usage (and a refusal) from a response object (a non-streamed answer, or the ``response``
    of a final stream event)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("usage"), dict):
        return None, None
    usage = payload["usage"]
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return checked_usage(usage.get("input_tokens"), usage.get("output_tokens"), cached)


def answer_from_body(payload: Any) -> list[Any] | None:
    """The output items of a non-streamed response."""
    if not isinstance(payload, dict) or not isinstance(payload.get("output"), list):
        return None
    output: list[Any] = payload["output"]
    return output


def response_id_from_body(payload: Any) -> str | None:
    """The response's ``id``, which a later request may name as ``previous_response_id``."""
    if isinstance(payload, dict) and isinstance(payload.get("id"), str) and payload["id"]:
        response_id: str = payload["id"]
        return response_id
    return None


class ResponsesTap(SseTap):
    """The Responses stream tap: usage, id and output from the final response event, errors from
    ``error`` events and failed responses, content from the first ``*.delta`` event."""

    def __init__(self, *, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        super().__init__(hide=False, max_event_bytes=max_event_bytes)
        self._output: list[Any] = []

    def answer(self) -> list[Any]:
        """The response's output items, as the client will send them back next turn."""
        return self._output

    def _passes(self, chunk: bytes) -> bool:
        # What ``_on_event`` skips unread, for a whole chunk (an ``error`` event's name too).
        return (
            self.content_started
            and b"error" not in chunk
            and not any(m in chunk for m in _FINAL_MARKERS)
        )

    def _on_event(self, event: SseEvent) -> bool:
        if self.content_started and not any(m in event.data for m in _FINAL_MARKERS):
            return False
        payload = json_data(event)
        if payload is None:
            return False
        kind = payload.get("type", event.name)
        if not isinstance(kind, str):
            return False
        if kind.endswith(".delta"):
            self.content_started = True
        elif kind == "error":
            self.error = str(payload.get("message") or payload.get("code") or "upstream error")
        elif kind == "response.created" or kind in _FINAL_EVENTS:
            response = payload.get("response")
            self.response_id = response_id_from_body(response) or self.response_id
            if kind in _FINAL_EVENTS and isinstance(response, dict):
                self._final(kind, response)
            if kind in _FINAL_EVENTS:
                self.complete = True
        return False

    def _final(self, kind: str, response: dict[str, Any]) -> None:
        self._accept(*usage_from(response))
        self._output = answer_from_body(response) or []
        error = response.get("error")
        if kind == "response.failed" and isinstance(error, dict):
            self.error = str(error.get("message") or error.get("code") or "response failed")


# --- normalisation for program recognition -----------------------------------------------------


def item_element(item: Any) -> Any:
    """One input or output item as a comparable value (None for reasoning, which clients may or
    may not send back). Ids and statuses are left out: only the conversation must match."""
    if isinstance(item, str):
        return ["user", content_parts(item)]
    if not isinstance(item, dict):
        return ["?", item]
    kind = item.get("type")
    if kind == "reasoning":
        return None
    if "role" in item and kind in (None, "message"):
        return [item.get("role"), content_parts(item.get("content"))]
    if kind == "function_call":
        value = tool_call_value(item.get("name"), item.get("call_id"), item.get("arguments"))
        return ["function_call", *value]
    if kind == "function_call_output":
        return ["function_call_output", content_parts(item.get("output"))]
    return {k: v for k, v in item.items() if k not in ("id", "call_id", "status")}


def _elements(items: Any) -> list[Any]:
    if isinstance(items, str):
        return [item_element(items)]
    if not isinstance(items, list):
        return []
    values = (item_element(item) for item in items)
    return [v for v in values if v is not None]


def chain_elements(body: dict[str, Any]) -> list[Any]:
    """The request's prompt as comparable values: the instructions, then one per input item."""
    if "input" not in body:
        return []
    return [["instructions", content_parts(body.get("instructions"))]] + _elements(body["input"])


def answer_elements(answer: Any) -> list[Any]:
    """The answer (output items, or a plain text) as the elements it adds to the prompt."""
    if isinstance(answer, str):
        return [["assistant", content_parts(answer)]]
    return _elements(answer)
