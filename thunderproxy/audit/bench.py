"""Audit writer benchmark: how fast rows reach SQLite, and what ``record()`` costs a request.

    python -m thunderproxy.audit.bench [--rows 200000] [--producers 32] [--db PATH]

Producers call ``AuditLog.record`` as request handlers do (never awaiting it), yielding to the
scheduler between records like handlers that do real work; the writer batches into SQLite.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from functools import partial

import trio
import trio.lowlevel

from ..steps import ProgramStatus, Transition
from .records import StepRecord, TransitionRecord
from .writer import serve_audit_writer


def step_record(i: int, now: float) -> StepRecord:
    return StepRecord(
        request_id=f"p{i % 1000}-{i}",
        program_id=f"p{i % 1000}",
        step=i,
        backend="http://127.0.0.1:8000",
        endpoint="/v1/chat/completions",
        model="bench",
        stream=True,
        arrived_at=now,
        sent_at=now,
        first_token_at=now + 0.05,
        finished_at=now + 1.0,
        tool_s=0.5,
        prompt_tokens=20_000,
        completion_tokens=150,
        cached_tokens=19_000,
        status=200,
    )


async def bench(rows: int, producers: int, db: str) -> dict[str, float]:
    costs_ns: list[int] = []
    async with trio.open_nursery() as nursery:
        audit = await nursery.start(
            partial(serve_audit_writer, db, run_info={"router": "bench"}, queue_size=rows + 1)
        )
        start = time.perf_counter()

        async def produce(offset: int) -> None:
            now = trio.current_time()
            for i in range(offset, rows, producers):
                record = (
                    step_record(i, now)
                    if i % 3
                    else TransitionRecord(
                        Transition(
                            f"p{i % 1000}",
                            ProgramStatus.REASONING,
                            ProgramStatus.ACTING,
                            "response complete",
                            "http://127.0.0.1:8000",
                            i,
                            now,
                        )
                    )
                )
                t0 = time.perf_counter_ns()
                audit.record(record)
                costs_ns.append(time.perf_counter_ns() - t0)
                if i % 64 == offset % 64:
                    await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as producers_nursery:
            for p in range(producers):
                producers_nursery.start_soon(produce, p)
        enqueued = time.perf_counter() - start
        await audit.aclose()
    elapsed = time.perf_counter() - start
    costs_ns.sort()
    return {
        "rows": rows,
        "written": audit.written,
        "dropped": audit.dropped,
        "batches": audit.batches,
        "enqueue_wall_s": enqueued,
        "total_s": elapsed,
        "rows_per_s": audit.written / elapsed,
        "record_cost_p50_us": costs_ns[len(costs_ns) // 2] / 1000,
        "record_cost_p99_us": costs_ns[int(len(costs_ns) * 0.99)] / 1000,
        "record_cost_mean_us": statistics.fmean(costs_ns) / 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--producers", type=int, default=32)
    parser.add_argument("--db", default=None, help="SQLite file (default: a temporary file)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or os.path.join(tmp, "bench.db")
        result = trio.run(bench, args.rows, args.producers, db)
    for key, value in result.items():
        print(f"{key:>20}: {value:,.3f}" if isinstance(value, float) else f"{key:>20}: {value:,}")


if __name__ == "__main__":
    main()
