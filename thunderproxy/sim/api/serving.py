"""What the agent-facing routes share: planning a reply (text or tool call) and writing it.

Chat completions with tools, Anthropic messages and OpenAI responses each describe their
wire format as a `Frontend`; `answer` drives it from the engine's per-step outputs, with the
same flush pacing, fault injection and error handling as plain chat completions.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..engine.core import RequestHandle, StepOutput
from ..engine.tokenizer import TextGenerator
from .errors import APIError
from .protocol import GenerateRequest
from .responses import dumps
from .tools import ToolCallPlan, ToolSpec, plan_tool_call, prompt_digest

if TYPE_CHECKING:
    from .asgi import Face, Request

SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."


def sse_event(kind: str, data: Any) -> str:
    """A named server-sent event, as vLLM writes Anthropic and Responses streams."""
    return f"event: {kind}\ndata: {dumps(data)}\n\n"


def plan_reply(
    app: Face,
    prompt_ids: Sequence[int],
    tools: Sequence[ToolSpec] | None,
    choice: str | None,
    *,
    after_tool_result: bool,
    call_id_prefix: str,
) -> tuple[ToolCallPlan | None, list[tuple[int, str]] | None]:
    """The seeded decision for one request, and the tokens a tool call makes the model write.

    Seeded by the prompt (not the request id), so a rerun of the same conversation gets
    the same answer whatever ids the client sends.
    """
    cfg = app.config
    if not tools or choice in (None, "none"):
        return None, None
    tok = app.engine.tokenizer
    digest = prompt_digest(prompt_ids)
    words = TextGenerator(tok, cfg.seed, "preamble:" + digest)
    count = random.Random(f"preamble:{cfg.seed}:{digest}").randint(6, 40)
    preamble = "".join(words.next_token()[1] for _ in range(count))
    plan = plan_tool_call(
        tools=tools,
        choice=choice,
        after_tool_result=after_tool_result,
        probability=cfg.tool_call_probability,
        probability_after_result=cfg.tool_call_after_result_probability,
        seed=cfg.seed,
        prompt_ids=prompt_ids,
        preamble=preamble,
        call_id_prefix=call_id_prefix,
    )
    if plan is None:
        return None, None
    return plan, [(tok.piece_id(p), p) for p in tok.pieces(plan.text)]


class Frontend:
    """One request's wire format. Frames are complete SSE strings."""

    def head(self) -> list[str]:
        """Frames sent with the response headers, before any token exists."""
        return []

    def output(self, out: StepOutput) -> list[str]:
        """Frames for one engine step's output (the final one included)."""
        raise NotImplementedError

    def finish(self, out: StepOutput) -> list[str]:
        """Frames after the final output's own frames."""
        raise NotImplementedError

    def stream_error(self) -> list[str]:
        """Frames that end a stream whose generation failed."""
        raise NotImplementedError

    def failure(self) -> APIError:
        """The error a non-streamed request whose generation failed answers with."""
        return APIError(500, ENGINE_DEAD, "InternalServerError")

    def full(self, text: str, last: StepOutput) -> Any:
        """The non-streamed body."""
        raise NotImplementedError


async def answer(
    app: Face,
    request: Request,
    handle: RequestHandle,
    frontend: Frontend,
    parsed: GenerateRequest,
    *,
    fault: str | None,
    extra: list[tuple[bytes, bytes]],
) -> None:
    from .asgi import Pacer, collect, respond_json

    if not parsed.stream:
        answer = await collect(app.engine, handle, fault)
        if answer is None:
            await app.send_error(request.send, frontend.failure())
            return
        await respond_json(request.send, 200, frontend.full(*answer), extra)
        return
    send = request.send
    await send({"type": "http.response.start", "status": 200, "headers": SSE + extra})
    head = frontend.head()
    if head:
        await send(
            {"type": "http.response.body", "body": "".join(head).encode(), "more_body": True}
        )
    fail_at = max(1, parsed.max_tokens // 2) if fault == "stream" else None
    pacer = Pacer(handle, app.config.flush_interval())
    done = False
    while not done:
        batch = await pacer.next()
        if not batch:
            break
        frames: list[str] = []
        for out in batch:
            if out.finish_reason == "error" or (fail_at and out.num_output_tokens >= fail_at):
                app.engine.abort(handle.request_id)
                frames.extend(frontend.stream_error())
                done = True
                break
            frames.extend(frontend.output(out))
            if out.finish_reason is not None:
                frames.extend(frontend.finish(out))
                done = True
                break
        if frames:
            payload = "".join(frames).encode()
            await send({"type": "http.response.body", "body": payload, "more_body": True})
            pacer.flushed()
    await send({"type": "http.response.body", "body": b"", "more_body": False})
