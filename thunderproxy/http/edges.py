"""The protocol edges: one shape for every scheduled route, whatever protocol it speaks.

``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/messages`` and ``/v1/responses`` all
go the same way: the body is parsed and checked by its protocol (``protocols.prepare``), the
program is recognised (``ProgramRecognizer.recognise``: an explicit ``program_id`` or
``X-Program-Id`` wins, then client session ids, then the prompt itself), and a ``Call`` with a
``ProtocolWire`` of its own goes to the gateway, which schedules, relays and records it. After a
200 the answer teaches the recognizer: ``observe_answer`` for programs known only by their prompt,
``remember_response`` for Responses ids. ``POST /v1/messages/count_tokens`` generates nothing, so
it is checked and passed to the program's backend without scheduling.

Errors keep each protocol's shape: ``error_shape(path)`` tells the app's error handler which.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Iterable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from typing import Any

import trio
from quart import Response, request
from werkzeug.datastructures import Headers

from .. import protocols
from ..backends import BackendNode, UpstreamRequest
from ..errors import NoBackendAvailable
from ..gateway import Call, Exchange, Gateway
from ..protocols import Protocol, ProtocolWire
from ..protocols.anthropic import prepare_count_tokens
from ..protocols.base import MAX_NESTING, deeper_than
from ..protocols.recognition import (
    ProgramRecognizer,
    Recognised,
    explicit_program_id,
    without_program_id,
)
from .body import read_body
from .clients import Clients, client_of, scoped
from .proxy import (
    RECORDED_KEY,
    RESPONSE_OWN,
    add_cleanup,
    forward_headers,
    on_request_end,
    parse_json_object,
    relay,
    response_headers,
)
from .validate import check_identifier, check_identifiers, header_text

log = logging.getLogger("thunderproxy.http")

#: Headers the proxy reads itself, or recomputes for the backend.
_NOT_FORWARDED = frozenset({"x-program-id", "accept-encoding"})


def error_shape(path: str) -> Protocol | None:
    """The protocol whose error shape a request to ``path`` gets (None: OpenAI's, the default)."""
    return protocols.ROUTES.get(path) or protocols.UNSCHEDULED_ROUTES.get(path)


def identified_headers(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The request's headers by lower-case name, with ``X-Program-Id`` read as UTF-8 text (the
    server decodes header bytes as latin-1); InvalidRequest if it is not UTF-8."""
    headers = {name.lower(): value for name, value in items}
    header = headers.get("x-program-id")
    if header is not None:
        headers["x-program-id"] = header_text(header, "X-Program-Id")
    return headers


def _upstream_headers(items: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    headers = forward_headers(items, drop=_NOT_FORWARDED)
    # The taps read the bytes as they pass: a compressed stream would hide its usage.
    headers.append(("accept-encoding", "identity"))
    return headers


@contextmanager
def _best_effort(what: str) -> Iterator[None]:
    """Learning from an answer comes after the client has it and its step is recorded: a fault
    there is logged, never turned into a 500 or a stream cut before its final chunk."""
    try:
        yield
    except Exception:
        log.exception("program recognition could not learn from %s; it was relayed as sent", what)


@dataclass
class Reply:
    """An edge's answer, free of any web framework: the Quart route and the raw ASGI fast path
    (http/fastpath.py) each put it on the wire their own way."""

    status: int
    headers: list[tuple[str, str]]
    #: The whole answer, or the relayed stream (an async generator the sender must close).
    body: bytes | AsyncGenerator[bytes, None]


class Edges:
    """The scheduled routes and ``count_tokens``, over one gateway and one recognizer (one per
    client, with client keys: http/clients.py)."""

    def __init__(
        self, *, gateway: Gateway, recognizer: ProgramRecognizer, clients: Clients | None = None
    ) -> None:
        self.gateway = gateway
        self.recognizer = recognizer
        self.clients = clients or Clients(None, recognizer)

    async def call(self, protocol: Protocol, endpoint: str) -> Response:
        """One step of one program, in ``protocol``'s terms (Quart's route; the app serves
        these paths through http/fastpath.py, which calls :meth:`handle` itself)."""
        arrived_at = trio.current_time()
        raw = await request.get_data(False, False, False)
        scope: dict[str, Any] = request.scope  # type: ignore[assignment]
        items = list(request.headers.items())
        reply = await self.handle(protocol, endpoint, raw, items, scope, arrived_at)
        return Response(reply.body, status=reply.status, headers=Headers(reply.headers))

    async def handle(
        self,
        protocol: Protocol,
        endpoint: str,
        raw: bytes,
        items: list[tuple[str, str]],
        scope: dict[str, Any],
        arrived_at: float,
    ) -> Reply:
        """One step of one program from the request's body bytes and header items: checked,
        recognised and handed to the gateway. The exchange's close is added to ``scope``'s
        cleanups (``proxy.add_cleanup``), run however the HTTP exchange ends. The client, when
        keys are configured, was identified before (``clients.CLIENT_KEY`` in ``scope``)."""
        client = client_of(scope)
        recognizer = self.clients.recognizer(client)
        parsed = read_body(raw)
        body = parsed.value
        headers = identified_headers(items)
        check_identifiers(body)
        if recognizer.config.explicit:
            # A malformed program id is named as such, even in a body that has other faults.
            explicit_program_id(body, headers)
        # Then the body, before recognition reads its prompt: a malformed one starts nothing.
        prepared = protocols.prepare(protocol, without_program_id(body))
        recognised = recognizer.recognise(protocol, body, headers, arrived_at)
        # Whatever named the program (the body, a header, a client's session id), the id is
        # written to the db and sent upstream: it must be text.
        check_identifier(recognised.program_id, "program_id")
        wire = ProtocolWire(protocol, collect_answer=recognised.by_prompt)
        forwarded, client_key = self.clients.withheld(items)
        call = Call(
            program_id=scoped(client, recognised.program_id),
            endpoint=endpoint,
            body=prepared.body,
            wire=wire,
            arrived_at=arrived_at,
            model=prepared.model,
            stream=prepared.stream,
            headers=_upstream_headers(forwarded),
            context_chars=prepared.prompt_chars,
            hide_usage=prepared.hide_usage,
            source=recognised.source.value,
            matched_messages=recognised.matched,
            encode=parsed.encode,
            client=client,
            client_key=client_key,
        )
        scope[RECORDED_KEY] = True
        exchange = await self.gateway.open(call)
        add_cleanup(scope, exchange.aclose)
        answer_headers = forward_headers(exchange.headers, drop=RESPONSE_OWN)
        if exchange.is_event_stream:
            stream = self._stream(exchange, wire, recognizer, recognised, body)
            return Reply(200, answer_headers, stream)
        content = await exchange.read()
        if exchange.status_code == 200:
            with _best_effort("a whole answer"):
                self._learn_from_body(recognizer, protocol, recognised, body, content)
        return Reply(exchange.status_code, answer_headers, content)

    async def _stream(
        self,
        exchange: Exchange,
        wire: ProtocolWire,
        recognizer: ProgramRecognizer,
        recognised: Recognised,
        body: dict[str, Any],
    ) -> AsyncGenerator[bytes, None]:
        # Closed here when the client leaves, so the backend's stream is not left to the GC.
        async with aclosing(exchange.stream()) as chunks:  # type: ignore[type-var]
            async for chunk in chunks:
                yield chunk
        with _best_effort("a streamed answer"):
            self._learn_from_stream(exchange, wire, recognizer, recognised, body)

    def _learn_from_stream(
        self,
        exchange: Exchange,
        wire: ProtocolWire,
        recognizer: ProgramRecognizer,
        recognised: Recognised,
        body: dict[str, Any],
    ) -> None:
        tap = wire.last_tap
        # Only a whole answer is learnt from: a cut one would make a head no next call extends.
        if tap is None or tap.error is not None or exchange.outcome != 200:
            return
        now = trio.current_time()
        if recognised.by_prompt:
            answer = tap.answer()
            # An answer nested past what the request side accepts is not learnt from: hashing
            # it would recurse past Python's limit after the client had the whole stream.
            if not deeper_than(answer, MAX_NESTING):
                recognizer.observe_answer(recognised.program_id, wire.protocol, body, answer, now)
        recognizer.remember_response(tap.response_id, recognised.program_id, now)

    def _learn_from_body(
        self,
        recognizer: ProgramRecognizer,
        protocol: Protocol,
        recognised: Recognised,
        body: dict[str, Any],
        content: bytes,
    ) -> None:
        try:
            payload = json.loads(content)
        except (ValueError, RecursionError):
            return  # the gateway recorded why; nothing to learn
        if content.count(b"[") + content.count(b"{") > MAX_NESTING and deeper_than(
            payload, MAX_NESTING
        ):
            return  # relayed as it came; hashing it would recurse past Python's limit
        now = trio.current_time()
        if recognised.by_prompt:
            answer = protocols.answer_from_body(protocol, payload)
            recognizer.observe_answer(recognised.program_id, protocol, body, answer, now)
        if protocol is Protocol.RESPONSES:
            recognizer.remember_response(
                protocols.response_id_from_body(payload), recognised.program_id, now
            )

    async def count_tokens(self, endpoint: str) -> Response:
        """``POST /v1/messages/count_tokens``: checked as Anthropic's, then passed to the
        program's backend (the one whose tokenizer its calls use) or the first healthy one
        serving its model. Not an LLM call: nothing is scheduled or recorded as a step."""
        body = parse_json_object(await request.get_data(False, False, False))
        prepared = prepare_count_tokens(without_program_id(body))
        client = client_of(request.scope)
        recognised = self.clients.recognizer(client).recognise(
            Protocol.MESSAGES, body, request.headers, trio.current_time()
        )
        pool = self.gateway.pool
        route = pool.route(prepared.model)  # an unknown model is the gateway's own 404
        program = self.gateway.scheduler.registry.find(scoped(client, recognised.program_id))
        node = pool.get(program.backend) if program is not None else None
        if node is None or not node.healthy or node not in route.nodes:
            node = next((n for n in route.nodes if n.healthy), None)
        if node is None:
            raise NoBackendAvailable(
                f"No healthy backend serves {prepared.model!r} "
                f"({', '.join(n.url for n in route.nodes)}); check that they are running."
            )
        sent = prepared.body
        if route.served is not None and route.served != prepared.model:
            sent = {**sent, "model": route.served}
        forwarded, client_key = self.clients.withheld(request.headers.items())
        headers = self.gateway.upstream_headers(node, _upstream_headers(forwarded), client_key)
        upstream = UpstreamRequest("POST", endpoint, headers, json.dumps(sent).encode())
        return await self._send(node, upstream)

    async def _send(self, node: BackendNode, upstream: UpstreamRequest) -> Response:
        gateway = self.gateway
        response = await gateway.send(node, upstream)
        on_request_end(response.aclose)
        return Response(
            relay(response, gateway.read_timeout),
            status=response.status_code,
            headers=response_headers(response.headers),
        )
