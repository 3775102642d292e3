"""A scripted ``ChatClient``: a verified fake of the protocol, for the stage and tool-loop
tests that must not depend on a model's timing (they run on trio's autojump clock)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from thunderproxy.council.errors import MemberFailed
from thunderproxy.council.llm import ChatEvent, ChatRequest, Finished, TextDelta, ToolCall

#: What a model does for one call: text to stream, tool calls to ask for, or a failure.
Reply = str | tuple[ToolCall, ...] | MemberFailed | None


@dataclass
class ScriptedClient:
    """Answers each call with ``script(model, messages, tools)``; ``None`` hangs forever."""

    script: Callable[[str, list[dict[str, Any]], list[dict[str, Any]] | None], Reply]
    calls: list[dict[str, Any]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    async def stream_chat(self, request: ChatRequest) -> AsyncIterator[ChatEvent]:
        model, messages, tools = request.model, request.messages, request.tools
        self.calls.append(
            {
                "model": model,
                "messages": list(messages),
                "program_id": request.program_id,
                "tools": tools,
            }
        )
        reply = self.script(model, messages, tools)
        if reply is None:
            await trio.sleep_forever()
        if isinstance(reply, MemberFailed):
            raise reply
        if isinstance(reply, tuple):
            yield Finished("tool_calls", reply)
            return
        for word in reply.split(" "):
            await trio.sleep(0.01)
            yield TextDelta(word + " ")
        yield Finished("stop")

    async def release(self, program_id: str) -> None:
        self.released.append(program_id)
