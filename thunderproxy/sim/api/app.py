"""The HTTP face of the simulator: a small raw-ASGI app over an Engine.

Kept thin on purpose: validation and wire shapes live in protocol.py / responses.py, the
behaviour in sim/engine/. What is here is routing, streaming, disconnects and faults.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from ..config import SimConfig
from ..engine.core import Engine, EngineDeadError, QueueFullError, RequestHandle
from . import exposition
from .anthropic import anthropic_routes
from .asgi import (
    BUSY,
    ENGINE_DEAD,
    SSE,
    Disconnected,
    Handler,
    Pacer,
    Receive,
    Request,
    Scope,
    Send,
    collect,
    lifespan,
    respond,
    respond_json,
)
from .chat_tools import serve_chat_with_tools
from .control import dev_mode_routes, sim_routes
from .council import council_script
from .errors import APIError, error_body, validation_error
from .protocol import GenerateRequest, parse_generate
from .responses import ResponseBuilder, dumps, models_body
from .responses_api import responses_routes
from .sglang import sglang_routes
from .tools import chat_tools, template_messages


def program_of(request_id: str | None, cache_salt: str | None) -> str | None:
    """The proxy sends X-Request-Id: <program>-<step>; the program is the part before."""
    if request_id:
        head, sep, _ = request_id.rpartition("-")
        return head if sep and head else request_id
    return cache_salt or None


class SimApp:
    """ASGI application; `stopping` makes parked requests (hang faults) give up."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stopping = trio.Event()
        self.in_flight = 0
        self._idle = trio.Event()
        cfg = engine.config
        self._faults = random.Random(f"fault:{cfg.seed}")
        self._ids = random.Random(f"response-ids:{cfg.seed}")
        digest = hashlib.blake2b(repr(dataclasses.astuple(cfg)).encode(), digest_size=4)
        self.fingerprint = f"vllm-{cfg.version()}-{digest.hexdigest()}"
        routes: dict[str, dict[str, Handler]] = {
            "/v1/models": {"GET": self._models},
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/completions": {"POST": self._completions},
            "/tokenize": {"POST": self._tokenize},
            "/detokenize": {"POST": self._detokenize},
            "/metrics": {"GET": self._metrics},
            **sim_routes(self),
        }
        if cfg.personality == "sglang":
            routes.update(sglang_routes(self))
        else:
            routes.update(
                {
                    "/health": {"GET": self._health},
                    "/ping": {"GET": self._ping, "POST": self._ping},
                    "/version": {"GET": self._version},
                    "/load": {"GET": self._load},
                    **anthropic_routes(self),
                    **responses_routes(self),
                }
            )
            if cfg.dev_mode:
                routes.update(dev_mode_routes(self))
        self.routes = routes

    async def wait_idle(self) -> None:
        """Return once no generation request is in flight."""
        while self.in_flight:
            self._idle = trio.Event()
            await self._idle.wait()

    @property
    def config(self) -> SimConfig:
        return self.engine.config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request = Request(scope, receive, send, headers)
        methods = self.routes.get(scope["path"])
        if methods is None and scope["path"].startswith("/v1/responses/"):
            methods = self.routes.get("/v1/responses/{id}")  # the one route with a path id
        if methods is None:
            await respond_json(send, 404, {"detail": "Not Found"})
            return
        handler = methods.get(scope["method"])
        if handler is None:
            await respond_json(send, 405, {"detail": "Method Not Allowed"})
            return
        key = self.config.api_key
        if (
            key
            and scope["path"].startswith("/v1")
            and headers.get("authorization") != f"Bearer {key}"
        ):
            await respond_json(send, 401, {"error": "Unauthorized"})
            return
        try:
            await handler(request)
        except APIError as error:
            await self.send_error(send, error)
        except Disconnected:
            pass

    async def send_error(self, send: Send, error: APIError, extra: list[Any] | None = None) -> None:
        await respond_json(send, error.status, error_body(error, self.config), extra)

    # --- vLLM basics -------------------------------------------------------------------
    async def _health(self, request: Request) -> None:
        await respond(request.send, 503 if self.engine.dead else 200, b"")

    async def _ping(self, request: Request) -> None:
        await self._health(request)

    async def _version(self, request: Request) -> None:
        await respond_json(request.send, 200, {"version": self.config.version()})

    async def _load(self, request: Request) -> None:
        await respond_json(request.send, 200, {"server_load": self.in_flight})

    async def _models(self, request: Request) -> None:
        created = int(self.engine.unix_time())
        await respond_json(request.send, 200, models_body(self.config, created, "thunderproxy-sim"))

    async def _metrics(self, request: Request) -> None:
        text = exposition.render(self.engine).encode()
        ctype = exposition.content_type(self.engine).encode()
        await respond(request.send, 200, text, [(b"content-type", ctype)])

    async def _tokenize(self, request: Request) -> None:
        body = await request.json()
        tok = self.engine.tokenizer
        if isinstance(body, dict) and isinstance(body.get("messages"), list):
            add = body.get("add_generation_prompt", True) is not False
            messages = template_messages(body["messages"], chat_tools(body))
            ids = tok.encode_chat(messages, add_generation_prompt=add)
        elif isinstance(body, dict) and isinstance(body.get("prompt"), str):
            ids = tok.encode(body["prompt"])
        else:
            raise validation_error("missing", "body.prompt", "Field required", body)
        strs = [tok.piece(i) for i in ids] if body.get("return_token_strs") else None
        result = {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids,
                  "token_strs": strs}  # fmt: skip
        await respond_json(request.send, 200, result)

    async def _detokenize(self, request: Request) -> None:
        body = await request.json()
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise validation_error(
                "list_type", "body.tokens", "Input should be a valid list", tokens
            )
        text = self.engine.tokenizer.decode(tokens, skip_special_tokens=False)
        await respond_json(request.send, 200, {"prompt": text})

    # --- generation --------------------------------------------------------------------
    async def _chat(self, request: Request) -> None:
        await self._generate(request, chat=True)

    async def _completions(self, request: Request) -> None:
        await self._generate(request, chat=False)

    def _pick_fault(self, headers: dict[str, str]) -> str | None:
        forced = headers.get("x-sim-fault")
        if forced:
            return forced
        cfg = self.config
        if cfg.fail_rate > 0 and self._faults.random() < cfg.fail_rate:
            return self._faults.choice(cfg.fault_types())
        return None

    async def _generate(self, request: Request, *, chat: bool) -> None:
        body = await request.json()
        if (
            chat
            and isinstance(body, dict)
            and (body.get("tools") is not None or body.get("tool_choice") not in (None, "none"))
        ):
            await serve_chat_with_tools(self, request, body)
            return
        parsed = parse_generate(
            body, chat=chat, config=self.config, tokenizer=self.engine.tokenizer
        )
        extra = self.id_headers(request)

        async def respond(handle: RequestHandle, rid: str, fault: str | None) -> None:
            builder = ResponseBuilder(
                self.config,
                chat=chat,
                response_id=("chatcmpl-" if chat else "cmpl-") + rid,
                created=int(self.engine.unix_time()),
                fingerprint=self.fingerprint,
                block_size=self.engine.block_size,
            )
            if parsed.stream:
                await self._stream(request, parsed, handle, builder, fault, extra)
            else:
                await self._complete(request, parsed, handle, builder, fault, extra)

        # The council's ranking, chairman and title prompts get answers in their shape.
        script = council_script(body, self.config.seed, self.engine.tokenizer) if chat else None
        await self.execute(request, parsed, respond, script=script)

    def id_headers(self, request: Request) -> list[tuple[bytes, bytes]]:
        """`X-Request-Id` echoed back when the server is told to (vLLM's flag)."""
        header_id = request.headers.get("x-request-id")
        if header_id and self.config.enable_request_id_headers:
            return [(b"x-request-id", header_id.encode())]
        return []

    async def execute(
        self,
        request: Request,
        parsed: GenerateRequest,
        respond: Callable[[RequestHandle, str, str | None], Awaitable[None]],
        *,
        script: Sequence[tuple[int, str]] | None = None,
    ) -> None:
        """Run one generation: faults, submission, disconnect watching and abort.

        `respond(handle, response id, fault)` writes the answer in the route's own format;
        every generating route (chat, completions, messages, responses) goes through here.
        """
        engine = self.engine
        header_id = request.headers.get("x-request-id")
        fault = self._pick_fault(request.headers)
        if fault == "hang":
            await self.stopping.wait()
            fault = "500"
        elif fault == "slow":
            await trio.sleep(self.config.slow_seconds * self.config.time_scale)
        if engine.dead or fault == "500":
            raise APIError(500, ENGINE_DEAD, "InternalServerError")
        if fault == "503":
            raise APIError(503, BUSY, "ServiceUnavailableError")
        output_tokens = request.headers.get("x-sim-output-tokens")
        request_id = header_id or parsed.request_id
        try:
            handle = engine.submit(
                parsed.prompt_ids,
                max_tokens=parsed.max_tokens,
                request_id=request_id,
                program=program_of(request_id, parsed.cache_salt),
                cache_salt=parsed.cache_salt,
                output_tokens=int(output_tokens) if output_tokens else None,
                ignore_eos=parsed.ignore_eos,
                min_tokens=parsed.min_tokens,
                priority=parsed.priority,
                script=script,
            )
        except EngineDeadError:
            raise APIError(500, ENGINE_DEAD, "InternalServerError") from None
        except QueueFullError:
            raise APIError(503, BUSY, "ServiceUnavailableError") from None
        rid = request_id or format(self._ids.getrandbits(64), "016x")
        self.in_flight += 1
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_disconnect, request.receive, nursery.cancel_scope)
                await respond(handle, rid, fault)
                nursery.cancel_scope.cancel()
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()
            if not handle.finished:
                engine.abort(handle.request_id)  # client disconnect = abort, as in vLLM

    async def _complete(
        self,
        request: Request,
        parsed: GenerateRequest,
        handle: RequestHandle,
        builder: ResponseBuilder,
        fault: str | None,
        extra: list[Any],
    ) -> None:
        answer = await collect(self.engine, handle, fault)
        if answer is None:
            await self.send_error(request.send, APIError(500, ENGINE_DEAD, "InternalServerError"))
            return
        text, last = answer
        assert last.finish_reason is not None
        usage = builder.usage(last.num_prompt_tokens, last.num_output_tokens,
                              last.num_cached_tokens, stream=False)  # fmt: skip
        body = builder.full_response(text, last.finish_reason, usage)
        await respond_json(request.send, 200, body, extra)

    async def _stream(
        self,
        request: Request,
        parsed: GenerateRequest,
        handle: RequestHandle,
        builder: ResponseBuilder,
        fault: str | None,
        extra: list[Any],
    ) -> None:
        send = request.send
        # Headers go out at once; the first data arrives only with the first token.
        await send({"type": "http.response.start", "status": 200, "headers": SSE + extra})
        want_usage = parsed.include_usage or self.config.enable_force_include_usage
        fail_at = max(1, parsed.max_tokens // 2) if fault == "stream" else None
        pacer = Pacer(handle, self.config.flush_interval())
        role_sent = not parsed.chat
        done = False
        while not done:
            batch = await pacer.next()
            if not batch:
                break
            parts = []
            for out in batch:
                if out.finish_reason == "error" or (fail_at and out.num_output_tokens >= fail_at):
                    self.engine.abort(handle.request_id)
                    error = APIError(500, ENGINE_DEAD, "InternalServerError")
                    parts.append(dumps(error_body(error, self.config)))
                    done = True
                    break
                if not role_sent:
                    parts.append(builder.role_chunk())
                    role_sent = True
                final = out.finish_reason
                usage = None
                if parsed.continuous_usage and want_usage:
                    usage = builder.usage(out.num_prompt_tokens, out.num_output_tokens, 0,
                                          stream=True)  # fmt: skip
                    usage.pop("prompt_tokens_details", None)
                # The fingerprint rides on the last chunk unless a usage chunk follows it.
                last = final is not None and not want_usage
                parts.append(
                    builder.token_chunk(out.text, final, usage=usage, with_fingerprint=last)
                )
                if final is not None:
                    if want_usage:
                        usage = builder.usage(out.num_prompt_tokens, out.num_output_tokens,
                                              out.num_cached_tokens, stream=True)  # fmt: skip
                        parts.append(builder.usage_chunk(usage))
                    done = True
                    break
            if done:
                parts.append("[DONE]")
            payload = "".join(f"data: {p}\n\n" for p in parts).encode()
            await send({"type": "http.response.body", "body": payload, "more_body": True})
            pacer.flushed()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def watch_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    """Cancel the response as soon as the client goes away (vLLM aborts the request)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
