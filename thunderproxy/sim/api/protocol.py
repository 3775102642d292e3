"""The OpenAI/vLLM wire format: request validation, response bodies, stream chunks, errors.

Pure functions over dicts (no I/O). Field order and null fields follow what vLLM 0.32
was seen to send (docs/SIMULATOR.md), because clients and golden tests compare shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import SimConfig
from ..engine.tokenizer import Tokenizer
from .errors import APIError, bad_request, validation_error


@dataclass
class GenerateRequest:
    """A validated chat or completion request, prompt already tokenized."""

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    ignore_eos: bool
    min_tokens: int
    cache_salt: str | None
    priority: int
    request_id: str | None


_TYPES: dict[str, tuple[type, ...]] = {
    "bool": (bool,),
    "int": (int,),
    "str": (str,),
    "list": (list,),
    "dict": (dict,),
}
_TYPE_MSG = {
    "bool": ("bool_type", "Input should be a valid boolean"),
    "int": ("int_type", "Input should be a valid integer"),
    "str": ("string_type", "Input should be a valid string"),
    "list": ("list_type", "Input should be a valid list"),
    "dict": ("dict_type", "Input should be a valid dictionary"),
}


def _field(body: Mapping[str, Any], name: str, kind: str, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, _TYPES[kind]) and not (kind == "int" and isinstance(value, bool))
    if not ok:
        code, msg = _TYPE_MSG[kind]
        raise validation_error(code, f"body.{name}", msg, value)
    return value


def parse_generate(
    body: Any, *, chat: bool, config: SimConfig, tokenizer: Tokenizer
) -> GenerateRequest:
    if not isinstance(body, dict):
        raise validation_error("dict_type", "body", "Input should be a valid dictionary", body)
    model = _field(body, "model", "str")
    if model is not None and model not in config.served_model_names():
        raise APIError(
            404,
            f"The model `{model}` does not exist. "
            f"Valid aliases: {', '.join(config.served_model_names())}.",
            "NotFoundError",
            "model",
        )
    if chat:
        prompt_ids = _chat_prompt(body, tokenizer)
    else:
        prompt_ids = _completion_prompt(body, tokenizer, config)
    stream = _field(body, "stream", "bool", False)
    options = _field(body, "stream_options", "dict")
    if options and not stream:  # vLLM tests truthiness: {} passes
        raise bad_request(
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
            "stream_options",
        )
    options = options or {}
    n = _field(body, "n", "int", 1)
    if n != 1:
        raise bad_request(f"thunderproxy sim serves n=1 only, got n={n}. (parameter=n)", "n")
    max_tokens = _field(body, "max_completion_tokens", "int") if chat else None
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", "int")
    max_tokens = _resolve_max_tokens(max_tokens, len(prompt_ids), chat=chat, config=config)
    cache_salt = _field(body, "cache_salt", "str")
    return GenerateRequest(
        chat=chat,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        continuous_usage=bool(options.get("continuous_usage_stats")),
        ignore_eos=_field(body, "ignore_eos", "bool", False),
        min_tokens=_field(body, "min_tokens", "int", 0),
        cache_salt=cache_salt or None,
        priority=_field(body, "priority", "int", 0),
        request_id=_field(body, "request_id", "str"),
    )


def _chat_prompt(body: Mapping[str, Any], tokenizer: Tokenizer) -> list[int]:
    if "messages" not in body:
        raise validation_error("missing", "body.messages", "Field required", body)
    messages = _field(body, "messages", "list")
    if messages is None:
        raise validation_error("list_type", "body.messages", "Input should be a valid list", None)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            loc = f"body.messages.{i}"
            raise validation_error("dict_type", loc, "Input should be a valid dictionary", message)
    if not messages:
        raise bad_request(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    from .tools import chat_tools, template_messages

    rendered = template_messages(messages, chat_tools(body))
    return tokenizer.encode_chat(rendered, add_generation_prompt=True)


def _completion_prompt(
    body: Mapping[str, Any], tokenizer: Tokenizer, config: SimConfig
) -> list[int]:
    if "prompt" not in body:
        raise validation_error("missing", "body.prompt", "Field required", body)
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(
                "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                "prompt",
            )
        return tokenizer.encode(prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise bad_request("You must pass at least one prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            for token in prompt:
                if not 0 <= token < config.vocab_size:
                    raise bad_request(f"Token id {token} is out of vocabulary", "prompt")
            return list(prompt)
        if all(isinstance(p, str | list) for p in prompt):
            raise bad_request("thunderproxy sim serves one prompt per request", "prompt")
    raise validation_error("list_type", "body.prompt", "Input should be a valid list", prompt)


def _resolve_max_tokens(
    requested: int | None, prompt_len: int, *, chat: bool, config: SimConfig
) -> int:
    limit = config.max_model_len
    if prompt_len >= limit:
        if config.compat == "current":
            message = (
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains {prompt_len} input tokens, which exceeds this limit even without any "
                "output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={prompt_len})"
            )
        else:
            message = (
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {prompt_len} input tokens. Please reduce the length of the input messages."
            )
        raise bad_request(message, "input_tokens")
    if requested is None:
        return limit - prompt_len if chat else min(16, limit - prompt_len)
    if requested < 1:
        raise bad_request(
            f"max_tokens must be at least 1, got {requested}. "
            f"(parameter=max_tokens, value={requested})",
            "max_tokens",
        )
    if requested > limit:
        raise bad_request(
            f"max_tokens={requested} cannot be greater than max_model_len={limit}. Please "
            f"request fewer output tokens. (parameter=max_tokens, value={requested})",
            "max_tokens",
        )
    if prompt_len + requested > limit:
        if config.compat != "current":
            raise bad_request(
                f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This "
                f"model's maximum context length is {limit} tokens and your request has "
                f"{prompt_len} input tokens ({requested} > {limit} - {prompt_len}).",
                "max_tokens",
            )
        return limit - prompt_len  # 0.12+ clamps instead of refusing
    return requested
