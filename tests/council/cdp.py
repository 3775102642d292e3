"""Just enough of the Chrome DevTools Protocol to drive a page: headless Chromium started on
a free port, one page's websocket (wsproto over a trio stream), commands and their results."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Message,
    Ping,
    Request,
    TextMessage,
)

DEVTOOLS = re.compile(rb"DevTools listening on (ws://[^\s]+)")


class Page:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.ids = 0
        self.text: list[str] = []
        self.inbox: list[dict[str, Any]] = []

    async def _send(self, event: Any) -> None:
        await self.stream.send_all(self.ws.send(event))

    async def _next(self) -> dict[str, Any]:
        """The next message from Chromium (a plain coroutine: nothing to finalize)."""
        while not self.inbox:
            data = await self.stream.receive_some(65536)
            if not data:
                raise ConnectionError("Chromium closed the DevTools connection")
            self.ws.receive_data(data)
            for event in self.ws.events():
                if isinstance(event, Ping):
                    await self._send(event.response())
                elif isinstance(event, CloseConnection):
                    raise ConnectionError("Chromium closed the DevTools connection")
                elif isinstance(event, AcceptConnection):
                    self.inbox.append({"accepted": True})
                elif isinstance(event, TextMessage):
                    self.text.append(event.data)
                    if event.message_finished:
                        self.inbox.append(json.loads("".join(self.text)))
                        self.text.clear()
        return self.inbox.pop(0)

    async def handshake(self, url: str) -> None:
        parts = urlsplit(url)
        await self._send(Request(host=parts.netloc, target=parts.path))
        while not (await self._next()).get("accepted"):
            pass

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.ids += 1
        ident = self.ids
        await self._send(
            Message(data=json.dumps({"id": ident, "method": method, "params": params}))
        )
        while (message := await self._next()).get("id") != ident:
            pass  # events and answers to nothing we wait for
        if "error" in message:
            raise RuntimeError(f"{method}: {message['error']}")
        result: dict[str, Any] = message.get("result", {})
        return result

    async def evaluate(self, expression: str) -> Any:
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, *, timeout: float = 30.0) -> Any:
        """Poll a JS expression until it is truthy; its value (DOM nodes come back as True)."""
        with trio.fail_after(timeout):
            while not (
                value := await self.evaluate(f"(v => v instanceof Node || v)({expression})")
            ):
                await trio.sleep(0.1)
        return value

    async def screenshot(self, path: Path) -> None:
        result = await self.call("Page.captureScreenshot", format="png")
        target = trio.Path(path)
        await target.parent.mkdir(parents=True, exist_ok=True)
        await target.write_bytes(base64.b64decode(result["data"]))


@asynccontextmanager
async def open_page(chromium: str, *, width: int = 1280, height: int = 1100) -> AsyncIterator[Page]:
    # Chromium's helper processes may still write to the profile as the browser exits.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        process = await trio.lowlevel.open_process(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", f"--window-size={width},{height}",
             "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            assert process.stderr is not None
            seen = b""
            with trio.fail_after(30):
                while not (match := DEVTOOLS.search(seen)):
                    chunk = await process.stderr.receive_some()
                    if not chunk:
                        raise AssertionError(f"Chromium exited:\n{seen.decode()}")
                    seen += chunk
            browser = urlsplit(match.group(1).decode())
            async with httpx.AsyncClient() as client:
                targets = (await client.get(f"http://{browser.netloc}/json/list")).json()
            page_url = next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"]
            parts = urlsplit(page_url)
            stream = await trio.open_tcp_stream(parts.hostname or "127.0.0.1", parts.port or 0)
            page = Page(stream)
            await page.handshake(page_url)
            await page.call("Page.enable")
            yield page
            await stream.aclose()
        finally:
            process.terminate()
            with trio.move_on_after(10):
                await process.wait()
