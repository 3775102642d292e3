"""The one place where errors become HTTP: status codes and OpenAI's JSON error shape."""

from __future__ import annotations

import json
import math
from typing import Any

from quart import Response

from ..errors import (
    AuditError,
    BackendProtocolError,
    BackendTimeout,
    BackendUnavailable,
    ConfigError,
    HeadersTooLarge,
    InvalidRequest,
    NoBackendAvailable,
    NotReady,
    PayloadTooLarge,
    ProfilingDisabled,
    ProgramReleased,
    ProgramUnknown,
    QueueFull,
    ThunderproxyError,
    Unauthorized,
)

STATUS: dict[type[ThunderproxyError], int] = {
    InvalidRequest: 400,
    ProfilingDisabled: 400,
    Unauthorized: 401,
    ProgramUnknown: 404,
    ProgramReleased: 409,
    PayloadTooLarge: 413,
    QueueFull: 429,
    HeadersTooLarge: 431,
    ConfigError: 500,
    AuditError: 500,
    BackendUnavailable: 502,
    BackendProtocolError: 502,
    NoBackendAvailable: 503,
    NotReady: 503,
    BackendTimeout: 504,
}


def status_for(error: ThunderproxyError) -> int:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]  # type: ignore[index]
    return 500


def error_body(message: str, *, error_type: str, status: int, param: str | None = None) -> bytes:
    payload: dict[str, Any] = {
        "error": {"message": message, "type": error_type, "param": param, "code": status}
    }
    return json.dumps(payload).encode()


def error_response(error: ThunderproxyError) -> Response:
    status = status_for(error)
    headers = {"content-type": "application/json"}
    if isinstance(error, (QueueFull, NotReady)):
        headers["retry-after"] = str(max(1, math.ceil(error.retry_after_s)))
    body = error_body(error.message, error_type=error.error_type, status=status, param=error.param)
    return Response(body, status=status, headers=headers)


def sse_error_event(message: str, *, error_type: str, status: int) -> bytes:
    """What a stream that already answered 200 ends with when the backend fails mid-way,
    in vLLM's own mid-stream error form."""
    body = error_body(message, error_type=error_type, status=status)
    return b"data: " + body + b"\n\ndata: [DONE]\n\n"
