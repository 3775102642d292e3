"""``GatewayChatClient``: the council's ``ChatClient`` over the proxy's own call gateway, in
process. Each member call is a :class:`~thunderproxy.gateway.Call` like any HTTP client's:
grouped by model, admitted, leased by the scheduler, sent, relayed and recorded; only the
loopback HTTP hop is gone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import trio

from ..errors import ProgramUnknown, ThunderproxyError
from ..gateway import Call, Gateway
from ..http.sse import OPENAI
from .errors import MemberFailed
from .llm import ChatEvent, ChatRequest, StreamAssembler, error_message

ENDPOINT = "/v1/chat/completions"


def _chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content") or "")) for m in messages)


class GatewayChatClient:
    """``ChatClient`` calling ``gateway`` directly (the proxy's own scheduling and audit)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def stream_chat(self, request: ChatRequest) -> AsyncIterator[ChatEvent]:
        model = request.model
        call = Call(
            program_id=request.program_id,
            endpoint=ENDPOINT,
            body=request.body(),
            wire=OPENAI,
            arrived_at=trio.current_time(),
            model=model,
            stream=True,
            headers=[("content-type", "application/json")],
            context_chars=_chars(request.messages),
            source="explicit",
            client=request.client,
        )
        assembler = StreamAssembler()
        try:
            async with self.gateway.call(call) as exchange:
                if exchange.status_code != 200:
                    raw = await exchange.read()
                    raise MemberFailed(
                        f"Model {model!r} answered HTTP {exchange.status_code}: "
                        f"{error_message(raw)}"
                    )
                pending = b""
                chunks = exchange.stream()
                try:
                    async for chunk in chunks:
                        pending += chunk
                        *lines, pending = pending.split(b"\n")
                        for line in lines:
                            if not line.startswith(b"data:"):
                                continue
                            data = line[5:].strip()
                            if data == b"[DONE]":
                                continue
                            for event in assembler.feed_data(model, data):
                                yield event
                finally:
                    # Closed here if the member is cancelled mid-answer, not by the collector.
                    with trio.CancelScope(shield=True):
                        await chunks.aclose()
        except ThunderproxyError as exc:
            if isinstance(exc, MemberFailed):
                raise
            raise MemberFailed(f"Model {model!r} could not be called: {exc.message}") from exc
        yield assembler.finished()

    async def release(self, program_id: str) -> None:
        try:
            self.gateway.scheduler.release(program_id)
        except ProgramUnknown:
            pass  # retired by its idle lease already, or never called
