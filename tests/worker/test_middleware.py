"""The middleware's edges, driven through the ASGI interface directly: what reaches the app."""

from __future__ import annotations

import json
from typing import Any

from tests.worker.autoscaler import Autoscaler
from thunderproxy.worker.auth import load_public_key
from thunderproxy.worker.middleware import WorkerMiddleware, _strip_auth_params
from thunderproxy.worker.state import WorkerConfig, WorkerState


class RecordingApp:
    """Answers 200 with what it received: the scope's query and the body it read."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        if scope["type"] == "http":
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        self.calls.append({"scope": scope, "body": body})
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def call(
    middleware: WorkerMiddleware, scope: dict[str, Any], messages: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    inbox = list(messages)

    async def receive() -> dict[str, Any]:
        return inbox.pop(0) if inbox else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await middleware(scope, receive, send)
    return sent


def http_scope(method: str, path: str, query: bytes = b"", body: bytes = b"") -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": query,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }  # fmt: skip


def secured(scaler: Autoscaler, **config: Any) -> WorkerState:
    state = WorkerState(WorkerConfig(report_addrs=("http://a",), **config))
    state.public_key = load_public_key(scaler.public_pem)
    return state


def test_auth_parameters_are_stripped_and_the_rest_kept_byte_for_byte() -> None:
    auth, rest = _strip_auth_params(b"a=%2Fx&serverless_cost=2&b=1+2&serverless_url=http%3A%2F%2Fw")
    assert auth == {"serverless_cost": "2", "serverless_url": "http://w"}
    assert rest == b"a=%2Fx&b=1+2"


async def test_signed_body_is_unwrapped_with_its_length_fixed() -> None:
    scaler = Autoscaler()
    app = RecordingApp()
    middleware = WorkerMiddleware(app, secured(scaler))  # type: ignore[arg-type]
    body = json.dumps(scaler.wrap({"model": "m", "n": 1}, cost=3)).encode()
    sent = await call(
        middleware,
        http_scope("POST", "/v1/completions", body=body),
        [{"type": "http.request", "body": body[:10], "more_body": True},
         {"type": "http.request", "body": body[10:], "more_body": False}],
    )  # fmt: skip
    assert sent[0]["status"] == 200
    assert json.loads(app.calls[0]["body"]) == {"model": "m", "n": 1}
    headers = dict(app.calls[0]["scope"]["headers"])
    assert headers[b"content-length"] == str(len(app.calls[0]["body"])).encode()
    assert middleware.state.ledger.totals.served == 3.0


async def test_oversized_body_is_refused_before_the_app() -> None:
    scaler = Autoscaler()
    app = RecordingApp()
    middleware = WorkerMiddleware(app, secured(scaler, max_body_bytes=100))  # type: ignore[arg-type]
    sent = await call(
        middleware,
        http_scope("POST", "/v1/completions"),
        [{"type": "http.request", "body": b"x" * 101, "more_body": False}],
    )
    assert sent[0]["status"] == 413
    assert app.calls == []


async def test_websockets_cannot_bypass_the_signature() -> None:
    scaler = Autoscaler()
    app = RecordingApp()
    middleware = WorkerMiddleware(app, secured(scaler))  # type: ignore[arg-type]
    sent = await call(middleware, {"type": "websocket", "path": "/ws"},
                      [{"type": "websocket.connect"}])  # fmt: skip
    assert sent == [{"type": "websocket.close", "code": 1008}]
    assert app.calls == []
