"""How the council talks to models: the ``ChatClient`` protocol, the request it sends
(``ChatRequest``: one builder of the streamed OpenAI body) and the reader of the stream it gets
back (``StreamAssembler``).

The council never knows where a model runs. The runtime hands it a ``GatewayChatClient``
(``gateway_client.py``): every member call goes through the proxy's own gateway in process, so
it is a scheduled program step like any client's; the tests hand it scripted clients.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from .errors import MemberFailed


@dataclass(frozen=True)
class TextDelta:
    """A piece of the answer's text, as it streams."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    """One assembled tool call: its id, function name and JSON arguments (as sent)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Finished:
    """The end of one completion: why it stopped, its tool calls and its usage."""

    finish_reason: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    prompt_tokens: int = 0
    completion_tokens: int = 0


ChatEvent = TextDelta | Finished


@dataclass(frozen=True)
class ChatRequest:
    """One chat completion a member asks for, whichever client sends it: the model, the
    conversation so far, the member's program, and the tools it may call."""

    model: str
    messages: list[dict[str, Any]]
    program_id: str
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_tokens: int | None = None
    #: The configured client (``[clients]``) whose job asks, recorded on the call's step and
    #: counted against its limits; None: none (no client keys, or a job from before them).
    client: str | None = None

    def body(self) -> dict[str, Any]:
        """The streamed request, usage included (the tool loop needs the counts)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.tools:
            body["tools"] = self.tools
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        return body


class ChatClient(Protocol):
    """What the council needs from a model: stream one chat completion, release a program."""

    def stream_chat(self, request: ChatRequest) -> AsyncIterator[ChatEvent]: ...

    async def release(self, program_id: str) -> None: ...


class ForClient:
    """A ``ChatClient`` whose every request is ``client``'s: a council job's calls are those of
    the client that started it."""

    def __init__(self, inner: ChatClient, client: str | None) -> None:
        self.inner = inner
        self.client = client

    def stream_chat(self, request: ChatRequest) -> AsyncIterator[ChatEvent]:
        return self.inner.stream_chat(replace(request, client=self.client))

    async def release(self, program_id: str) -> None:
        await self.inner.release(program_id)


@asynccontextmanager
async def closing(events: AsyncIterator[ChatEvent]) -> AsyncIterator[AsyncIterator[ChatEvent]]:
    """Close a chat stream however its reader stops (a timeout, a cancelled job), so its HTTP
    response is closed now rather than whenever the garbage collector gets to it."""
    try:
        yield events
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


@dataclass
class _ToolCallParts:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class StreamAssembler:
    """Turns OpenAI chat-completion chunks into ``ChatEvent``s; tool-call deltas arrive in
    fragments keyed by index and are assembled until the stream ends. Pure."""

    def __init__(self) -> None:
        self._calls: dict[int, _ToolCallParts] = {}
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def feed(self, chunk: dict[str, Any]) -> list[ChatEvent]:
        events: list[ChatEvent] = []
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.completion_tokens = int(usage.get("completion_tokens") or 0)
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                events.append(TextDelta(text))
            for part in delta.get("tool_calls") or ():
                slot = self._calls.setdefault(int(part.get("index", 0)), _ToolCallParts())
                slot.id = part.get("id") or slot.id
                function = part.get("function") or {}
                slot.name = function.get("name") or slot.name
                if function.get("arguments"):
                    slot.arguments.append(function["arguments"])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def feed_data(self, model: str, data: str | bytes) -> list[ChatEvent]:
        """One ``data:`` payload of ``model``'s stream, as the client read it (text or bytes),
        fed as a chunk; a payload that is not JSON, or is an error event, fails the member."""
        try:
            chunk = json.loads(data)
        except ValueError:
            raise MemberFailed(
                f"Model {model!r} sent an unreadable stream chunk: {data[:120]!r}"
            ) from None
        if isinstance(chunk, dict) and "error" in chunk:
            raw = data.encode() if isinstance(data, str) else data
            raise MemberFailed(f"Model {model!r} failed mid-answer: {error_message(raw)}")
        return self.feed(chunk)

    def finished(self) -> Finished:
        calls = tuple(
            ToolCall(parts.id or f"call_{index}", parts.name, "".join(parts.arguments) or "{}")
            for index, parts in sorted(self._calls.items())
        )
        return Finished(self.finish_reason, calls, self.prompt_tokens, self.completion_tokens)


def error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw[:200].decode("utf-8", "replace")
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(body, dict) and body.get("detail"):
        return str(body["detail"])
    return raw[:200].decode("utf-8", "replace")
