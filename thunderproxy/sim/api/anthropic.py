"""`POST /v1/messages` and `/v1/messages/count_tokens`, served the way vLLM serves them.

vLLM turns an Anthropic request into a chat completion request (system blocks joined into
one system message, `tool_use` blocks into `tool_calls`, `tool_result` blocks into `tool`
messages, tools into functions, `any` into `required`), runs chat serving and converts the
answer back. The simulator does the same conversion, so a conversation costs the same
prompt tokens, and hits the same cached blocks, over either API.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..engine.core import RequestHandle, StepOutput
from .errors import APIError, validation_error
from .protocol import GenerateRequest, parse_generate
from .serving import ENGINE_DEAD, Frontend, answer, plan_reply, sse_event
from .tools import ToolCallPlan, Tracker, after_tool_result, chat_tool_choice, chat_tools

if TYPE_CHECKING:
    from .asgi import Face, Handler, Request

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
#: Anthropic's id shapes: messages ``msg_...``, tool uses ``toolu_...``.
MESSAGE_ID = "msg_"
TOOL_USE_ID = "toolu_"
_BILLING_HEADER = "x-anthropic-billing-header"  # per-request hash; vLLM drops it for caching


def anthropic_routes(app: Face) -> dict[str, dict[str, Handler]]:
    async def messages(request: Request) -> None:
        await serve_messages(app, request)

    async def count_tokens(request: Request) -> None:
        await serve_count_tokens(app, request)

    return {
        "/v1/messages": {"POST": messages},
        "/v1/messages/count_tokens": {"POST": count_tokens},
    }


def anthropic_error(error: APIError) -> APIError:
    """vLLM's translation of an OpenAI error into Anthropic's shape (same status)."""
    if error.shape is not None or error.type == "Bad Request":
        return error  # request-schema errors come from the server-wide OpenAI-shaped handler
    kind = "internal_error" if error.status == 500 else error.type
    shaped = APIError(error.status, error.message, error.type, error.param)
    shaped.shape = {"type": "error", "error": {"type": kind, "message": error.message}}
    return shaped


# --- the conversion to a chat request -----------------------------------------------------
def _require(body: Mapping[str, Any], name: str, kind: type, code: str, msg: str) -> Any:
    if name not in body:
        raise validation_error("missing", f"body.{name}", "Field required", body)
    value = body[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise validation_error(code, f"body.{name}", msg, value)
    return value


def _blocks_text(blocks: Any) -> list[str]:
    if isinstance(blocks, str):
        return [blocks]
    parts = []
    for block in blocks if isinstance(blocks, list) else []:
        if isinstance(block, Mapping) and block.get("type") == "text" and block.get("text"):
            text = str(block["text"])
            if not text.startswith(_BILLING_HEADER):
                parts.append(text)
    return parts


def to_chat_body(body: Any, *, count_only: bool = False) -> dict[str, Any]:
    """The chat completion request vLLM builds from an Anthropic one."""
    if not isinstance(body, dict):
        raise validation_error("dict_type", "body", "Input should be a valid dictionary", body)
    model = _require(body, "model", str, "string_type", "Input should be a valid string")
    messages = _require(body, "messages", list, "list_type", "Input should be a valid list")
    if not count_only:
        max_tokens = _require(
            body, "max_tokens", int, "int_type", "Input should be a valid integer"
        )
        if max_tokens <= 0:
            raise validation_error(
                "value_error",
                "body.max_tokens",
                "Value error, max_tokens must be positive",
                max_tokens,
            )
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in (
            "user",
            "assistant",
            "system",
            "ctx",
            "msg",
        ):
            raise validation_error(
                "literal_error",
                f"body.messages.{i}.role",
                "Input should be 'user', 'assistant' or 'system'",
                message,
            )
    system = _blocks_text(body.get("system"))
    for message in messages:
        if message.get("role") == "system":
            system.extend(_blocks_text(message.get("content")))
    chat: list[dict[str, Any]] = []
    if system:
        chat.append({"role": "system", "content": "".join(system)})
    for message in messages:
        role = {"ctx": "user", "msg": "user"}.get(message["role"], message["role"])
        if role == "system":
            continue
        converted: dict[str, Any] = {"role": role}
        content = message.get("content")
        if isinstance(content, str):
            converted["content"] = content
        else:
            _convert_blocks(content, role, converted, chat)
        if not (role == "user" and "content" not in converted):
            chat.append(converted)
    out: dict[str, Any] = {"model": model, "messages": chat}
    if not count_only:
        out["max_tokens"] = body["max_tokens"]
        if body.get("stream"):
            out["stream"] = True
    tools = body.get("tools")
    if isinstance(tools, list):
        out["tools"] = [_chat_tool(t) for t in tools if isinstance(t, Mapping)]
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping):
        kind = choice.get("type")
        if kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "none"):
            out["tool_choice"] = kind
        elif kind == "any":
            out["tool_choice"] = "required"
    return out


def _chat_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    schema = tool.get("input_schema")
    parameters = dict(schema) if isinstance(schema, Mapping) else {}
    parameters.setdefault("type", "object")  # vLLM's default for a schema without one
    function = {
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": parameters,
    }
    return {"type": "function", "function": function}


def _convert_blocks(
    blocks: Any, role: str, converted: dict[str, Any], chat: list[dict[str, Any]]
) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in blocks if isinstance(blocks, list) else []:
        if not isinstance(block, Mapping):
            continue
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id") or "",
                    "type": "function",
                    "function": {
                        "name": block.get("name") or "",
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result":
            result = block.get("content")
            if role == "user":
                text = (
                    result
                    if isinstance(result, str)
                    else "\n".join(
                        str(i.get("text", ""))
                        for i in result or []
                        if isinstance(i, Mapping) and i.get("type") == "text"
                    )
                )
                chat.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.get("tool_use_id") or "",
                        "content": text or "",
                    }
                )
            else:
                parts.append({"type": "text", "text": f"Tool result: {result or ''}"})
    if calls:
        converted["tool_calls"] = calls
    if parts:
        one = len(parts) == 1
        converted["content"] = parts[0]["text"] if one else parts


# --- the routes -----------------------------------------------------------------------------
async def serve_count_tokens(app: Face, request: Request) -> None:
    from .asgi import respond_json

    chat = to_chat_body(await request.json(), count_only=True)
    try:
        parsed = parse_generate(chat, chat=True, config=app.config, tokenizer=app.engine.tokenizer)
    except APIError as error:
        raise anthropic_error(error) from None
    count = len(parsed.prompt_ids)
    body = {"input_tokens": count, "context_management": {"original_input_tokens": count}}
    await respond_json(request.send, 200, body)


async def serve_messages(app: Face, request: Request) -> None:
    chat = to_chat_body(await request.json())
    try:
        parsed = parse_generate(chat, chat=True, config=app.config, tokenizer=app.engine.tokenizer)
        tools = chat_tools(chat)
        choice = chat_tool_choice(chat, tools)
    except APIError as error:
        raise anthropic_error(error) from None
    plan, script = plan_reply(
        app,
        parsed.prompt_ids,
        tools,
        choice,
        after_tool_result=after_tool_result(chat["messages"]),
        call_id_prefix=TOOL_USE_ID,
    )
    extra = app.id_headers(request)

    async def respond(handle: RequestHandle, rid: str, fault: str | None) -> None:
        frontend = MessagesFrontend(app, parsed, MESSAGE_ID + rid, plan)
        await answer(app, request, handle, frontend, parsed, fault=fault, extra=extra)

    try:
        await app.execute(request, parsed, respond, script=script)
    except APIError as error:
        raise anthropic_error(error) from None


def messages_usage(out: StepOutput, output_tokens: int, *, cache_report: bool) -> dict[str, int]:
    """Usage as Anthropic reports it: ``input_tokens`` counts only the prompt tokens not read
    from the cache, so the prompt is input + cache_read + cache_creation. With cached tokens
    reported (--enable-prompt-tokens-details), the prefix cache's hit is
    ``cache_read_input_tokens``; automatic prefix caching writes no cache entries a client
    asked for, so ``cache_creation_input_tokens`` is 0. Without it, the whole prompt is
    ``input_tokens`` and there are no cache fields, as the cache is not reported."""
    if not cache_report:
        return {"input_tokens": out.num_prompt_tokens, "output_tokens": output_tokens}
    cached = min(out.num_cached_tokens, out.num_prompt_tokens)
    return {
        "input_tokens": out.num_prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


class MessagesFrontend(Frontend):
    def __init__(
        self, app: Face, parsed: GenerateRequest, message_id: str, plan: ToolCallPlan | None
    ) -> None:
        self.model = app.config.served_model_name
        self.cache_report = app.config.cache_report()
        self.parsed = parsed
        self.id = message_id
        self.plan = plan
        self.tracker = Tracker(plan)
        self.started = False
        self.block: str | None = None  # type of the open content block
        self.index = 0  # index of the next (or open) content block
        self.text: list[str] = []

    def _stop_block(self) -> list[str]:
        if self.block is None:
            return []
        self.block = None
        event = sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.index += 1
        return [event]

    def _start_block(self, block: dict[str, Any]) -> list[str]:
        frames = self._stop_block()
        self.block = block["type"]
        frames.append(
            sse_event(
                "content_block_start",
                {"type": "content_block_start", "content_block": block, "index": self.index},
            )
        )
        return frames

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse_event(
            "content_block_delta",
            {"type": "content_block_delta", "delta": delta, "index": self.index},
        )

    def output(self, out: StepOutput) -> list[str]:
        frames = []
        if not self.started:
            self.started = True
            message: dict[str, Any] = {
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": self.model,
                "stop_reason": None,
                "stop_sequence": None,
                "usage": messages_usage(out, 0, cache_report=self.cache_report),
            }
            frames.append(sse_event("message_start", {"type": "message_start", "message": message}))
        self.text.append(out.text)
        content, began, args = self.tracker.feed(out.text)
        if content:
            if self.block != "text":
                frames.extend(self._start_block({"type": "text", "text": ""}))
            frames.append(self._delta({"type": "text_delta", "text": content}))
        if began:
            assert self.plan is not None
            frames.extend(
                self._start_block(
                    {
                        "type": "tool_use",
                        "id": self.plan.call_id,
                        "name": self.plan.name,
                        "input": {},
                    }
                )
            )
        if args:
            frames.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return frames

    def _stop_reason(self, text: str, engine_reason: str) -> str | None:
        plan = self.plan
        reason = engine_reason
        if plan is not None and text == plan.text and plan.mode in ("auto", "required"):
            reason = "tool_calls"
        return STOP_REASONS.get(reason)

    def finish(self, out: StepOutput) -> list[str]:
        assert out.finish_reason is not None
        frames = self._stop_block()
        reason = self._stop_reason("".join(self.text), out.finish_reason)
        usage = messages_usage(out, out.num_output_tokens, cache_report=self.cache_report)
        frames.append(
            sse_event(
                "message_delta",
                {"type": "message_delta", "delta": {"stop_reason": reason}, "usage": usage},
            )
        )
        frames.append(sse_event("message_stop", {"type": "message_stop"}))
        return frames

    def stream_error(self) -> list[str]:
        error = {"type": "error", "error": {"type": "internal_error", "message": ENGINE_DEAD}}
        return [sse_event("error", error), "data: [DONE]\n\n"]

    def failure(self) -> APIError:
        return anthropic_error(APIError(500, ENGINE_DEAD, "InternalServerError"))

    def full(self, text: str, last: StepOutput) -> Any:
        assert last.finish_reason is not None
        plan = self.plan
        content: str | None = text
        called = False
        if plan is not None:
            content, called = plan.parse(text)
            if called and plan.mode != "auto":
                content = None
        blocks: list[dict[str, Any]] = []
        if content:
            blocks.append({"type": "text", "text": content})
        if called:
            assert plan is not None
            blocks.append(
                {
                    "type": "tool_use",
                    "id": plan.call_id,
                    "name": plan.name,
                    "input": json.loads(plan.arguments),
                }
            )
        body: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": blocks,
            "model": self.model,
        }
        reason = self._stop_reason(text, last.finish_reason)
        if reason is not None:
            body["stop_reason"] = reason
        body["usage"] = messages_usage(last, last.num_output_tokens, cache_report=self.cache_report)
        return body
