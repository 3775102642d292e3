"""The simulator's errors as vLLM sends them: ``APIError`` and the bodies it is rendered to.

Below protocol.py and tools.py, which both raise them.
"""

from __future__ import annotations

from typing import Any

from ..config import SimConfig


class APIError(Exception):
    """An error response: HTTP status plus the message/type/param vLLM would report."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        # A whole error body in another API's shape (Anthropic's), sent instead of OpenAI's.
        self.shape: dict[str, Any] | None = None


def error_body(error: APIError, config: SimConfig) -> dict[str, Any]:
    """Nested from vLLM 0.10 on, flat before (and in SGLang)."""
    if error.shape is not None:
        return error.shape
    if config.personality == "sglang" or config.compat in ("0.8", "0.9"):
        return {
            "object": "error",
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.status,
        }
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.status,
        }
    }


def validation_error(
    kind: str, loc: str, msg: str, value: Any, ctx: dict[str, str] | None = None
) -> APIError:
    if isinstance(value, dict):
        shown = f"'<dict of {len(value)} items>'"
    elif isinstance(value, list):
        shown = f"'<list of {len(value)} items>'"
    else:
        shown = repr(value)
    detail = f"'type': '{kind}', 'loc': '{loc}', 'msg': '{msg}', 'input': {shown}"
    if ctx:
        detail += f", 'ctx': {ctx!r}"
    text = f"1 validation error:\n  {{{detail}}}"
    return APIError(400, text, "Bad Request", loc)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "BadRequestError", param)
