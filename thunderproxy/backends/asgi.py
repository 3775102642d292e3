"""``AsgiBackend``: a backend that is an ASGI app in this process, and ``EngineBackend``, the
simulator's engine behind its own HTTP face.

No sockets: a request is one task running the app, its body chunks handed over a memory
channel as the app sends them, so streaming, disconnects (``aclose``) and timing behave as over
HTTP, and a MockClock can drive everything. Virtual-time benchmarks and most end-to-end logic
run the real gateway and poller this way.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import trio

from ..errors import BackendUnavailable
from .base import UpstreamRequest

if TYPE_CHECKING:
    from ..sim import Engine

Message = dict[str, Any]


class AsgiResponse:
    def __init__(
        self,
        status: int,
        headers: Sequence[tuple[str, str]],
        body: trio.MemoryReceiveChannel[bytes],
        scope: trio.CancelScope,
        disconnect: trio.Event,
    ) -> None:
        self._status = status
        self._headers = headers
        self._body = body
        self._scope = scope
        self._disconnect = disconnect

    @property
    def status_code(self) -> int:
        return self._status

    @property
    def headers(self) -> Sequence[tuple[str, str]]:
        return self._headers

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        async for chunk in self._body:
            if chunk:
                yield chunk

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self._body])

    async def aclose(self) -> None:
        self._disconnect.set()
        self._scope.cancel()
        self._body.close()


class AsgiBackend:
    """Requests served by ``app`` in tasks of ``nursery`` (which must outlive the requests)."""

    def __init__(self, app: Any, nursery: trio.Nursery, *, name: str = "asgi://app") -> None:
        self.app = app
        self.nursery = nursery
        self.name = name

    async def send(self, request: UpstreamRequest) -> AsgiResponse:
        path, _, query = request.target.partition("?")
        scope: Message = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query.encode(),
            "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in request.headers],
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0),
        }
        started, head = trio.open_memory_channel[tuple[int, list[tuple[str, str]]]](1)
        body_in, body_out = trio.open_memory_channel[bytes](math.inf)
        disconnect = trio.Event()
        sent_request = False

        async def receive() -> Message:
            nonlocal sent_request
            if not sent_request:
                sent_request = True
                return {"type": "http.request", "body": request.content, "more_body": False}
            await disconnect.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]
                ]
                started.send_nowait((message["status"], headers))
            elif message["type"] == "http.response.body":
                try:
                    body_in.send_nowait(message.get("body", b""))
                except trio.BrokenResourceError:
                    disconnect.set()  # the reader closed the response: as a client would
                if not message.get("more_body", False):
                    body_in.close()

        scope_box = trio.CancelScope()

        async def serve() -> None:
            with scope_box:
                try:
                    await self.app(scope, receive, send)
                finally:
                    started.close()
                    body_in.close()

        self.nursery.start_soon(serve)
        try:
            status, headers = await head.receive()
        except trio.EndOfChannel:
            raise BackendUnavailable(
                f"Backend {self.name} ended the request without answering.", backend=self.name
            ) from None
        except BaseException:
            disconnect.set()  # timed out or cancelled before the head: abort the request
            scope_box.cancel()
            raise
        finally:
            head.close()
        return AsgiResponse(status, headers, body_out, scope_box, disconnect)


class EngineBackend(AsgiBackend):
    """The simulator ``engine`` behind its vLLM (or SGLang) HTTP face, in this process."""

    def __init__(self, engine: Engine, nursery: trio.Nursery, *, name: str) -> None:
        from ..sim.api.app import SimApp

        super().__init__(SimApp(engine), nursery, name=name)
        self.engine = engine
