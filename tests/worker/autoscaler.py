"""A local stand-in for the Vast.ai autoscaler: it holds a real RSA key pair, serves the public
half at /pubkey/, signs requests the way the autoscaler routes them, and records the load
reports workers POST to /worker_status/. Served on loopback (``serve_autoscaler``) or called
in-process through ``httpx.ASGITransport`` (for tests on trio's MockClock)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlencode

import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from thunderproxy.sim.api.asgi import lifespan, read_whole
from thunderproxy.worker.auth import BODY_FIELD, body_digest, payload_bytes, sign

# One key for the whole test run: RSA generation is the slow part of these tests.
_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)


@dataclass
class Autoscaler:
    key: rsa.RSAPrivateKey = _KEY
    #: Reports received, with the trio time each arrived.
    reports: list[dict[str, Any]] = field(default_factory=list)
    report_times: list[float] = field(default_factory=list)
    #: Status answered to reports and key fetches (flip to 500 to play an outage).
    report_status: int = 200
    pubkey_status: int = 200
    pubkey_fetches: int = 0
    #: Bodies of POST /delete_requests/ (answered with report_status, like reports).
    deletes: list[dict[str, Any]] = field(default_factory=list)
    reqnum: int = 0
    url: str = "http://autoscaler.invalid"
    #: The worker it routes to, as the autoscaler signs it (the worker's address): the tests
    #: that run a worker set it to where the worker listens.
    worker_url: str = "https://10.0.0.7:41234"

    @property
    def public_pem(self) -> bytes:
        return self.key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def auth_data(
        self,
        *,
        cost: Any = 1,
        endpoint: str = "test-endpoint",
        reqnum: int | None = None,
        request_idx: int | None = None,
        url: str | None = None,
        body: bytes | None = None,
    ) -> dict[str, Any]:
        """Signed fields for the worker at ``url`` (``worker_url``, or that and a path when
        ``url`` starts with ``/``), bound to ``body`` when one is given."""
        if reqnum is None:
            self.reqnum += 1
            reqnum = self.reqnum
        if url is None or url.startswith("/"):
            url = self.worker_url + (url or "")
        fields: dict[str, Any] = {
            "cost": cost,
            "endpoint": endpoint,
            "reqnum": reqnum,
            "request_idx": reqnum if request_idx is None else request_idx,
            "url": url,
        }
        if body is not None:
            fields[BODY_FIELD] = body_digest(body)
        return {**fields, "signature": sign(self.key, fields)}

    def wrap(self, payload: Any, *, bind_body: bool = True, **auth: Any) -> dict[str, Any]:
        """A POST body as the autoscaler routes it, signed for ``payload`` itself."""
        body = payload_bytes(payload) if bind_body else None
        return {"auth_data": self.auth_data(body=body, **auth), "payload": payload}

    def query(self, extra: dict[str, str] | None = None, **auth: Any) -> str:
        """A query string carrying the signature (GET/DELETE/HEAD), bound to the rest of it."""
        rest = urlencode(extra or {})
        data = self.auth_data(body=rest.encode(), **auth)
        params = {f"serverless_{k}": str(v) for k, v in data.items()}
        return urlencode(params) + ("&" + rest if rest else "")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        body = await read_whole(receive)
        path = scope["path"]
        if path == "/pubkey/" and scope["method"] == "GET":
            self.pubkey_fetches += 1
            status = self.pubkey_status
            answer = self.public_pem if status == 200 else b"unavailable"
        elif path == "/worker_status/" and scope["method"] == "POST":
            status = self.report_status
            if status < 300:
                self.reports.append(json.loads(body))
                self.report_times.append(trio.current_time())
            answer = b"{}"
        elif path == "/delete_requests/" and scope["method"] == "POST":
            status = self.report_status
            if status < 300:
                self.deletes.append(json.loads(body))
            answer = b"{}"
        else:
            status, answer = 404, b"not found"
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": answer})

    def served_total(self) -> float:
        return sum(r["cur_perf"] for r in self.reports)


@asynccontextmanager
async def serve_autoscaler(autoscaler: Autoscaler | None = None) -> AsyncIterator[Autoscaler]:
    """The stand-in on 127.0.0.1, port 0; ``autoscaler.url`` says where."""
    autoscaler = autoscaler or Autoscaler()
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.graceful_timeout = 1.0
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(serve, autoscaler, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
        )
        autoscaler.url = binds[0]
        try:
            yield autoscaler
        finally:
            stop.set()
