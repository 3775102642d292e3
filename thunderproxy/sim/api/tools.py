"""Tool calling for the simulated model: the chat template's tool parts, the seeded decision
whether a reply is a tool call, the argument generator, and the reply's layout.

vLLM renders `tools` and earlier `tool_calls` through the model's chat template and parses
tool calls back out of the generated text with a tool parser (hermes-style
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` here). The simulator does the same
with its own template, so a tool call's markup and arguments are generated tokens (decode
time, usage) and an agent that sends the call back in its history gets prefix-cache hits on it.
"""

from __future__ import annotations

import hashlib
import json
import random
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import bad_request

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query. "
    "Function signatures are within <tools></tools>:\n<tools>\n"
)
TOOLS_FOOTER = (
    "\n</tools>\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> tags."
)


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_chat_tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


# --- the chat template's tool parts -------------------------------------------------------
def render_call(name: str, arguments: Any) -> str:
    """One tool call as the model writes it (and as the template renders it back)."""
    return CALL_OPEN + json.dumps({"name": name, "arguments": arguments}) + CALL_CLOSE


def _arguments(raw: Any) -> Any:
    # vLLM hands the template parsed arguments; a string that is not JSON stays a string.
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw if raw is not None else {}


def template_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[ToolSpec] | None
) -> list[Mapping[str, Any]]:
    """Chat messages with tool parts rendered into text, for `Tokenizer.encode_chat`.

    The tools block joins the leading system message (or becomes one); an assistant
    message's `tool_calls` follow its content, one `<tool_call>` each, exactly as the model
    generated them, so a resent history retokenizes to the ids that were generated.
    """
    out: list[Mapping[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls or not isinstance(calls, list):
            out.append(message)  # not copied: agents resend hundreds of messages a turn
            continue
        text = _plain(message.get("content"))
        parts = []
        for call in calls:
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(function, Mapping):
                name = str(function.get("name", ""))
                parts.append(render_call(name, _arguments(function.get("arguments"))))
        rendered = "\n".join(parts)
        if text and parts:
            text = text if text.endswith("\n") else text + "\n"
        out.append({"role": message.get("role", "assistant"), "content": text + rendered})
    if tools:
        block = TOOLS_HEADER + "\n".join(json.dumps(t.as_chat_tool()) for t in tools)
        block += TOOLS_FOOTER
        if out and out[0].get("role") == "system":
            out[0] = {"role": "system", "content": _plain(out[0].get("content")) + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _plain(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    return str(content)


# --- request parsing ------------------------------------------------------------------------
def chat_tools(body: Mapping[str, Any]) -> list[ToolSpec] | None:
    """`tools` of a chat completion request, validated as vLLM's `check_tool_usage` does."""
    raw = body.get("tools")
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request("`tools` must be a list. (parameter=tools)", "tools")
    if not raw:
        raise bad_request(
            "`tools` must not be an empty array. Either provide at least one tool or omit "
            "the field entirely. (parameter=tools)",
            "tools",
        )
    specs = []
    for i, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise bad_request(f"tools.{i}.function.name is required. (parameter=tools)", "tools")
        params = function.get("parameters")
        specs.append(
            ToolSpec(
                function["name"],
                function.get("description"),
                dict(params) if isinstance(params, Mapping) else {},
            )
        )
    return specs


def chat_tool_choice(body: Mapping[str, Any], tools: list[ToolSpec] | None) -> str | None:
    """'none', 'auto', 'required', a function name, or None when tools are absent."""
    choice = body.get("tool_choice")
    if "tool_choice" not in body and tools:
        choice = "auto"
    if choice is None or choice == "none":
        return None if choice is None and not tools else "none"
    if tools is None:
        raise bad_request(
            "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)", "tool_choice"
        )
    if choice in ("auto", "required"):
        return str(choice)
    if isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(
                "Expected field `name` in `function` in `tool_choice`! Correct usage: "
                '`{"type": "function", "function": {"name": "my_function"}}` '
                "(parameter=tool_choice.function.name)",
                "tool_choice.function.name",
            )
        if name not in {t.name for t in tools}:
            raise bad_request(
                "The tool specified in `tool_choice` does not match any of the specified "
                "`tools` (parameter=tool_choice)",
                "tool_choice",
            )
        return name
    raise bad_request(
        f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
        '"required" are supported. (parameter=tool_choice)',
        "tool_choice",
    )


# --- the decision and the reply's layout ----------------------------------------------------
@dataclass(frozen=True)
class ToolCallPlan:
    """A reply that calls `name`: `text` is everything the model generates (before EOS).

    `content_end` ends the free text the client sees as content; the arguments are
    `text[args_start:args_end]`. `mode` is auto (hermes markup after optional text),
    required (a JSON list, as vLLM's structured output writes it) or named (bare arguments).
    """

    mode: str
    name: str
    arguments: str
    call_id: str
    text: str
    content_end: int
    args_start: int
    args_end: int

    def parse(self, generated: str) -> tuple[str | None, bool]:
        """(content, called) of finished output, as a non-streaming tool parser sees it."""
        if generated != self.text:
            return generated, False  # cut short: the parser finds no complete call
        content = self.text[: self.content_end] or None
        return content, True


def prompt_digest(prompt_ids: Sequence[int]) -> str:
    data = array("Q", (i & 0xFFFFFFFFFFFFFFFF for i in prompt_ids)).tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def plan_tool_call(
    *,
    tools: Sequence[ToolSpec] | None,
    choice: str | None,
    after_tool_result: bool,
    probability: float,
    probability_after_result: float,
    seed: int,
    prompt_ids: Sequence[int],
    preamble: str,
    call_id_prefix: str,
) -> ToolCallPlan | None:
    """Decide, seeded by the prompt, whether this reply calls a tool, and lay it out.

    `preamble` is text the model may write before an auto call (the caller's seeded word
    stream); whether it does is drawn here too.
    """
    if not tools or choice in (None, "none"):
        return None
    rng = random.Random(f"tools:{seed}:{prompt_digest(prompt_ids)}")
    if choice == "auto":
        p = probability_after_result if after_tool_result else probability
        if rng.random() >= p:
            return None
        tool = tools[rng.randrange(len(tools))]
    elif choice == "required":
        tool = tools[rng.randrange(len(tools))]
    else:
        tool = next(t for t in tools if t.name == choice)
    arguments = json.dumps(ArgumentGenerator(rng).value(tool.parameters, tool.name))
    call_id = call_id_prefix + format(rng.getrandbits(128), "032x")
    if choice == "auto":
        text = preamble.rstrip() if rng.random() < 0.35 else ""
        content_end = len(text)
        if text:
            text += "\n"
        head = text + CALL_OPEN + json.dumps({"name": tool.name, "arguments": 0})[:-2]
        return ToolCallPlan(
            "auto",
            tool.name,
            arguments,
            call_id,
            head + arguments + "}" + CALL_CLOSE,
            content_end,
            len(head),
            len(head) + len(arguments),
        )
    if choice == "required":
        head = '[{"name": ' + json.dumps(tool.name) + ', "parameters": '
        full = head + arguments + "}]"
        return ToolCallPlan(
            "required",
            tool.name,
            arguments,
            call_id,
            full,
            0,
            len(head),
            len(head) + len(arguments),
        )
    return ToolCallPlan("named", tool.name, arguments, call_id, arguments, 0, 0, len(arguments))


class Tracker:
    """Splits generated text, as it streams, into content, the call's start and arguments.

    What a streaming tool parser does: free text goes out as content, the markup is held
    back, the function name is announced once it is complete, argument text is forwarded.
    """

    def __init__(self, plan: ToolCallPlan | None) -> None:
        self.plan = plan
        self.pos = 0
        self.started = False

    def feed(self, piece: str) -> tuple[str, bool, str]:
        """(content delta, call just started, arguments delta) for the next piece."""
        start, self.pos = self.pos, self.pos + len(piece)
        plan = self.plan
        if plan is None:
            return piece, False, ""
        end = self.pos
        content = piece[: max(0, plan.content_end - start)] if start < plan.content_end else ""
        began = False
        if not self.started and end >= plan.args_start and (plan.args_start or end > 0):
            self.started = began = True
        a0, a1 = max(start, plan.args_start), min(end, plan.args_end)
        args = piece[a0 - start : a1 - start] if a1 > a0 else ""
        return content, began, args


# --- arguments from a JSON schema -----------------------------------------------------------
_WORDS = (
    "config",
    "main",
    "test",
    "utils",
    "server",
    "client",
    "handler",
    "model",
    "data",
    "request",
    "parser",
    "cache",
    "index",
    "router",
    "worker",
    "queue",
    "state",
    "api",
)
_COMMANDS = (
    "ls -la {d}",
    'grep -rn "{w}" {d}',
    "python -m pytest {d}/test_{w}.py -q",
    "cat {f}",
    "git diff --stat",
    "sed -n '1,{n}p' {f}",
    "find {d} -name '*.py' | head",
    "python {f} --{w} {n}",
    "git log --oneline -n {n}",
    "wc -l {f}",
)
_CODE = (
    "def {w}_{v}(self, {v}):",
    "    return self.{w}[{v}]",
    "    if {v} is None:",
    '        raise ValueError("{w} is missing")',
    "for {v} in {w}s:",
    "    {w}.append({v})",
    '{w} = {v}.get("{w}", {n})',
    "import {w}",
    "class {W}:",
    "    pass",
)


class ArgumentGenerator:
    """Values that satisfy a JSON schema's required properties, sized like an agent's calls."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def value(self, schema: Any, key: str, depth: int = 0) -> Any:
        if not isinstance(schema, Mapping):
            return self._string(key)
        if "const" in schema:
            return schema["const"]
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return enum[self.rng.randrange(len(enum))]
        for union in ("anyOf", "oneOf"):
            options = schema.get(union)
            if isinstance(options, list) and options:
                real = [
                    o for o in options if not (isinstance(o, Mapping) and o.get("type") == "null")
                ]
                return self.value((real or options)[0], key, depth)
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "string")
        if kind is None:
            kind = "object" if "properties" in schema else "string"
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            low = int(schema.get("minItems", 1))
            high = max(low, min(int(schema.get("maxItems", 3)), low + 2))
            count = self.rng.randint(low, high) if depth < 3 else low
            return [self.value(schema.get("items", {}), key, depth + 1) for _ in range(count)]
        if kind == "integer":
            low = int(schema.get("minimum", 1))
            return self.rng.randint(low, max(low, int(schema.get("maximum", low + 199))))
        if kind == "number":
            lo = float(schema.get("minimum", 0.0))
            return round(self.rng.uniform(lo, float(schema.get("maximum", lo + 100.0))), 2)
        if kind == "boolean":
            return self.rng.random() < 0.5
        if kind == "null":
            return None
        return self._string(key)

    def _object(self, schema: Mapping[str, Any], depth: int) -> dict[str, Any]:
        props = schema.get("properties")
        if not isinstance(props, Mapping):
            props = {}
        required = schema.get("required")
        wanted = set(required) if isinstance(required, list) else set()
        out: dict[str, Any] = {}
        for name, sub in props.items():
            if name in wanted or (depth < 2 and self.rng.random() < 0.25):
                out[name] = self.value(sub, name, depth + 1)
        for name in sorted(wanted - set(out)):  # required but never described
            out[name] = self._string(str(name))
        return out

    def _string(self, key: str) -> str:
        rng, k = self.rng, key.lower()
        if "command" in k or k in ("cmd", "script", "shell"):
            return self._fill(rng.choice(_COMMANDS))
        if "path" in k or "file" in k or k in ("dir", "directory", "filename"):
            return self._path()
        if any(s in k for s in ("content", "code", "new_str", "old_str", "text", "patch", "body")):
            lines = [self._fill(rng.choice(_CODE)) for _ in range(rng.randint(2, 12))]
            return "\n".join(lines)
        if k in ("url", "uri"):
            return f"https://example.com/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}"
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 8)))

    def _path(self) -> str:
        rng = self.rng
        parts = [rng.choice(_WORDS) for _ in range(rng.randint(1, 3))]
        return "/workspace/" + "/".join(parts) + "/" + rng.choice(_WORDS) + ".py"

    def _fill(self, template: str) -> str:
        rng = self.rng
        word = rng.choice(_WORDS)
        return template.format(
            w=word,
            W=word.capitalize(),
            v=rng.choice(_WORDS),
            n=rng.randint(1, 80),
            d="/workspace/" + rng.choice(_WORDS),
            f=self._path(),
        )


def after_tool_result(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the conversation ends with a tool's result (chat form)."""
    return bool(messages) and messages[-1].get("role") == "tool"
