"""Chat completions that carry `tools`: a seeded share of replies are tool calls.

A reply that is plain text takes the ordinary chat path (same bytes as without tools).
A tool call comes back as vLLM's tool parser returns it: `message.tool_calls` with
`finish_reason: "tool_calls"` (auto and required; a named choice finishes with "stop"),
and when streamed, a `delta.tool_calls` chunk announcing id and function name followed by
argument fragments as the engine generates them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..engine.core import RequestHandle, StepOutput
from .errors import error_body
from .protocol import GenerateRequest, parse_generate
from .responses import ResponseBuilder, dumps
from .serving import Frontend, answer, plan_reply
from .tools import ToolCallPlan, Tracker, after_tool_result, chat_tool_choice, chat_tools

if TYPE_CHECKING:
    from .asgi import Face, Request

CHAT_TOOL_ID = "chatcmpl-tool-"


async def serve_chat_with_tools(app: Face, request: Request, body: dict[str, Any]) -> None:
    cfg = app.config
    parsed = parse_generate(body, chat=True, config=cfg, tokenizer=app.engine.tokenizer)
    tools = chat_tools(body)
    choice = chat_tool_choice(body, tools)
    messages = body["messages"]
    plan, script = plan_reply(
        app,
        parsed.prompt_ids,
        tools,
        choice,
        after_tool_result=after_tool_result(messages),
        call_id_prefix=CHAT_TOOL_ID,
    )
    extra = app.id_headers(request)

    async def respond(handle: RequestHandle, rid: str, fault: str | None) -> None:
        builder = ResponseBuilder(
            cfg,
            chat=True,
            response_id="chatcmpl-" + rid,
            created=int(app.engine.unix_time()),
            fingerprint=app.fingerprint,
            block_size=app.engine.block_size,
        )
        if plan is None:  # a text answer: exactly the ordinary chat path
            if parsed.stream:
                await app._stream(request, parsed, handle, builder, fault, extra)
            else:
                await app._complete(request, parsed, handle, builder, fault, extra)
            return
        frontend = ChatToolFrontend(app, parsed, builder, plan)
        await answer(app, request, handle, frontend, parsed, fault=fault, extra=extra)

    await app.execute(request, parsed, respond, script=script)


def chat_finish_reason(plan: ToolCallPlan, called: bool, engine_reason: str) -> str:
    # vLLM reports "tool_calls" when its parser (auto) or the required-choice path produced
    # calls; a named choice keeps the engine's reason.
    if called and plan.mode in ("auto", "required"):
        return "tool_calls"
    return engine_reason


class ChatToolFrontend(Frontend):
    def __init__(
        self, app: Face, parsed: GenerateRequest, builder: ResponseBuilder, plan: ToolCallPlan
    ) -> None:
        self.app = app
        self.parsed = parsed
        self.builder = builder
        self.plan = plan
        self.tracker = Tracker(plan)
        self.role_sent = False
        self.want_usage = parsed.include_usage or app.config.enable_force_include_usage
        self.text: list[str] = []

    def _chunk(self, delta: dict[str, Any], finish: str | None, out: StepOutput) -> str:
        b = self.builder
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
        if finish is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = None
        chunk: dict[str, Any] = {
            "id": b.id,
            "object": "chat.completion.chunk",
            "created": b.created,
            "model": b.config.served_model_name,
            "choices": [choice],
        }
        if self.parsed.continuous_usage and self.want_usage:
            usage = b.usage(out.num_prompt_tokens, out.num_output_tokens, 0, stream=True)
            usage.pop("prompt_tokens_details", None)
            chunk["usage"] = usage
        if finish is not None and not self.want_usage:
            chunk["system_fingerprint"] = b.fingerprint
        return "data: " + dumps(chunk) + "\n\n"

    def output(self, out: StepOutput) -> list[str]:
        frames = []
        if not self.role_sent:
            frames.append("data: " + self.builder.role_chunk() + "\n\n")
            self.role_sent = True
        self.text.append(out.text)
        content, began, args = self.tracker.feed(out.text)
        plan = self.plan
        if content:
            frames.append(self._chunk({"content": content}, None, out))
        if began:
            call: dict[str, Any] = {
                "id": plan.call_id,
                "type": "function",
                "index": 0,
                "function": {"name": plan.name},
            }
            frames.append(self._chunk({"tool_calls": [call]}, None, out))
        if args:
            call = {"index": 0, "function": {"arguments": args}}
            frames.append(self._chunk({"tool_calls": [call]}, None, out))
        if out.finish_reason is not None:
            called = "".join(self.text) == plan.text
            reason = chat_finish_reason(plan, called, out.finish_reason)
            frames.append(self._chunk({}, reason, out))
        return frames

    def finish(self, out: StepOutput) -> list[str]:
        frames = []
        if self.want_usage:
            usage = self.builder.usage(
                out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens, stream=True
            )
            frames.append("data: " + self.builder.usage_chunk(usage) + "\n\n")
        frames.append("data: [DONE]\n\n")
        return frames

    def stream_error(self) -> list[str]:
        error = self.failure()
        return ["data: " + dumps(error_body(error, self.app.config)) + "\n\n", "data: [DONE]\n\n"]

    def full(self, text: str, last: StepOutput) -> Any:
        plan = self.plan
        content, called = plan.parse(text)
        assert last.finish_reason is not None
        reason = chat_finish_reason(plan, called, last.finish_reason)
        usage = self.builder.usage(
            last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens, stream=False
        )
        if called and plan.mode != "auto":
            content = ""  # vLLM's structured tool choice leaves an empty content
        body = self.builder.full_response(content or "", reason, usage)
        message = body["choices"][0]["message"]
        message["content"] = content
        if called:
            # tool_calls sits between function_call and reasoning, as vLLM orders it.
            calls = [
                {
                    "id": plan.call_id,
                    "type": "function",
                    "function": {"name": plan.name, "arguments": plan.arguments},
                }
            ]
            reasoning = message.pop("reasoning")
            message["tool_calls"] = calls
            message["reasoning"] = reasoning
        return body
