"""Admission cost per call: ``admit`` + ``done`` through AdmissionService, alone and with limits
shared through Redis (pass a redis:// URL). Prints µs per call and Redis round trips per call.

    python scripts/admission_cost.py [redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import sys
import time

import trio

from thunderproxy.admission.service import AdmissionService
from thunderproxy.admission.shared import SharedLimits
from thunderproxy.audit import AuditLog
from thunderproxy.audit.records import AuditRecord
from thunderproxy.backends import BackendPool
from thunderproxy.config.limits import LimitsSpec, ModelLimits
from thunderproxy.gateway import Call
from thunderproxy.http.sse import OPENAI
from thunderproxy.programs import StepUsage

CALLS = 5000


async def measure(url: str | None) -> None:
    send, receive = trio.open_memory_channel[AuditRecord](CALLS * 4)
    pool = BackendPool()
    pool.add("http://gpu0:8000", models=["m"])
    spec = LimitsSpec({"m": ModelLimits(rpm=10**9, tpm=10**12, concurrent=10**6)})
    shared = None if url is None else SharedLimits(url, "bench", heartbeat_s=1.0)
    service = AdmissionService(
        spec, pool=pool, audit=AuditLog(send, 1), instance="bench", shared=shared
    )
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "x" * 400}]}

    async def run() -> None:
        started = time.perf_counter()
        for i in range(CALLS):
            call = Call(f"p{i % 100}", "/v1/chat/completions", body, OPENAI, 0.0, "m")
            ticket = await service.admit(call, trio.current_time())
            service.done(ticket, StepUsage(120, 60), 200, trio.current_time())
            while True:  # the audit writer's side: drop the rows
                try:
                    receive.receive_nowait()
                except trio.WouldBlock:
                    break
        elapsed = time.perf_counter() - started
        trips = 0 if shared is None else shared.round_trips
        print(
            f"{'redis' if url else 'local'}: {elapsed / CALLS * 1e6:.0f} us per call, "
            f"{trips / CALLS:.2f} Redis round trips per call"
        )

    if shared is None:
        await run()
        return
    async with trio.open_nursery() as nursery:
        await nursery.start(shared.serve, 0.0, service.limiter.set_share)
        await run()
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(measure, sys.argv[1] if len(sys.argv) > 1 else None)
