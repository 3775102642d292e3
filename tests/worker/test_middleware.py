"""The middleware's edges, driven through the ASGI interface directly: what reaches the app."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.worker.autoscaler import Autoscaler
from thunderproxy.sim.api.asgi import read_whole
from thunderproxy.worker.auth import load_public_key
from thunderproxy.worker.middleware import MAX_BODY_DEPTH, WorkerMiddleware, _strip_auth_params
from thunderproxy.worker.state import WorkerConfig, WorkerState


class RecordingApp:
    """Answers 200 with what it received: the scope's query and the body it read."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await read_whole(receive) if scope["type"] == "http" else b""
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


def http_scope(
    method: str,
    path: str,
    query: bytes = b"",
    body: bytes = b"",
    *,
    server: tuple[str, int] = ("10.0.0.7", 41234),
    scheme: str = "https",
) -> dict[str, Any]:
    """A request that came in on ``server`` (the autoscaler stand-in signs for that address by
    default: ``Autoscaler.worker_url``)."""
    return {
        "type": "http",
        "scheme": scheme,
        "method": method,
        "path": path,
        "query_string": query,
        "server": server,
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


@pytest.mark.parametrize(
    ("signed", "served", "status"),
    [
        ({"endpoint": "/v1/embeddings"}, "/v1/embeddings", 200),
        ({"endpoint": "/v1/embeddings"}, "/council/jobs", 401),
        ({"endpoint": "/v1/embeddings"}, "/v1/chat/completions", 401),
        ({"url": "https://10.0.0.7:41234/v1/embeddings"}, "/v1/embeddings", 200),
        ({"url": "https://10.0.0.7:41234/v1/embeddings"}, "/council/jobs", 401),
        ({"url": "/v1/embeddings/"}, "/v1//./embeddings", 200),
        ({"url": "/v1/%65mbeddings"}, "/v1/embeddings", 200),
        ({"url": "/v1/embeddings", "endpoint": "/v1/models"}, "/v1/embeddings", 401),
        # The autoscaler's usual values, the worker's address and the endpoint group's name,
        # name no route: the signature is good for any.
        ({"url": "https://10.0.0.7:41234", "endpoint": "my-group"}, "/council/jobs", 200),
    ],
    ids=["same", "council", "chat", "url-same", "url-council", "normalised", "encoded",
         "both-disagree", "no-route"],
)  # fmt: skip
async def test_a_signature_opens_only_the_route_it_names(
    signed: dict[str, str], served: str, status: int
) -> None:
    scaler = Autoscaler()
    app = RecordingApp()
    state = secured(scaler)
    middleware = WorkerMiddleware(app, state)  # type: ignore[arg-type]
    wrapped = scaler.wrap({"input": "x"}, **signed)
    body = json.dumps(wrapped).encode()
    sent = await call(
        middleware,
        http_scope("POST", served, body=body),
        [{"type": "http.request", "body": body, "more_body": False}],
    )
    assert sent[0]["status"] == status, sent
    assert len(app.calls) == (status == 200)
    if status == 401:
        message = json.loads(sent[1]["body"])["error"]["message"]
        assert "names the route" in message
        # Refused, so not taken as seen: the same signature still works where it belongs.
        assert wrapped["auth_data"]["reqnum"] not in state.replay._seen


async def test_a_route_bound_query_signature_is_checked_too() -> None:
    scaler = Autoscaler()
    app = RecordingApp()
    middleware = WorkerMiddleware(app, secured(scaler))  # type: ignore[arg-type]
    query = scaler.query(endpoint="/v1/models").encode()
    assert (await call(middleware, http_scope("GET", "/programs", query), []))[0]["status"] == 401
    assert (await call(middleware, http_scope("GET", "/v1/models", query), []))[0]["status"] == 200
    assert len(app.calls) == 1


@pytest.mark.parametrize("unsecured", [False, True], ids=["secured", "unsecured"])
async def test_malformed_auth_data_is_401_in_either_mode(unsecured: bool) -> None:
    # WORKER.md: malformed auth_data is 401; --unsecured answered 400.
    scaler = Autoscaler()
    app = RecordingApp()
    state = secured(scaler, unsecured=unsecured)
    middleware = WorkerMiddleware(app, state)  # type: ignore[arg-type]
    body = json.dumps({"auth_data": {"cost": 1}, "payload": {}}).encode()
    sent = await call(
        middleware,
        http_scope("POST", "/v1/completions", body=body),
        [{"type": "http.request", "body": body, "more_body": False}],
    )
    assert sent[0]["status"] == 401
    error = json.loads(sent[1]["body"])["error"]
    assert error["type"] == "authentication_error"
    assert "Malformed autoscaler signature data" in error["message"]
    assert app.calls == []


@pytest.mark.parametrize("depth", [MAX_BODY_DEPTH + 1, 200_000], ids=["just-past", "200000"])
@pytest.mark.parametrize("unsecured", [False, True], ids=["secured", "unsecured"])
async def test_a_deeply_nested_body_is_a_400_before_the_signature_check(
    depth: int, unsecured: bool
) -> None:
    # A body nested 200,000 deep was a bare empty 500 (RecursionError in the parser).
    scaler = Autoscaler()
    app = RecordingApp()
    state = secured(scaler, unsecured=unsecured)
    middleware = WorkerMiddleware(app, state)  # type: ignore[arg-type]
    inner = depth - 2  # the wrapper object and the payload's object are two levels
    body = (
        b'{"auth_data": {}, "payload": {"x": ' + b"[" * inner + b"]" * inner + b"}}"
        if depth < 1000
        else b"[" * depth + b"]" * depth
    )
    sent = await call(
        middleware,
        http_scope("POST", "/v1/completions", body=body),
        [{"type": "http.request", "body": body, "more_body": False}],
    )
    assert sent[0]["status"] == 400
    error = json.loads(sent[1]["body"])["error"]
    assert error["type"] == "invalid_request_error"
    assert f"more than {MAX_BODY_DEPTH} levels deep" in error["message"]
    assert app.calls == []


async def test_a_body_at_the_depth_bound_passes() -> None:
    scaler = Autoscaler()
    app = RecordingApp()
    middleware = WorkerMiddleware(app, secured(scaler))  # type: ignore[arg-type]
    inner = MAX_BODY_DEPTH - 2
    payload = {"x": json.loads("[" * inner + "]" * inner)}
    body = json.dumps(scaler.wrap(payload)).encode()
    sent = await call(
        middleware,
        http_scope("POST", "/v1/completions", body=body),
        [{"type": "http.request", "body": body, "more_body": False}],
    )
    assert sent[0]["status"] == 200
    assert json.loads(app.calls[0]["body"]) == payload


async def post_signed(
    middleware: WorkerMiddleware, body: bytes, **scope: Any
) -> list[dict[str, Any]]:
    return await call(
        middleware,
        http_scope("POST", "/v1/completions", body=body, **scope),
        [{"type": "http.request", "body": body, "more_body": False}],
    )


@pytest.mark.parametrize(
    ("signed_for", "scope", "status"),
    [
        ("https://10.0.0.7:41234", {}, 200),
        ("HTTPS://10.0.0.7:41234/", {}, 200),
        # Another worker's address, as the autoscaler routes a request to it: refused here.
        ("https://10.0.0.8:41234", {}, 401),
        ("https://10.0.0.7:41235", {}, 401),
        ("http://10.0.0.7:41234", {}, 401),
        ("https://10.0.0.7:41234", {"scheme": "http"}, 401),
        # Default ports are the same address written shorter.
        ("https://10.0.0.7", {"server": ("10.0.0.7", 443)}, 200),
        # Names no address at all: not a signature for this worker.
        ("my-endpoint", {}, 401),
    ],
    ids=["same", "same-written-otherwise", "other-host", "other-port", "other-scheme",
         "came-in-plain", "default-port", "no-address"],
)  # fmt: skip
async def test_a_signature_for_another_workers_address_is_refused(
    signed_for: str, scope: dict[str, Any], status: int
) -> None:
    """Before: the signed url's path was checked and its scheme, host and port were not, so a
    request the autoscaler signed for one worker could be spent at any other."""
    scaler = Autoscaler()
    app = RecordingApp()
    state = secured(scaler)
    middleware = WorkerMiddleware(app, state)  # type: ignore[arg-type]
    wrapped = scaler.wrap({"prompt": "x"}, url=signed_for)
    sent = await post_signed(middleware, json.dumps(wrapped).encode(), **scope)
    assert sent[0]["status"] == status, sent
    assert len(app.calls) == (status == 200)
    if status == 401:
        message = json.loads(sent[1]["body"])["error"]["message"]
        assert "names another worker" in message or "names no worker address" in message
        assert wrapped["auth_data"]["reqnum"] not in state.replay._seen


async def test_the_platforms_public_address_is_this_worker_too() -> None:
    # Behind the platform's port mapping the request comes in on the container's own address
    # while the autoscaler signs the public one (PUBLIC_IPADDR:VAST_TCP_PORT_<port>).
    scaler = Autoscaler(worker_url="https://203.0.113.9:40123")
    app = RecordingApp()
    middleware = WorkerMiddleware(  # type: ignore[arg-type]
        app, secured(scaler, public_url="https://203.0.113.9:40123")
    )
    body = json.dumps(scaler.wrap({"prompt": "x"})).encode()
    assert (await post_signed(middleware, body, server=("172.17.0.2", 3000)))[0]["status"] == 200
    # Signed (by the same autoscaler, a fresh reqnum) for another worker's public address.
    other = Autoscaler(worker_url="https://203.0.113.10:40123", reqnum=scaler.reqnum)
    body = json.dumps(other.wrap({"prompt": "x"})).encode()
    assert (await post_signed(middleware, body, server=("172.17.0.2", 3000)))[0]["status"] == 401


async def test_a_signature_bound_to_a_body_opens_no_other_body() -> None:
    scaler = Autoscaler()
    app = RecordingApp()
    state = secured(scaler)
    middleware = WorkerMiddleware(app, state)  # type: ignore[arg-type]
    wrapped = scaler.wrap({"prompt": "two tokens", "max_tokens": 2})
    swapped = {**wrapped, "payload": {"prompt": "two tokens", "max_tokens": 200000}}
    sent = await post_signed(middleware, json.dumps(swapped).encode())
    assert sent[0]["status"] == 401
    assert "body_sha256" in json.loads(sent[1]["body"])["error"]["message"]
    assert app.calls == []
    # The signed body itself passes, with its reqnum not spent by the refusal.
    assert (await post_signed(middleware, json.dumps(wrapped).encode()))[0]["status"] == 200
    # A query signature binds the rest of the query the same way.
    query = scaler.query({"limit": "10"}, endpoint="/v1/models")
    assert (await call(middleware, http_scope("GET", "/v1/models", query.encode()), []))[0][
        "status"
    ] == 200
    tampered = scaler.query({"limit": "10"}, endpoint="/v1/models").replace("10", "99999")
    assert (await call(middleware, http_scope("GET", "/v1/models", tampered.encode()), []))[0][
        "status"
    ] == 401
