"""Forwarding: LLM calls through the scheduler, everything else straight to a backend.

Each LLM call holds a StepLease from the scheduler; whatever happens (normal end, backend error,
client gone, proxy stopping) the lease is closed exactly once with the status that happened.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import quote

import httpx
import trio
from quart import Response, request
from werkzeug.datastructures import Headers

from ..backends import Backend, BackendPool
from ..backends.pool import map_httpx_errors
from ..errors import BackendError, BackendUnavailable, InvalidRequest, ThunderproxyError
from ..programs import StepUsage
from ..scheduling import Scheduler, StepLease
from ..scheduling.scheduler import StepOutcome
from .errors import sse_error_event, status_for
from .sse import UsageTap, usage_from_body
from .validate import check_identifier, check_identifiers, header_text, load_json, wire_headers

DEFAULT_PROGRAM = "default"
MAX_PROGRAM_ID_CHARS = 256

#: RFC 9110 hop-by-hop headers, plus the ones the proxy recomputes for each hop.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
    }
)
#: Set by our own server on the way back; the backend's copies would be duplicates.
RESPONSE_OWN = frozenset({"date", "server"})

CLEANUP_KEY = "thunderproxy.cleanup"
Cleanup = Callable[[], Awaitable[None]]


def on_request_end(cleanup: Cleanup) -> None:
    """Run ``cleanup`` when this HTTP exchange ends, even if the client vanished before the
    response body was ever started (see http/app.py's connection class)."""
    scope: dict[str, Any] = request.scope  # type: ignore[assignment]
    scope.setdefault(CLEANUP_KEY, []).append(cleanup)


def forward_headers(
    headers: Iterable[tuple[str, str]], *, drop: frozenset[str] = frozenset()
) -> list[tuple[str, str]]:
    items = list(headers)
    listed = {
        token.strip().lower()
        for name, value in items
        if name.lower() == "connection"
        for token in value.split(",")
    }
    skip = HOP_BY_HOP | listed | drop
    return [(name, value) for name, value in items if name.lower() not in skip]


def header_safe(value: str) -> str:
    """``value`` as an HTTP header value: program ids may hold any character, headers may not."""
    if value.isascii() and value.isprintable():
        return value
    return quote(value, safe="")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = load_json(raw)
    except UnicodeDecodeError:
        raise InvalidRequest(
            "Request body is not valid UTF-8; send JSON encoded as UTF-8."
        ) from None
    except ValueError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("Request body must be a JSON object.")
    return body


def extract_program_id(body: dict[str, Any], header: str | None) -> str:
    """Take the program id from the body, ``extra_body`` or ``X-Program-Id`` (in that order) and
    strip it from the body, so the backend never sees a field it does not know."""
    found: list[Any] = []
    if "program_id" in body:
        found.append(body.pop("program_id"))
    extra = body.get("extra_body")
    if isinstance(extra, dict) and "program_id" in extra:
        found.append(extra.pop("program_id"))
        if not extra:
            del body["extra_body"]
    if header is not None and not found:
        found.append(header_text(header, "X-Program-Id"))
    if not found:
        return DEFAULT_PROGRAM
    program_id = found[0]
    if not isinstance(program_id, str) or not program_id.strip():
        raise InvalidRequest("program_id must be a non-empty string.", param="program_id")
    check_identifier(program_id, "program_id")
    if len(program_id) > MAX_PROGRAM_ID_CHARS:
        raise InvalidRequest(
            f"program_id is longer than {MAX_PROGRAM_ID_CHARS} characters.", param="program_id"
        )
    return program_id


def context_chars(body: dict[str, Any]) -> int:
    """Characters of prompt text in a chat or completion request (the seed's context_len)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        total = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(
                    len(part.get("text", ""))
                    for part in content
                    if isinstance(part, dict) and isinstance(part.get("text"), str)
                )
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) for p in prompt if isinstance(p, str))
    return 0


def validate_completion_body(body: dict[str, Any], endpoint: str) -> None:
    if endpoint.endswith("chat/completions") and not isinstance(body.get("messages"), list):
        raise InvalidRequest("'messages' must be a list of chat messages.", param="messages")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise InvalidRequest("'stream' must be true or false.", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
    check_identifiers(body)


class Step:
    """Closes one lease exactly once, with what is known about the outcome at that moment."""

    def __init__(
        self,
        scheduler: Scheduler,
        lease: StepLease,
        *,
        endpoint: str,
        model: str | None,
        stream: bool,
    ) -> None:
        self.scheduler = scheduler
        self.lease = lease
        self.endpoint = endpoint
        self.model = model
        self.stream = stream
        self.first_token_at: float | None = None
        self.usage = StepUsage()

    def finish(self, status: int, *, error: str | None = None) -> None:
        self.scheduler.end_step(
            self.lease,
            StepOutcome(
                status=status,
                usage=self.usage,
                endpoint=self.endpoint,
                model=self.model,
                stream=self.stream,
                first_token_at=self.first_token_at,
                error=error,
            ),
        )

    async def abandon(self) -> None:
        """The exchange ended before the step did: the client went away (or the proxy stopped)."""
        self.finish(499, error="client closed the connection before the response ended")


async def close_upstream(response: httpx.Response, chunks: Any = None) -> None:
    """Close the backend response at once (shielded: this runs while being cancelled), which
    closes its connection, which is how vLLM learns to abort the request."""
    with trio.CancelScope(shield=True):
        if chunks is not None:
            await chunks.aclose()
        await response.aclose()


class Relay:
    """The streamed body of a backend response, relayed chunk by chunk as it arrives."""

    def __init__(
        self,
        response: httpx.Response,
        *,
        read_timeout: float,
        step: Step | None = None,
        tap: UsageTap | None = None,
    ) -> None:
        self.response = response
        self.read_timeout = read_timeout
        self.step = step
        self.tap = tap
        self._chunks = response.aiter_raw()
        self._done = False

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        while not self._done:
            try:
                with map_httpx_errors(str(self.response.url)), trio.fail_after(self.read_timeout):
                    chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                return self._end()
            except BackendError as exc:
                return self._fail(exc)
            if self.step is not None and self.step.first_token_at is None:
                self.step.first_token_at = trio.current_time()
            try:
                out = chunk if self.tap is None else self.tap.feed(chunk)
            except BackendError as exc:  # an event past the tap's size bound
                return self._fail(exc)
            if out:
                return out
        raise StopAsyncIteration

    def _end(self) -> bytes:
        self._done = True
        tail = b""
        if self.tap is not None:
            tail = self.tap.flush()
        if self.step is not None:
            if self.tap is not None and self.tap.usage is not None:
                self.step.usage = self.tap.usage
            error = None if self.tap is None else self.tap.error
            self.step.finish(self.response.status_code, error=error)
        if not tail:
            raise StopAsyncIteration
        return tail

    def _fail(self, exc: BackendError) -> bytes:
        # Headers (200) are already out: end the stream with an error event, as vLLM does.
        self._done = True
        status = status_for(exc)
        if self.step is not None:
            if self.tap is not None and self.tap.usage is not None:
                self.step.usage = self.tap.usage
            self.step.finish(status, error=exc.message)
        return sse_error_event(exc.message, error_type=exc.error_type, status=status)

    async def aclose(self) -> None:
        await close_upstream(self.response, self._chunks)
        if self.step is not None:
            await self.step.abandon()


def response_headers(response: httpx.Response) -> Headers:
    return Headers(forward_headers(response.headers.multi_items(), drop=RESPONSE_OWN))


class Proxy:
    def __init__(
        self,
        *,
        scheduler: Scheduler,
        pool: BackendPool,
        first_byte_timeout: float,
        read_timeout: float,
    ) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.first_byte_timeout = first_byte_timeout
        self.read_timeout = read_timeout

    async def _send(self, backend: Backend, upstream: httpx.Request) -> httpx.Response:
        try:
            with map_httpx_errors(backend.url), trio.fail_after(self.first_byte_timeout):
                response = await backend.client.send(upstream, stream=True)
        except BackendUnavailable as exc:
            backend.mark_failed(exc.message)
            raise
        except BackendError as exc:
            backend.record_failure(exc.message)
            raise
        if response.status_code < 500:
            backend.failures = 0
        return response

    async def completion(self, endpoint: str) -> Response:
        """POST /v1/chat/completions and /v1/completions: one step of one program."""
        arrived_at = trio.current_time()
        body = parse_json_object(await request.get_data(False, False, False))
        program_id = extract_program_id(body, request.headers.get("x-program-id"))
        validate_completion_body(body, endpoint)
        stream = body.get("stream") is True
        options = body.get("stream_options") or {}
        hide_usage = stream and options.get("include_usage") is not True
        if hide_usage:
            body["stream_options"] = {**options, "include_usage": True}
        model = body.get("model") if isinstance(body.get("model"), str) else None

        try:
            lease = await self.scheduler.begin_step(
                program_id, arrived_at=arrived_at, context_chars=context_chars(body)
            )
        except trio.Cancelled:
            # Only waiting for a paused program can be cancelled here: the client left the
            # queue, so the request is dropped for good and never sent later.
            self.scheduler.record_cancelled_wait(
                program_id, arrived_at=arrived_at, endpoint=endpoint, model=model, stream=stream
            )
            raise
        step = Step(self.scheduler, lease, endpoint=endpoint, model=model, stream=stream)
        on_request_end(step.abandon)
        headers = forward_headers(
            request.headers.items(), drop=frozenset({"x-program-id", "accept-encoding"})
        )
        headers.append(("accept-encoding", "identity"))
        if "x-request-id" not in request.headers:
            headers.append(("x-request-id", header_safe(lease.request_id)))
        upstream = lease.backend.client.build_request(
            "POST", endpoint, content=json.dumps(body).encode(), headers=wire_headers(headers)
        )
        try:
            response = await self._send(lease.backend, upstream)
        except ThunderproxyError as exc:
            step.finish(status_for(exc), error=exc.message)
            exc.step_recorded = True
            raise
        content_type = response.headers.get("content-type", "")
        if stream and response.status_code == 200 and "text/event-stream" in content_type:
            relay = Relay(
                response,
                read_timeout=self.read_timeout,
                step=step,
                tap=UsageTap(hide_usage_chunk=hide_usage),
            )
            return Response(relay, status=200, headers=response_headers(response))
        try:
            with map_httpx_errors(lease.backend.url), trio.fail_after(self.read_timeout):
                content = await response.aread()
        except ThunderproxyError as exc:
            step.finish(status_for(exc), error=exc.message)
            exc.step_recorded = True
            raise
        finally:
            await close_upstream(response)
        error = None
        if response.status_code == 200:
            usage, error = usage_from_body(content)
            step.usage = usage or StepUsage()
        else:
            error = content[:500].decode("utf-8", "replace")
        step.finish(response.status_code, error=error)
        return Response(content, status=response.status_code, headers=response_headers(response))

    async def passthrough(self, path: str) -> Response:
        """Any other path: relayed unchanged to the program's backend or the first healthy one."""
        program_id = request.headers.get("x-program-id")
        program = None if program_id is None else self.scheduler.registry.find(program_id)
        backend = self.pool.get(program.backend) if program is not None else None
        if backend is None or not backend.healthy:
            backend = self.pool.first_healthy()
        target = path
        if request.query_string:
            target += "?" + request.query_string.decode("latin-1")
        upstream = backend.client.build_request(
            request.method,
            target,
            content=await request.get_data(False, False, False),
            headers=wire_headers(forward_headers(request.headers.items())),
        )
        response = await self._send(backend, upstream)
        relay = Relay(response, read_timeout=self.read_timeout)
        on_request_end(relay.aclose)
        return Response(relay, status=response.status_code, headers=response_headers(response))
