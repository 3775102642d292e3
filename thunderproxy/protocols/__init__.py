"""The wire protocols agents speak, each turned into what the gateway needs and back.

One module per protocol (``openai_chat``: chat and legacy completions, ``anthropic``: Messages,
``responses``: OpenAI Responses), sharing ``base``. This package only reads and checks; it does
no I/O, so the gateway calls it with bytes and JSON it already has:

    protocol = ROUTES[path]                        # or None: not a scheduled route
    prepared = prepare(protocol, body)             # raises InvalidRequest; error_body() renders it
    tap = new_tap(prepared, collect_answer=True)   # streamed answers
    forwarded = tap.feed(chunk); ...; tail = tap.flush()
    usage, problem = read_usage(protocol, payload) # non-streamed answers
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Iterator
from typing import Any

from ..errors import InvalidRequest, ThunderproxyError, describe
from . import anthropic, openai_chat, responses
from .anthropic import MessagesTap
from .base import (
    MAX_EVENT_BYTES,
    MAX_NESTING,
    MAX_TOKENS,
    Prepared,
    Protocol,
    SseTap,
    TooDeep,
    Usage,
    error_body,
    load_embedded,
    sse_error_event,
    without_empty_tools,
)
from .openai_chat import ChatTap
from .responses import ResponsesTap, response_id_from_body

#: The scheduled routes: each call through them is one step of a program.
ROUTES: dict[str, Protocol] = {
    "/v1/chat/completions": Protocol.CHAT,
    "/v1/completions": Protocol.COMPLETIONS,
    "/v1/messages": Protocol.MESSAGES,
    "/v1/responses": Protocol.RESPONSES,
}

#: Routes that are checked in their protocol's terms but generate nothing, so need no scheduling:
#: the gateway passes them to the program's backend (or any healthy one) straight away.
UNSCHEDULED_ROUTES: dict[str, Protocol] = {"/v1/messages/count_tokens": Protocol.MESSAGES}


def prepare(protocol: Protocol, body: dict[str, Any]) -> Prepared:
    """Check ``body`` for ``protocol`` and return what the call needs (raises InvalidRequest)."""
    check_embedded_json(protocol, body)
    if protocol is Protocol.CHAT:
        prepared = openai_chat.prepare_chat(body)
    elif protocol is Protocol.COMPLETIONS:
        prepared = openai_chat.prepare_completions(body)
    elif protocol is Protocol.MESSAGES:
        prepared = anthropic.prepare_messages(body)
    else:
        prepared = responses.prepare_responses(body)
    sent = without_empty_tools(prepared.body)
    return prepared if sent is prepared.body else dataclasses.replace(prepared, body=sent)


def _has_id(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _embedded_json(protocol: Protocol, body: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """The strings of a request that program recognition parses as JSON, with where each is:
    the arguments of a tool call without an id (chat, Responses; with an id, the id is compared
    and the arguments never parsed: ``tool_call_value``) and a Claude Code ``metadata.user_id``
    (Messages)."""
    if protocol is Protocol.CHAT:
        messages = body.get("messages")
        for i, message in enumerate(messages if isinstance(messages, list) else ()):
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            for j, call in enumerate(calls if isinstance(calls, list) else ()):
                if not isinstance(call, dict) or _has_id(call.get("id")):
                    continue
                function = call.get("function")
                arguments = function.get("arguments") if isinstance(function, dict) else None
                if isinstance(arguments, str):
                    yield f"messages[{i}].tool_calls[{j}].function.arguments", arguments
    elif protocol is Protocol.RESPONSES:
        items = body.get("input")
        for i, item in enumerate(items if isinstance(items, list) else ()):
            if not isinstance(item, dict) or item.get("type") != "function_call":
                continue
            arguments = item.get("arguments")
            if isinstance(arguments, str) and not _has_id(item.get("call_id")):
                yield f"input[{i}].arguments", arguments
    elif protocol is Protocol.MESSAGES:
        metadata = body.get("metadata")
        user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
        if isinstance(user_id, str) and user_id.lstrip().startswith("{"):
            yield "metadata.user_id", user_id


def check_embedded_json(protocol: Protocol, body: dict[str, Any]) -> None:
    """Refuse JSON inside a request's strings nested past ``MAX_NESTING`` levels, as the body
    itself is: parsing it for recognition would recurse past what Python can (a 500 before)."""
    for where, text in _embedded_json(protocol, body):
        if text.count("[") + text.count("{") <= MAX_NESTING:
            continue  # too few brackets to nest that deep: not parsed here
        try:
            load_embedded(text)
        except TooDeep as exc:
            raise InvalidRequest(
                f"{where} holds JSON that {exc}; send flatter JSON.", param=where
            ) from None
        except ValueError:
            continue  # not JSON: read as text


def tap_for(
    protocol: Protocol, *, hide_usage: bool = False, collect_answer: bool = False
) -> SseTap:
    """The stream tap of ``protocol``. ``hide_usage`` (chat and completions) removes the usage
    chunk the client did not ask for; ``collect_answer`` rebuilds the answer for
    ``observe_answer`` (Responses answers come whole in their final event either way)."""
    if protocol in (Protocol.CHAT, Protocol.COMPLETIONS):
        return ChatTap(hide_usage_chunk=hide_usage, collect_answer=collect_answer)
    if protocol is Protocol.MESSAGES:
        return MessagesTap(collect_answer=collect_answer)
    return ResponsesTap()


def new_tap(prepared: Prepared, *, collect_answer: bool = False) -> SseTap:
    """The stream tap for a prepared call."""
    return tap_for(prepared.protocol, hide_usage=prepared.hide_usage, collect_answer=collect_answer)


class CallView(typing.Protocol):
    """What a wire reads of the gateway's ``Call``: this package sits below the gateway."""

    @property
    def hide_usage(self) -> bool: ...


class ProtocolWire:
    """The gateway's ``Wire`` for one call of any protocol (``Call.wire``).

    Make one per call: it keeps the tap it hands the gateway, so that once the stream is over
    the edge can read what the gateway does not need: ``answer()`` for ``observe_answer`` and
    ``response_id`` for ``remember_response``.
    """

    def __init__(self, protocol: Protocol, *, collect_answer: bool = False) -> None:
        self.protocol = protocol
        self.collect_answer = collect_answer
        self.last_tap: SseTap | None = None

    def tap(self, call: CallView) -> SseTap:
        self.last_tap = tap_for(
            self.protocol, hide_usage=call.hide_usage, collect_answer=self.collect_answer
        )
        return self.last_tap

    def usage_from_body(self, body: bytes) -> tuple[Usage | None, str | None]:
        """Usage of a whole answer and a note on it; raises ValueError if it is not JSON."""
        return read_usage(self.protocol, json.loads(body))

    def error_event(self, error: ThunderproxyError) -> bytes:
        status, error_type = describe(error)
        return sse_error_event(self.protocol, status, error_type, error.message, param=error.param)


def read_usage(protocol: Protocol, payload: Any) -> tuple[Usage | None, str | None]:
    """Usage of a non-streamed answer, and why it was refused (negative counts) if it was."""
    if protocol is Protocol.MESSAGES:
        return anthropic.usage_from(payload)
    if protocol is Protocol.RESPONSES:
        return responses.usage_from(payload)
    return openai_chat.usage_from(payload)


def usage_from_body(protocol: Protocol, payload: Any) -> Usage | None:
    """Usage of a non-streamed answer; None when absent or refused (``read_usage`` says why)."""
    return read_usage(protocol, payload)[0]


def answer_from_body(protocol: Protocol, payload: Any) -> Any:
    """The answer of a non-streamed call, in the shape ``observe_answer`` takes."""
    if protocol is Protocol.MESSAGES:
        return anthropic.answer_from_body(payload)
    if protocol is Protocol.RESPONSES:
        return responses.answer_from_body(payload)
    if protocol is Protocol.COMPLETIONS:
        return None  # a plain prompt string has no message structure to continue
    return openai_chat.answer_from_body(payload)


def chain_elements(protocol: Protocol, body: dict[str, Any]) -> list[Any]:
    """The prompt of a request as comparable values, one per message (or input item)."""
    if protocol is Protocol.MESSAGES:
        return anthropic.chain_elements(body)
    if protocol is Protocol.RESPONSES:
        return responses.chain_elements(body)
    if protocol is Protocol.COMPLETIONS:
        return []
    return openai_chat.chain_elements(body)


def answer_elements(protocol: Protocol, answer: Any) -> list[Any]:
    """The elements an answer adds to the prompt of the next call."""
    if protocol is Protocol.MESSAGES:
        return anthropic.answer_elements(answer)
    if protocol is Protocol.RESPONSES:
        return responses.answer_elements(answer)
    if protocol is Protocol.COMPLETIONS:
        return []
    return openai_chat.answer_elements(answer)


__all__ = [
    "MAX_EVENT_BYTES",
    "MAX_TOKENS",
    "ROUTES",
    "UNSCHEDULED_ROUTES",
    "ChatTap",
    "ProtocolWire",
    "MessagesTap",
    "Prepared",
    "Protocol",
    "ResponsesTap",
    "SseTap",
    "Usage",
    "answer_elements",
    "answer_from_body",
    "chain_elements",
    "CallView",
    "error_body",
    "new_tap",
    "prepare",
    "read_usage",
    "response_id_from_body",
    "sse_error_event",
    "tap_for",
    "usage_from_body",
]
