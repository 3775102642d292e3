"""The OpenAI wire (chat and text completions): usage from SSE streams and bodies, and the usage
chunk hidden when the client did not ask for it.

The proxy always asks the backend for ``stream_options.include_usage`` so it learns every step's
token counts; when the client did not ask for that chunk, it is removed from what the client sees.
The tap is the chat protocol's (``protocols.openai_chat.ChatTap``): one implementation, linear in
the bytes fed, with a cap on one event's size.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ..errors import ThunderproxyError
from ..programs import StepUsage
from ..protocols import openai_chat
from ..protocols.openai_chat import ChatTap as UsageTap
from .errors import sse_error_event

if TYPE_CHECKING:
    from ..gateway import Call

__all__ = ["OPENAI", "OpenAIWire", "UsageTap", "usage_from"]


def usage_from(payload: Any) -> StepUsage | None:
    """StepUsage from a response or chunk object's ``usage`` field; None if it has none or if
    its counts are negative."""
    return openai_chat.usage_from(payload)[0]


class OpenAIWire:
    """Chat and text completions (OpenAI's API as vLLM and SGLang serve it)."""

    def tap(self, call: Call) -> UsageTap:
        return UsageTap(hide_usage_chunk=call.hide_usage)

    def usage_from_body(self, body: bytes) -> StepUsage | None:
        return usage_from(json.loads(body))

    def error_event(self, error: ThunderproxyError) -> bytes:
        return sse_error_event(error)


OPENAI = OpenAIWire()
