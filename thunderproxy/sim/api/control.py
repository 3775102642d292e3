"""Routes beyond inference: vLLM's dev-mode cache/sleep endpoints and the simulator-only
/_sim/* hooks (truth, trace, reset, kill, revive, runtime config)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..config import SimConfig
from ..engine import truth
from .errors import APIError, validation_error

if TYPE_CHECKING:
    from .asgi import Face, Handler, Request

# Fields of SimConfig that shape the pool, scheduler or tokenizer: changing one rebuilds
# the engine (and forgets its cache); the others apply to the next step or request.
STRUCTURAL = {
    "block_size", "num_gpu_blocks", "kv_capacity_tokens", "max_model_len", "vocab_size",
    "chars_per_token", "enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens",
    "long_prefill_token_threshold", "scheduling_policy", "profile", "personality",
    # The CPU tier is built with the engine; its transfer costs are fixed then too.
    "kv_offloading_size", "kv_offloading_tokens", "kv_bytes_per_token",
    "kv_offload_bandwidth_gbps", "kv_offload_latency_us",
}  # fmt: skip


def dev_mode_routes(app: Face) -> dict[str, dict[str, Handler]]:
    from .asgi import respond, respond_json

    engine = app.engine

    async def reset_prefix_cache(request: Request) -> None:
        await respond_json(request.send, 200, {"success": engine.pool.reset_prefix_cache()})

    async def sleep(request: Request) -> None:
        engine.set_sleeping(True)
        engine.pool.reset_prefix_cache()
        await respond(request.send, 200, b"")

    async def wake_up(request: Request) -> None:
        engine.set_sleeping(False)
        await respond(request.send, 200, b"")

    async def is_sleeping(request: Request) -> None:
        await respond_json(request.send, 200, {"is_sleeping": engine.sleeping})

    return {
        "/reset_prefix_cache": {"POST": reset_prefix_cache},
        "/sleep": {"POST": sleep},
        "/wake_up": {"POST": wake_up},
        "/is_sleeping": {"GET": is_sleeping},
    }


def sim_routes(app: Face) -> dict[str, dict[str, Handler]]:
    from .asgi import respond_json

    engine = app.engine
    ok = {"success": True}

    async def state(request: Request) -> None:
        await respond_json(request.send, 200, truth.state(engine))

    async def trace(request: Request) -> None:
        last = request.query.get("last")
        records = truth.trace(engine, int(last[0]) if last else None)
        await respond_json(request.send, 200, {"steps": records})

    async def reset(request: Request) -> None:
        engine.reset()
        await respond_json(request.send, 200, ok)

    async def kill(request: Request) -> None:
        engine.kill()
        await respond_json(request.send, 200, ok)

    async def revive(request: Request) -> None:
        engine.revive()
        await respond_json(request.send, 200, ok)

    async def config(request: Request) -> None:
        if request.scope["method"] == "POST":
            apply_config(app, await request.json())
        await respond_json(request.send, 200, dataclasses.asdict(engine.config))

    return {
        "/_sim/state": {"GET": state},
        "/_sim/trace": {"GET": trace},
        "/_sim/reset": {"POST": reset},
        "/_sim/kill": {"POST": kill},
        "/_sim/revive": {"POST": revive},
        "/_sim/config": {"GET": config, "POST": config},
    }


def apply_config(app: Face, changes: object) -> None:
    if not isinstance(changes, dict):
        raise validation_error("dict_type", "body", "Input should be a valid dictionary", changes)
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(SimConfig)})
    if unknown:
        raise APIError(400, f"unknown config fields: {unknown}", "BadRequestError", "body")
    try:
        new = app.engine.config.replace(**changes)
    except (TypeError, ValueError) as exc:
        raise APIError(400, str(exc), "BadRequestError", "body") from None
    if STRUCTURAL & set(changes):
        app.engine.reset(new)
    else:
        app.engine.config = new
        app.engine.profile = new.timing
