"""The ``llm`` blueprint: the APIs a client calls, each a backend's (refused until the backends
are ready, a configured client's with ``[clients]``: http/checks.py). The streamed ``POST``
routes are served by the fast path in front of Quart (http/fastpath.py) whenever it takes them;
these are the same routes through Quart."""

from __future__ import annotations

from typing import Any

import trio
from quart import Blueprint, Response, jsonify

from ...protocols import Protocol
from ..edges import Edges
from ..services import Services


def create_blueprint(services: Services, edges: Edges) -> Blueprint:
    bp = Blueprint("llm", __name__)

    @bp.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await edges.call(Protocol.CHAT, "/v1/chat/completions")

    @bp.post("/v1/completions")
    async def completions() -> Response:
        return await edges.call(Protocol.COMPLETIONS, "/v1/completions")

    @bp.post("/v1/messages")
    async def messages() -> Response:
        return await edges.call(Protocol.MESSAGES, "/v1/messages")

    @bp.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        return await edges.count_tokens("/v1/messages/count_tokens")

    @bp.post("/v1/responses")
    async def responses() -> Response:
        return await edges.call(Protocol.RESPONSES, "/v1/responses")

    @bp.get("/v1/models")
    async def list_models() -> Response:
        """The union of what the healthy backends serve (their own entries), and the aliases
        that reach them."""
        cards: dict[str, Any] = {}
        for node in services.pool.healthy():
            for name, card in node.model_cards.items():
                cards.setdefault(name, card)
        created = int(services.clock.unix(trio.current_time()))
        for name in services.pool.served_models():
            if name not in cards:
                targets = services.pool.aliases.get(name, ())
                cards[name] = {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "thunderproxy",
                    "root": targets[0] if targets else name,
                }
        return jsonify({"object": "list", "data": list(cards.values())})

    return bp
