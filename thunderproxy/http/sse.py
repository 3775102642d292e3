"""Watching an OpenAI-style SSE stream for usage, with the option to hide the usage chunk.

The proxy always asks the backend for ``stream_options.include_usage`` so it learns every step's
token counts; when the client did not ask for that chunk, it is removed from what the client sees.
The tap itself is the chat protocol's (``protocols.openai_chat.ChatTap``): one implementation,
linear in the bytes fed, with a cap on one event's size.
"""

from __future__ import annotations

from typing import Any

from ..programs import StepUsage
from ..protocols import openai_chat
from ..protocols.openai_chat import ChatTap as UsageTap

__all__ = ["UsageTap", "usage_from"]


def usage_from(payload: Any) -> StepUsage | None:
    """StepUsage from a response or chunk object's ``usage`` field; None if it has none or if
    its counts are negative."""
    return openai_chat.usage_from(payload)[0]
