"""Response bodies and SSE chunks in vLLM's exact field order.

Token chunks are assembled from pre-rendered JSON fragments: at 64 streams and a 0.1x
time scale the simulator sends tens of thousands of chunks a second, and a `json.dumps`
of the whole chunk dict per token would be most of the CPU.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..config import SimConfig

_dumps = json.JSONEncoder(ensure_ascii=True, separators=(",", ":")).encode


def dumps(value: Any) -> str:
    return _dumps(value)


class ResponseBuilder:
    """Everything one request sends back, in the configured personality and compat."""

    def __init__(
        self,
        config: SimConfig,
        *,
        chat: bool,
        response_id: str,
        created: int,
        fingerprint: str,
        block_size: int,
    ) -> None:
        self.config = config
        self.chat = chat
        self.id = response_id
        self.created = created
        self.fingerprint = fingerprint
        self.block_size = block_size
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = (
            f'{{"id":{dumps(response_id)},"object":"{obj}","created":{created},'
            f'"model":{dumps(config.served_model_name)},"choices":'
        )
        if chat:
            self._open = '[{"index":0,"delta":{"content":'
            self._mid = '},"logprobs":null,"finish_reason":null,"token_ids":null}]'
            self._final = (
                '},"logprobs":null,"finish_reason":%s,"stop_reason":null,"token_ids":null}]'
            )
        else:
            self._open = '[{"index":0,"text":'
            tail = ',"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]'
            self._mid = ',"logprobs":null,"finish_reason":null' + tail
            self._final = ',"logprobs":null,"finish_reason":%s' + tail

    # --- streaming ---------------------------------------------------------------------
    def role_chunk(self) -> str:
        return (
            self._head + '[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
            '"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}'
        )

    def token_chunk(
        self,
        text: str,
        finish_reason: str | None,
        *,
        usage: dict[str, Any] | None = None,
        with_fingerprint: bool = False,
    ) -> str:
        if finish_reason is None:
            body = self._head + self._open + dumps(text) + self._mid
        else:
            body = self._head + self._open + dumps(text) + self._final % dumps(finish_reason)
        if usage is not None:
            body += ',"usage":' + dumps(usage)
        if with_fingerprint:
            body += ',"system_fingerprint":' + dumps(self.fingerprint)
        return body + "}"

    def usage_chunk(self, usage: dict[str, Any]) -> str:
        return (
            self._head
            + '[],"usage":'
            + dumps(usage)
            + ',"system_fingerprint":'
            + dumps(self.fingerprint)
            + "}"
        )

    # --- usage -------------------------------------------------------------------------
    def usage(self, prompt: int, completion: int, cached: int, *, stream: bool) -> dict[str, Any]:
        """Streamed usage drops null fields; the non-streamed one spells them out."""
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        }
        details = self._details(prompt, cached, stream=stream)
        current = self.config.compat == "current" and self.config.personality == "vllm"
        if stream:
            if details is not None:
                usage["prompt_tokens_details"] = details
        else:
            usage["prompt_tokens_details"] = details
            if current:
                usage["completion_tokens_details"] = None
        return usage

    def _details(self, prompt: int, cached: int, *, stream: bool) -> dict[str, Any] | None:
        cfg = self.config
        if not cfg.cache_report():
            return None
        if cfg.compat == "0.8" and cached == 0:
            return None  # 0.8.x omitted the object when nothing hit
        details: dict[str, Any] = {"cached_tokens": cached}
        if cfg.compat != "current" or cfg.personality != "vllm":
            return details
        created = max(0, prompt // self.block_size * self.block_size - cached)
        if self.chat:
            details["created_cache_tokens"] = created
        elif not stream:
            details["created_cache_tokens"] = None
        if not stream:
            details["multimodal_tokens"] = None
        return details

    # --- non-streaming -----------------------------------------------------------------
    def full_response(self, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.config.served_model_name,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": usage,
        }
        if self.chat:
            body["prompt_logprobs"] = None
            body["prompt_token_ids"] = None
            body["prompt_text"] = None
        body["kv_transfer_params"] = None
        body["ec_transfer_params"] = None
        body["metrics"] = None
        return body


def models_body(config: SimConfig, created: int, root: str) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": config.served_model_name,
        "object": "model",
        "created": created,
        "owned_by": "sglang" if config.personality == "sglang" else "vllm",
        "root": root,
        "parent": None,
        "max_model_len": config.max_model_len,
    }
    if config.personality == "vllm":
        card["permission"] = [
            {
                "id": "modelperm-"
                + hashlib.blake2b(config.served_model_name.encode(), digest_size=8).hexdigest(),
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ]
    # Extra served names are aliases of the same engine: the same card under each name.
    cards = [card] + [{**card, "id": name} for name in config.served_model_names()[1:]]
    return {"object": "list", "data": cards}
