"""Routes of the SGLang personality: its health, server_info and cache-flush endpoints.

The engine underneath stays vLLM's block model; SGLang's token-granular radix tree is
approximated by blocks of `block_size` (set it to 1 for page_size=1), see SIMULATOR.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .asgi import Face, Handler, Request

SGLANG_VERSION = "0.5.23"
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)
NOT_FLUSHED = "Cache not flushed: there are running or waiting requests.\n"


def sglang_routes(app: Face) -> dict[str, dict[str, Handler]]:
    from .asgi import respond, respond_json

    engine = app.engine

    async def health(request: Request) -> None:
        await respond(request.send, 503 if engine.dead else 200, b"")

    async def server_info(request: Request) -> None:
        await respond_json(request.send, 200, server_info_body(app))

    async def model_info(request: Request) -> None:
        body = {
            "model_path": engine.config.served_model_name,
            "tokenizer_path": engine.config.served_model_name,
            "is_generation": True,
        }
        await respond_json(request.send, 200, body)

    async def flush_cache(request: Request) -> None:
        idle = not engine.scheduler.has_work()
        ok = idle and engine.pool.reset_prefix_cache()
        body = (FLUSHED if ok else NOT_FLUSHED).encode()
        await respond(request.send, 200 if ok else 400, body, [(b"content-type", b"text/plain")])

    both: dict[str, Handler] = {"GET": health, "POST": health}
    return {
        "/health": both,
        "/health_generate": both,
        "/ready": both,
        "/server_info": {"GET": server_info},
        "/get_server_info": {"GET": server_info},
        "/model_info": {"GET": model_info},
        "/get_model_info": {"GET": model_info},
        "/flush_cache": {"GET": flush_cache, "POST": flush_cache},
    }


def server_info_body(app: Face) -> dict[str, Any]:
    engine = app.engine
    cfg = engine.config
    pool = engine.pool
    bs = engine.block_size
    total = (pool.num_blocks - 1) * bs
    return {
        "model_path": cfg.served_model_name,
        "served_model_name": cfg.served_model_name,
        "page_size": bs,
        "context_length": cfg.max_model_len,
        "max_total_num_tokens": total,
        "max_req_input_len": cfg.max_model_len - 1,
        "max_running_requests": cfg.max_num_seqs,
        "chunked_prefill_size": cfg.max_num_batched_tokens,
        "schedule_policy": "lpm" if cfg.scheduling_policy == "fcfs" else "priority",
        "disable_radix_cache": not cfg.enable_prefix_caching,
        "enable_cache_report": cfg.cache_report(),
        "enable_metrics": True,
        "radix_eviction_policy": "lru",
        "internal_states": [
            {
                "memory_usage": {
                    "token_capacity": total,
                    "kv_used_tokens": (pool.num_blocks - 1 - pool.num_free) * bs,
                },
                "last_gen_throughput": 0.0,
                "effective_max_running_requests_per_dp": cfg.max_num_seqs,
            }
        ],
        "version": SGLANG_VERSION,
    }
