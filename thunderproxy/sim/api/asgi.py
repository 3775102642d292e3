"""What the simulator's HTTP face is made of, below its routes: the request a handler gets, the
responses it sends, and ``Face``, what a route module may ask of the app that mounts it.

The route modules (anthropic, responses_api, chat_tools, control, sglang, serving) take a
``Face`` and import this module, not app.py, which imports them all to assemble its routes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol
from urllib.parse import parse_qs

import trio

from ..config import SimConfig
from ..engine.core import Engine, RequestHandle, StepOutput
from .errors import APIError, validation_error
from .protocol import GenerateRequest
from .responses import ResponseBuilder, dumps

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
BUSY = "The engine is currently busy, please retry later."


class Disconnected(Exception):
    pass


@dataclasses.dataclass
class Request:
    scope: Scope
    receive: Receive
    send: Send
    headers: dict[str, str]

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(self.scope.get("query_string", b"").decode("latin-1"))

    async def body(self) -> bytes:
        chunks = []
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise Disconnected
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                return b"".join(chunks)

    async def json(self) -> Any:
        raw = await self.body()
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise validation_error(
                "json_invalid", "body.0", "JSON decode error", {}, {"error": exc.msg}
            ) from None
        except ValueError:  # undecodable bytes
            raise validation_error("json_invalid", "body.0", "JSON decode error", {}) from None


Handler = Callable[[Request], Awaitable[None]]


async def lifespan(receive: Receive, send: Send) -> None:
    """An ASGI app's lifespan that only starts and stops (the simulator's, and any small app's
    that has nothing to set up)."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def read_whole(receive: Receive) -> bytes:
    """A request's body, every part of it (a disconnect ends it where it stands)."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def collect(
    engine: Engine, handle: RequestHandle, fault: str | None
) -> tuple[str, StepOutput] | None:
    """A whole (not streamed) answer: its text and last output; None where the engine failed
    it or a ``stream`` fault was asked for, the request then aborted (the caller answers the
    error in its protocol's shape)."""
    texts = []
    last = None
    async for out in handle:
        if out.finish_reason == "error" or fault == "stream":
            engine.abort(handle.request_id)
            return None
        texts.append(out.text)
        last = out
    assert last is not None
    return "".join(texts), last


class Pacer:
    """A streamed answer's outputs in batches, at most one flush per ``interval`` (vLLM's
    ``--stream-interval``, in seconds; 0: every batch at once): a batch that comes sooner
    after the last flush waits out the rest and takes what arrived meanwhile."""

    def __init__(self, handle: RequestHandle, interval: float) -> None:
        self.handle = handle
        self.interval = interval
        self.last_flush = -1e18

    async def next(self) -> list[StepOutput]:
        """The next batch (empty: the answer is over)."""
        batch = await self.handle.next_batch()
        if batch and self.interval > 0:
            wait = self.last_flush + self.interval - trio.current_time()
            if wait > 0:
                await trio.sleep(wait)
                batch.extend(self.handle.drain())
        return batch

    def flushed(self) -> None:
        """A batch's bytes were sent."""
        self.last_flush = trio.current_time()


async def respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers or []})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def respond_json(send: Send, status: int, value: Any, extra: list[Any] | None = None) -> None:
    await respond(send, status, dumps(value).encode(), JSON + (extra or []))


#: Writes one generation's answer in its route's format: (handle, response id, fault).
Respond = Callable[[RequestHandle, str, str | None], Awaitable[None]]
#: Scripted output: (token count, text) pieces, instead of sampled text.
Script = Sequence[tuple[int, str]] | None
#: Sends one generated answer: (request, parsed, handle, builder, fault, extra headers).
Answer = Callable[
    [Request, GenerateRequest, RequestHandle, ResponseBuilder, str | None, list[Any]],
    Awaitable[None],
]


class Face(Protocol):
    """The app as its route modules see it (``SimApp``)."""

    engine: Engine
    fingerprint: str

    @property
    def config(self) -> SimConfig: ...

    async def send_error(
        self, send: Send, error: APIError, extra: list[Any] | None = None
    ) -> None: ...

    def id_headers(self, request: Request) -> list[tuple[bytes, bytes]]: ...

    async def execute(
        self,
        request: Request,
        parsed: GenerateRequest,
        respond: Respond,
        *,
        script: Script = None,
    ) -> None: ...

    # The two ways an answer is sent (whole, or streamed), as chat_tools.py calls them.
    @property
    def _complete(self) -> Answer: ...

    @property
    def _stream(self) -> Answer: ...
