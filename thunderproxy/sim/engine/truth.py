"""Simulator-only ground truth for /_sim/state and /_sim/trace.

None of this exists on a real vLLM; tests and benchmarks read it to check what the proxy
cannot see (which program's prefix is still resident, what got evicted or recomputed).
"""

from __future__ import annotations

from itertools import groupby, islice
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core import Engine


def state(engine: Engine, *, free_queue_sample: int = 16) -> dict[str, Any]:
    pool = engine.pool
    sched = engine.scheduler
    stats = sched.stats
    rec = engine.recorder
    usable = pool.num_blocks - 1
    queue = list(pool.free_queue)
    # Runs of consecutive free blocks by owning program, head (evicted next) first.
    runs = [
        {"program": program, "blocks": len(list(group))}
        for program, group in groupby(
            b.program if b.block_hash is not None else None for b in queue
        )
    ]
    programs: dict[str, dict[str, int]] = {}
    for name, table in (
        ("resident_blocks", pool.resident_by_program),
        ("evicted_blocks", pool.evictions_by_program),
        ("preemptions", stats.preemptions_by_program),
        ("recomputed_tokens", stats.recomputed_by_program),
    ):
        for program, value in table.items():
            programs.setdefault(program, {})[name] = value
    return {
        "time": engine.now(),
        "dead": engine.dead,
        "sleeping": engine.sleeping,
        "blocks": {
            "total": pool.num_blocks,
            "block_size": engine.block_size,
            "used": usable - pool.num_free,
            "free": pool.num_free,
            "cached_free": pool.num_cached_free,
            "free_uncached": pool.num_free - pool.num_cached_free,
            "cached_hashes": len(pool.cached),
        },
        "free_queue": {
            "head": [_block(b) for b in islice(queue, free_queue_sample)],
            "tail": [_block(b) for b in queue[-free_queue_sample:]],
            "runs": runs[:200],
        },
        "running": [r.request_id for r in sched.running],
        "waiting": [r.request_id for r in sched.waiting],
        "requests": request_states(engine),
        "preemptions": [{"time": t, "request_id": rid} for t, rid in sched.preemption_log],
        "programs": programs,
        "counters": {
            "evictions": pool.evictions,
            "preemptions": stats.preemptions,
            "prefix_queries": stats.prefix_queries,
            "prefix_hits": stats.prefix_hits,
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generation_tokens,
            "recomputed_prefill_tokens": stats.recomputed_prefill_tokens,
            "steps": stats.steps,
            # The CPU tier (0 without one): tokens first schedules got from it, blocks moved.
            "cpu_hit_tokens": stats.external_hits,
            "cpu_loads": 0 if engine.cpu is None else engine.cpu.loaded,
            "cpu_stores": 0 if engine.cpu is None else engine.cpu.stored,
            "cpu_evictions": 0 if engine.cpu is None else engine.cpu.evicted,
        },
        "cpu_tier": cpu_tier(engine),
        "clock": {
            "time_scale": engine.config.time_scale,
            "busy_sim_seconds": rec.busy_sim_seconds,
            "busy_wall_seconds": rec.busy_wall_seconds,
            "busy_nominal_wall_seconds": rec.busy_nominal_wall_seconds,
            "lag_seconds": rec.lag_seconds,
            "max_lag_seconds": rec.max_lag_seconds,
        },
    }


def cpu_tier(engine: Engine) -> dict[str, Any] | None:
    """The CPU KV tier's counters, in blocks; None without a tier."""
    cpu = engine.cpu
    if cpu is None:
        return None
    return {
        "num_blocks": cpu.num_blocks,
        "used": len(cpu),
        "loading_requests": len(engine.scheduler.loading),
        # hits: blocks first schedules got from the tier; loads also count reloads after
        # a preemption.
        "hits": engine.scheduler.stats.external_hits // engine.block_size,
        "loads": cpu.loaded,
        "load_transfers": cpu.load_requests,
        "stores": cpu.stored,
        "store_skipped": cpu.store_skipped,
        "evictions": cpu.evicted,
        "bytes_loaded": cpu.bytes["CPU_to_GPU"],
        "bytes_stored": cpu.bytes["GPU_to_CPU"],
    }


def request_states(engine: Engine) -> list[dict[str, Any]]:
    out = []
    sched = engine.scheduler
    for status, reqs in (("running", sched.running), ("waiting", list(sched.waiting))):
        for r in reqs:
            out.append(
                {
                    "request_id": r.request_id,
                    "program": r.program,
                    "status": "preempted" if r.num_preemptions and status == "waiting" else status,
                    "num_prompt_tokens": r.num_prompt_tokens,
                    "num_tokens": r.num_tokens,
                    "num_computed_tokens": r.num_computed_tokens,
                    "num_blocks": len(r.blocks),
                    "num_preemptions": r.num_preemptions,
                }
            )
    return out


def _block(block: Any) -> dict[str, Any]:
    return {"id": block.block_id, "program": block.program, "cached": block.block_hash is not None}


def trace(engine: Engine, last: int | None = None) -> list[dict[str, Any]]:
    records = list(engine.trace)
    if last is not None:
        records = records[-last:] if last > 0 else []
    out = []
    for start, dt, n, batch, preempted, running, waiting in records:
        out.append(
            {
                "start": start,
                "t_step": dt,
                "num_tokens": n,
                "batch": [
                    {"request_id": rid, "num_new": num_new, "start": pos, "decode": decode}
                    for rid, num_new, pos, decode in batch
                ],
                "preempted": preempted,
                "num_running": running,
                "num_waiting": waiting,
            }
        )
    return out
