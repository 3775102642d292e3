"""How the agents' calls reach the model.

- :class:`HttpTransport`: OpenAI-compatible streaming chat completions over HTTP, to a backend
  directly or to a proxy (thunderproxy or any other). Through a proxy each call carries
  ``extra_body.program_id`` and a program ends with ``POST /programs/release``.
- :class:`InProcessTransport`: the virtual-time path. Calls go through the real ``Scheduler``
  (``begin_step``/``end_step``, as ``http/proxy.py`` does) or, for ``direct``, straight to a
  simulator ``Engine`` with ``Engine.submit``. No sockets, so a MockClock can drive it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import trio

from ..errors import ProgramUnknown, ThunderproxyError
from ..programs import StepUsage
from ..scheduling import Scheduler
from ..scheduling.scheduler import StepLease, StepOutcome
from ..sim import Engine, EngineDeadError, QueueFullError
from ..sim.tokenizer import Tokenizer
from .agent import CallResult
from .prompts import Conversation

ENDPOINT = "/v1/chat/completions"
RELEASE_TIMEOUT_S = 10.0


def request_body(
    conversation: Conversation, *, model: str, max_tokens: int, program_id: str | None
) -> dict[str, Any]:
    """The chat request of one call: exactly ``max_tokens`` tokens decoded, streamed, usage on."""
    body: dict[str, Any] = {
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
    ) -> None:
        self.client = client
        self.base_for = base_for
        self.model = model
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
        )
        # <program>-<step> is how thunderproxy names upstream requests and how the simulator
        # attributes KV blocks to programs; sending it keeps direct runs attributable too.
        headers = {"X-Request-Id": f"{program_id}-{step}"}
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
        if sse.error is not None:
            return CallResult(500, first_token_at=first, error=sse.error)
        text = "".join(sse.texts)
        prompt, completion, cached = sse.usage_tokens()
        return CallResult(
            200,
            text=text,
            ids=self.tokenizer.encode(text),
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_tokens=cached,
            first_token_at=first,
        )

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
    """Calls on the virtual clock: through the real Scheduler (``scheduler`` set) or direct."""

    def __init__(
        self,
        engines: Mapping[str, Engine],
        *,
        scheduler: Scheduler | None,
        place: Callable[[str], str],
        model: str,
    ) -> None:
        self.engines = engines
        self.scheduler = scheduler
        self.place = place
        self.model = model

    async def call(
        self, program_id: str, step: int, conversation: Conversation, max_tokens: int
    ) -> CallResult:
        scheduler = self.scheduler
        lease: StepLease | None = None
        arrived_at = trio.current_time()
        if scheduler is not None:
            try:
                lease = await scheduler.begin_step(
                    program_id, arrived_at=arrived_at, context_chars=conversation.chars
                )
            except ThunderproxyError as exc:
                return CallResult(503, error=exc.message)
            url = lease.backend.url
        else:
            url = self.place(program_id)
        result = CallResult(499, error="cancelled")
        try:
            result = await self._generate(
                self.engines[url], program_id, step, conversation, max_tokens
            )
        finally:
            if scheduler is not None and lease is not None:
                scheduler.end_step(
                    lease,
                    StepOutcome(
                        status=result.status,
                        usage=StepUsage(
                            result.prompt_tokens, result.completion_tokens, result.cached_tokens
                        ),
                        endpoint=ENDPOINT,
                        model=self.model,
                        stream=True,
                        first_token_at=result.first_token_at,
                        error=result.error,
                    ),
                )
        return result

    async def _generate(
        self,
        engine: Engine,
        program_id: str,
        step: int,
        conversation: Conversation,
        max_tokens: int,
    ) -> CallResult:
        prompt = conversation.prompt_ids()
        limit = engine.config.max_model_len
        if len(prompt) >= limit:
            return CallResult(400, error=f"prompt of {len(prompt)} tokens >= max_model_len {limit}")
        try:
            handle = engine.submit(
                prompt,
                max_tokens=min(max_tokens, limit - len(prompt)),
                request_id=f"{program_id}-{step}",
                program=program_id,
                ignore_eos=True,
            )
        except EngineDeadError as exc:
            return CallResult(500, error=str(exc))
        except QueueFullError as exc:
            return CallResult(503, error=f"engine queue full ({exc})")
        ids: list[int] = []
        texts: list[str] = []
        first: float | None = None
        last = None
        try:
            async for output in handle:
                if output.token_ids and first is None:
                    first = trio.current_time()
                ids.extend(output.token_ids)
                texts.append(output.text)
                last = output
        finally:
            if not handle.finished:
                engine.abort(handle.request_id)
        if last is None or last.finish_reason in ("error", "abort"):
            reason = "no output" if last is None else last.finish_reason
            error = f"engine ended the request: {reason}"
            return CallResult(500, first_token_at=first, error=error)
        return CallResult(
            200,
            text="".join(texts),
            ids=ids,
            prompt_tokens=last.num_prompt_tokens,
            completion_tokens=last.num_output_tokens,
            cached_tokens=last.num_cached_tokens,
            first_token_at=first,
        )

    async def release(self, program_id: str) -> None:
        if self.scheduler is None:
            return
        try:
            self.scheduler.release(program_id)
        except ProgramUnknown:
            pass  # retired by its idle lease already
