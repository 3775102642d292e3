"""Errors as HTTP: OpenAI's JSON error shape, its SSE form, and the response, with the status
and type that errors.py's one table gives each error class."""

from __future__ import annotations

import json
import math
from typing import Any

from quart import Response

from ..errors import NotReady, QueueFull, ShuttingDown, ThunderproxyError, describe
from ..protocols import Protocol
from ..protocols import error_body as protocol_error_body


def status_for(error: ThunderproxyError) -> int:
    return describe(error)[0]


def error_body(message: str, *, error_type: str, status: int, param: str | None = None) -> bytes:
    payload: dict[str, Any] = {
        "error": {"message": message, "type": error_type, "param": param, "code": status}
    }
    return json.dumps(payload).encode()


def error_json(error: ThunderproxyError) -> bytes:
    status, error_type = describe(error)
    return error_body(error.message, error_type=error_type, status=status, param=error.param)


def error_response(error: ThunderproxyError, protocol: Protocol | None = None) -> Response:
    """The error as JSON in ``protocol``'s shape (Anthropic's for Messages; OpenAI's for the
    rest and by default), with Retry-After where waiting helps."""
    status, headers, content = error_parts(error, protocol)
    return Response(content, status=status, headers=headers)


def error_parts(
    error: ThunderproxyError, protocol: Protocol | None = None
) -> tuple[int, dict[str, str], bytes]:
    """``error_response``'s status, headers and body, for senders that are not Quart's."""
    status, error_type = describe(error)
    headers = {"content-type": "application/json"}
    if isinstance(error, (QueueFull, NotReady)):
        headers["retry-after"] = str(max(1, math.ceil(error.retry_after_s)))
    if isinstance(error, ShuttingDown):
        # This process will not take the request; close the connection so the retry goes to
        # a fresh one (another replica, or this proxy once restarted).
        headers["retry-after"] = "1"
        headers["connection"] = "close"
    if protocol is Protocol.MESSAGES:
        content = protocol_error_body(
            protocol, status, error_type, error.message, param=error.param
        )
    else:
        content = error_json(error)
    return status, headers, content


def sse_error_event(error: ThunderproxyError) -> bytes:
    """What a stream that already answered 200 ends with when the call fails mid-way,
    in vLLM's own mid-stream error form."""
    return b"data: " + error_json(error) + b"\n\ndata: [DONE]\n\n"
