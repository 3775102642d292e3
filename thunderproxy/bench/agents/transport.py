"""How the agents' calls reach the model.

- :class:`HttpTransport`: OpenAI-compatible streaming chat completions over HTTP, to a backend
  directly or to a proxy (thunderproxy or any other). Through a proxy each call carries
  ``extra_body.program_id`` and a program ends with ``POST /programs/release``.
- :class:`InProcessTransport`: the virtual-time path. Calls go through the real call gateway,
  as the proxy's HTTP routes do, or, for ``direct``, straight to a backend; the backends are
  the simulator in-process (``EngineBackend``). No sockets, so a MockClock can drive it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import httpx
import trio

from ...backends import Backend, UpstreamRequest
from ...errors import ProgramUnknown, ThunderproxyError, describe
from ...gateway import Call, Gateway
from ...http.sse import OPENAI
from ...scheduling.classes import BATCH, CLASS_HEADER, INTERACTIVE
from ...sim.engine.tokenizer import Tokenizer
from ..workloads.prompts import Conversation
from .agent import CallResult

ENDPOINT = "/v1/chat/completions"
RELEASE_TIMEOUT_S = 10.0


def program_classes(program_ids: Sequence[str], interactive: int) -> dict[str, str]:
    """Each program's latency class: ``interactive`` programs spread evenly over
    ``program_ids`` (the first, then every len/n-th), every other one ``batch``. The bench's
    agents name their class on every call, as rollouts and benches should: the proxy's default
    class is then no part of what is measured."""
    n = len(program_ids)
    chosen = {(i * n) // interactive for i in range(min(interactive, n))} if interactive else set()
    return {pid: INTERACTIVE if i in chosen else BATCH for i, pid in enumerate(program_ids)}


def request_body(
    conversation: Conversation,
    *,
    model: str,
    max_tokens: int,
    program_id: str | None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The chat request of one call: exactly ``max_tokens`` tokens decoded, streamed, usage on;
    ``extra`` adds sampling parameters a backend needs (a real engine's allowed tokens)."""
    body: dict[str, Any] = {
        **(extra or {}),
        "model": model,
        "messages": conversation.openai_messages(),
        "max_tokens": max_tokens,
        # The decode length is the trace's, not the sampler's: vLLM's ignore_eos does that.
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if program_id is not None:
        body["extra_body"] = {"program_id": program_id}
    return body


class SSEResult:
    """Accumulates one streamed chat completion (pure; fed one ``data:`` payload at a time)."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.usage: Mapping[str, Any] | None = None
        self.error: str | None = None
        self.got_content = False

    def feed(self, payload: str) -> bool:
        """Take one event's data; True when it carried generated text."""
        if payload == "[DONE]":
            return False
        try:
            event = json.loads(payload)
        except ValueError:
            self.error = f"unparsable stream event: {payload[:200]}"
            return False
        if not isinstance(event, dict):
            return False
        if "error" in event or event.get("object") == "error":
            error = event.get("error", event)
            self.error = str(error.get("message") if isinstance(error, dict) else error)
            return False
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        content = False
        for choice in event.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                self.texts.append(text)
                content = True
        self.got_content = self.got_content or content
        return content

    def result(self, first_token_at: float | None, tokenizer: Tokenizer) -> CallResult:
        """The call as the agent sees it once its stream ended (the answer re-tokenized, as
        the next prompt will carry it)."""
        if self.error is not None:
            return CallResult(500, first_token_at=first_token_at, error=self.error)
        text = "".join(self.texts)
        prompt, completion, cached = self.usage_tokens()
        return CallResult(
            200,
            text=text,
            ids=tokenizer.encode(text),
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_tokens=cached,
            first_token_at=first_token_at,
        )

    def usage_tokens(self) -> tuple[int | None, int | None, int | None]:
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        return (
            usage.get("prompt_tokens"),
            usage.get("completion_tokens"),
            details.get("cached_tokens"),
        )


class HttpTransport:
    """Streaming chat completions over HTTP; ``base_for`` picks the URL of each program."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        base_for: Callable[[str], str],
        model: str,
        proxy_url: str | None = None,
        tokenizer: Tokenizer | None = None,
        extra_body: Mapping[str, Any] | None = None,
        classes: Mapping[str, str] | None = None,
    ) -> None:
        self.client = client
        self.base_for = base_for
        self.model = model
        self.extra_body = dict(extra_body or {})
        #: Each program's latency class (``program_classes``), sent to a proxy as
        #: ``X-Program-Class``; a program not listed is ``batch``.
        self.classes = dict(classes or {})
        #: Set for proxies: program ids are sent and programs released there.
        self.proxy_url = proxy_url
        self.tokenizer = tokenizer or Tokenizer()

    async def call(
        self, program_id: str, step: int, conversation: Conversation, max_tokens: int
    ) -> CallResult:
        body = request_body(
            conversation,
            model=self.model,
            max_tokens=max_tokens,
            program_id=program_id if self.proxy_url else None,
            extra=self.extra_body,
        )
        # <program>-<step> is how thunderproxy names upstream requests and how the simulator
        # attributes KV blocks to programs; sending it keeps direct runs attributable too.
        headers = {"X-Request-Id": f"{program_id}-{step}"}
        if self.proxy_url:
            headers[CLASS_HEADER] = self.classes.get(program_id, BATCH)
        url = self.base_for(program_id) + ENDPOINT
        sse = SSEResult()
        first: float | None = None
        try:
            async with self.client.stream("POST", url, json=body, headers=headers) as response:
                if response.status_code != 200:
                    raw = await response.aread()
                    return CallResult(
                        response.status_code, error=raw[:300].decode("utf-8", "replace")
                    )
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    if sse.feed(line[5:].strip()) and first is None:
                        first = trio.current_time()
        except httpx.HTTPError as exc:
            return CallResult(599, first_token_at=first, error=f"{type(exc).__name__}: {exc}")
        return sse.result(first, self.tokenizer)

    async def release(self, program_id: str) -> None:
        if self.proxy_url is None:
            return
        # Bounded: this runs shielded at a program's end, and a hung proxy must not hang it.
        with trio.move_on_after(RELEASE_TIMEOUT_S):
            try:
                await self.client.post(
                    self.proxy_url + "/programs/release", json={"program_id": program_id}
                )
            except httpx.HTTPError:
                pass  # a proxy that lost the program already has nothing to release


class InProcessTransport:
    """Calls on the virtual clock, over in-process backends: through the real call gateway
    (``gateway`` set: the proxy targets) or straight to a backend (``direct``). No sockets, so a
    MockClock can drive it; the bytes are the ones a backend sends over HTTP."""

    def __init__(
        self,
        backends: Mapping[str, Backend],
        *,
        gateway: Gateway | None,
        place: Callable[[str], str],
        model: str,
        tokenizer: Tokenizer | None = None,
        classes: Mapping[str, str] | None = None,
    ) -> None:
        self.backends = backends
        self.gateway = gateway
        self.place = place
        self.model = model
        self.tokenizer = tokenizer or Tokenizer()
        #: Each program's latency class, named on its calls as the HTTP transport names it.
        self.classes = dict(classes or {})

    async def call(
        self, program_id: str, step: int, conversation: Conversation, max_tokens: int
    ) -> CallResult:
        body = request_body(conversation, model=self.model, max_tokens=max_tokens, program_id=None)
        if self.gateway is None:
            return await self._direct(program_id, step, body)
        call = Call(
            program_id=program_id,
            endpoint=ENDPOINT,
            body=body,
            wire=OPENAI,
            arrived_at=trio.current_time(),
            model=self.model,
            stream=True,
            context_chars=conversation.chars,
            source="explicit",
            headers=[(CLASS_HEADER, self.classes.get(program_id, BATCH))],
        )
        try:
            async with self.gateway.call(call) as exchange:
                if exchange.status_code != 200:
                    raw = await exchange.read()
                    return CallResult(
                        exchange.status_code, error=raw[:300].decode("utf-8", "replace")
                    )
                return await self._result(exchange.stream())
        except ThunderproxyError as exc:
            return CallResult(describe(exc)[0], error=exc.message)

    async def _direct(self, program_id: str, step: int, body: dict[str, Any]) -> CallResult:
        backend = self.backends[self.place(program_id)]
        request = UpstreamRequest(
            "POST",
            ENDPOINT,
            [("content-type", "application/json"), ("x-request-id", f"{program_id}-{step}")],
            json.dumps(body).encode(),
        )
        response = await backend.send(request)
        try:
            if response.status_code != 200:
                raw = await response.aread()
                return CallResult(response.status_code, error=raw[:300].decode("utf-8", "replace"))
            return await self._result(response.aiter_raw())
        finally:
            await response.aclose()

    async def _result(self, chunks: AsyncIterator[bytes]) -> CallResult:
        sse = SSEResult()
        first: float | None = None
        pending = b""
        async for chunk in chunks:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                fed = line.startswith(b"data:") and sse.feed(line[5:].strip().decode())
                if fed and first is None:
                    first = trio.current_time()
        return sse.result(first, self.tokenizer)

    async def release(self, program_id: str) -> None:
        if self.gateway is None:
            return
        try:
            self.gateway.scheduler.release(program_id)
        except ProgramUnknown:
            pass  # retired by its idle lease already
