"""`POST /v1/responses` (and `GET /v1/responses/{id}`), served the way vLLM serves them.

vLLM builds chat messages from `instructions`, the stored history of
`previous_response_id` and `input` (message, `function_call` and `function_call_output`
items), renders them with the chat template and generates; the answer becomes `output`
items. Like vLLM, a previous response's history is its input messages plus the text of its
output messages: its function calls are not replayed into the prompt.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..engine.core import RequestHandle, StepOutput
from .errors import APIError, bad_request, validation_error
from .protocol import GenerateRequest, parse_generate
from .serving import Frontend, answer, plan_reply, sse_event
from .tools import ToolCallPlan, ToolSpec, Tracker

if TYPE_CHECKING:
    from .asgi import Face, Handler, Request


class ResponseStore:
    """Stored responses and the chat messages that produced them, oldest forgotten first."""

    def __init__(self) -> None:
        self.items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, body: dict[str, Any], messages: list[dict[str, Any]], limit: int) -> None:
        self.items[body["id"]] = (body, messages)
        self.items.move_to_end(body["id"])
        while len(self.items) > max(limit, 0):
            self.items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        return self.items.get(response_id)


def not_found(response_id: str) -> APIError:
    return APIError(
        404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id"
    )


def responses_routes(app: Face) -> dict[str, dict[str, Handler]]:
    store = ResponseStore()

    async def create(request: Request) -> None:
        await serve_responses(app, request, store)

    async def retrieve(request: Request) -> None:
        from .asgi import respond_json

        response_id = request.scope["path"].rsplit("/", 1)[-1]
        found = store.get(response_id)
        if found is None:
            raise not_found(response_id)
        await respond_json(request.send, 200, found[0])

    return {"/v1/responses": {"POST": create}, "/v1/responses/{id}": {"GET": retrieve}}


# --- request -> chat messages ---------------------------------------------------------------
def response_tools(raw: Any) -> list[ToolSpec] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise validation_error("list_type", "body.tools", "Input should be a valid list", raw)
    specs = []
    for tool in raw:
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            continue  # built-in tools need vLLM's tool server; the simulator has none
        fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        assert isinstance(fn, Mapping)
        params = fn.get("parameters")
        specs.append(
            ToolSpec(
                str(fn.get("name", "")),
                fn.get("description"),
                dict(params) if isinstance(params, Mapping) else {},
            )
        )
    return specs or None


def response_tool_choice(raw: Any, tools: list[ToolSpec] | None) -> str | None:
    if not tools:
        return None
    if raw is None or raw in ("auto", "none", "required"):
        return str(raw or "auto")
    if isinstance(raw, Mapping):
        fn = raw.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else raw.get("name")
        if name in {t.name for t in tools}:
            return str(name)
        raise bad_request(
            "Tool choice 'function' not found in 'tools' parameter. (parameter=tool_choice)",
            "tool_choice",
        )
    return "auto"


def _item_message(item: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
        }
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        text = (
            output
            if isinstance(output, str)
            else "".join(str(p.get("text", "")) for p in output or [] if isinstance(p, Mapping))
        )
        return {"role": "tool", "content": text, "tool_call_id": item.get("call_id")}
    if kind == "message" or "role" in item:
        return {"role": item.get("role", "user"), "content": item.get("content")}
    return None  # reasoning and built-in tool items add nothing the template renders


def input_messages(
    instructions: str | None,
    items: Any,
    previous: tuple[dict[str, Any], list[dict[str, Any]]] | None,
) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if previous is not None:
        body, history = previous
        messages.extend(history)
        for item in body["output"]:
            if item.get("type") == "message":
                for part in item.get("content", []):
                    messages.append({"role": "assistant", "content": part.get("text", "")})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    else:
        for i, item in enumerate(items):
            if not isinstance(item, Mapping):
                raise validation_error(
                    "dict_type", f"body.input.{i}", "Input should be a valid dictionary", item
                )
            message = _item_message(item)
            if message is not None:
                messages.append(message)
    return messages


# --- the route --------------------------------------------------------------------------------
async def serve_responses(app: Face, request: Request, store: ResponseStore) -> None:
    body = await request.json()
    if not isinstance(body, dict):
        raise validation_error("dict_type", "body", "Input should be a valid dictionary", body)
    if "input" not in body:
        raise validation_error("missing", "body.input", "Field required", body)
    items = body["input"]
    if not isinstance(items, str | list):
        raise validation_error("list_type", "body.input", "Input should be a valid list", items)
    cfg = app.config
    previous = None
    previous_id = body.get("previous_response_id")
    if previous_id is not None:
        previous = store.get(str(previous_id)) if cfg.enable_responses_api_store else None
        if previous is None:
            raise not_found(str(previous_id))
    tools = response_tools(body.get("tools"))
    choice = response_tool_choice(body.get("tool_choice"), tools)
    messages = input_messages(body.get("instructions"), items, previous)
    if not messages:
        raise bad_request("Cannot apply chat template to an empty conversation.")
    chat: dict[str, Any] = {"messages": messages}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    if tools and choice != "none":  # vLLM leaves the tools out of the prompt for "none"
        chat["tools"] = [t.as_chat_tool() for t in tools]
    limit = body.get("max_output_tokens")
    if isinstance(limit, int) and not isinstance(limit, bool):
        chat["max_tokens"] = min(limit, cfg.max_model_len)
    for name in ("stream", "cache_salt", "priority"):
        if body.get(name) is not None:
            chat[name] = body[name]
    try:
        parsed = parse_generate(chat, chat=True, config=cfg, tokenizer=app.engine.tokenizer)
    except APIError as error:
        if error.param != "input_tokens":
            raise
        prompt = len(app.engine.tokenizer.encode_chat(messages))
        raise APIError(
            400,
            f"The engine prompt length {prompt} exceeds the max_model_len "
            f"{cfg.max_model_len}. Please reduce prompt.",
            "invalid_request_error",
            "input",
        ) from None
    ends_with_result = bool(messages) and messages[-1]["role"] == "tool"
    plan, script = plan_reply(
        app,
        parsed.prompt_ids,
        tools,
        choice,
        after_tool_result=ends_with_result,
        call_id_prefix="call_",
    )
    keep = bool(body.get("store", True)) and cfg.enable_responses_api_store
    extra = app.id_headers(request)

    async def respond(handle: RequestHandle, rid: str, fault: str | None) -> None:
        frontend = ResponsesFrontend(app, body, parsed, rid, plan)
        frontend.on_done = (
            (lambda final: store.put(final, messages, cfg.responses_store_size)) if keep else None
        )
        await answer(app, request, handle, frontend, parsed, fault=fault, extra=extra)

    await app.execute(request, parsed, respond, script=script)


def _hex(seed: str, n: int = 32) -> str:
    return hashlib.blake2b(seed.encode(), digest_size=n // 2).hexdigest()


class ResponsesFrontend(Frontend):
    def __init__(
        self,
        app: Face,
        body: dict[str, Any],
        parsed: GenerateRequest,
        rid: str,
        plan: ToolCallPlan | None,
    ) -> None:
        self.body = body
        self.parsed = parsed
        self.plan = plan
        self.tracker = Tracker(plan)
        self.model = app.config.served_model_name
        self.id = "resp_" + rid
        self.created = int(app.engine.unix_time())
        self.msg_id = "msg_" + _hex("msg:" + rid)
        self.fc_id = "fc_" + _hex("fc:" + rid)
        self.seq = 0
        self.item: str | None = None  # "message" or "function_call" while one is open
        self.output_index = 0
        self.content: list[str] = []
        self.arguments: list[str] = []
        self.text: list[str] = []
        self.on_done: Any = None

    # --- the response object ---
    def response(self, status: str, output: list[dict[str, Any]], usage: Any) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id,
            "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature") if body.get("temperature") is not None else 1.0,
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
            "background": bool(body.get("background", False)),
            "max_output_tokens": self.parsed.max_tokens,
            "max_tool_calls": body.get("max_tool_calls"),
            "previous_response_id": body.get("previous_response_id"),
            "prompt": None,
            "reasoning": body.get("reasoning"),
            "service_tier": body.get("service_tier", "auto"),
            "status": status,
            "text": body.get("text"),
            "top_logprobs": None,
            "truncation": body.get("truncation") or "disabled",
            "usage": usage,
            "user": body.get("user"),
            "input_messages": None,
            "output_messages": None,
        }

    @staticmethod
    def usage(out: StepOutput) -> dict[str, Any]:
        p, n, c = out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens
        return {
            "input_tokens": p,
            "input_tokens_details": {
                "cached_tokens": c,
                "input_tokens_per_turn": [p],
                "cached_tokens_per_turn": [c],
            },
            "output_tokens": n,
            "output_tokens_details": {
                "reasoning_tokens": 0,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [n],
                "tool_output_tokens_per_turn": [0],
            },
            "total_tokens": p + n,
        }

    def _message_item(self, text: str, status: str) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if text:  # an empty answer is a message without parts, as vLLM writes it
            content.append(
                {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
            )
        return {
            "id": self.msg_id,
            "content": content if status == "completed" else [],
            "role": "assistant",
            "status": status,
            "type": "message",
        }

    def _call_item(self, arguments: str, status: str) -> dict[str, Any]:
        assert self.plan is not None
        return {
            "arguments": arguments,
            "call_id": self.plan.call_id,
            "name": self.plan.name,
            "type": "function_call",
            "id": self.fc_id,
            "status": status,
        }

    def _outputs(self, text: str) -> list[dict[str, Any]]:
        plan = self.plan
        if plan is None:
            return [self._message_item(text, "completed")]
        content, called = plan.parse(text)
        items = []
        if content and (not called or plan.mode == "auto"):
            items.append(self._message_item(content, "completed"))
        if called:
            items.append(self._call_item(plan.arguments, "completed"))
        return items

    def full(self, text: str, last: StepOutput) -> Any:
        status = "incomplete" if last.finish_reason == "length" else "completed"
        final = self.response(status, self._outputs(text), self.usage(last))
        if self.on_done is not None:
            self.on_done(final)
        return final

    # --- streaming ---
    def _event(self, kind: str, fields: dict[str, Any]) -> str:
        data = {**fields, "sequence_number": self.seq, "type": kind}
        self.seq += 1
        return sse_event(kind, data)

    def head(self) -> list[str]:
        initial = self.response("in_progress", [], None)
        return [
            self._event("response.created", {"response": initial}),
            self._event("response.in_progress", {"response": initial}),
        ]

    def _close(self) -> list[str]:
        frames = []
        index = self.output_index
        if self.item == "message":
            text = "".join(self.content)
            part: dict[str, Any] = {
                "annotations": [],
                "text": text,
                "type": "output_text",
                "logprobs": None,
            }
            frames += [
                self._event(
                    "response.output_text.done",
                    {
                        "content_index": 0,
                        "item_id": self.msg_id,
                        "logprobs": [],
                        "output_index": index,
                        "text": text,
                    },
                ),
                self._event(
                    "response.content_part.done",
                    {
                        "content_index": 0,
                        "item_id": self.msg_id,
                        "output_index": index,
                        "part": part,
                    },
                ),
                self._event(
                    "response.output_item.done",
                    {"item": self._message_item(text, "completed"), "output_index": index},
                ),
            ]
        elif self.item == "function_call":
            assert self.plan is not None
            args = "".join(self.arguments)
            frames += [
                self._event(
                    "response.function_call_arguments.done",
                    {
                        "arguments": args,
                        "item_id": self.fc_id,
                        "name": self.plan.name,
                        "output_index": index,
                    },
                ),
                self._event(
                    "response.output_item.done",
                    {"item": self._call_item(args, "completed"), "output_index": index},
                ),
            ]
        if self.item is not None:
            self.output_index += 1
            self.item = None
        return frames

    def output(self, out: StepOutput) -> list[str]:
        frames = []
        self.text.append(out.text)
        content, began, args = self.tracker.feed(out.text)
        if content:
            if self.item != "message":
                frames += self._close()
                self.item = "message"
                part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
                frames += [
                    self._event(
                        "response.output_item.added",
                        {
                            "item": self._message_item("", "in_progress"),
                            "output_index": self.output_index,
                        },
                    ),
                    self._event(
                        "response.content_part.added",
                        {
                            "content_index": 0,
                            "item_id": self.msg_id,
                            "output_index": self.output_index,
                            "part": part,
                        },
                    ),
                ]
            self.content.append(content)
            frames.append(
                self._event(
                    "response.output_text.delta",
                    {
                        "content_index": 0,
                        "delta": content,
                        "item_id": self.msg_id,
                        "logprobs": [],
                        "output_index": self.output_index,
                    },
                )
            )
        if began:
            frames += self._close()
            self.item = "function_call"
            frames.append(
                self._event(
                    "response.output_item.added",
                    {"item": self._call_item("", "in_progress"), "output_index": self.output_index},
                )
            )
        if args:
            self.arguments.append(args)
            frames.append(
                self._event(
                    "response.function_call_arguments.delta",
                    {"delta": args, "item_id": self.fc_id, "output_index": self.output_index},
                )
            )
        return frames

    def finish(self, out: StepOutput) -> list[str]:
        frames = self._close()
        final = self.full("".join(self.text), out)
        frames.append(self._event("response.completed", {"response": final}))
        return frames

    def stream_error(self) -> list[str]:
        error = {"code": "internal_error", "message": "Internal server error", "param": None}
        return [self._event("error", error)]
