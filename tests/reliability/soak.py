"""The load and soak harness: many concurrent agent programs through a proxy process against
the simulated vLLM, counting every answer, sampling the proxy's memory, and comparing the
audit log with what was served. Used by test_soak.py at two sizes."""

from __future__ import annotations

import random
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from tests.conftest import query, spawn_serving
from thunderproxy.sim import SimConfig, open_simulator

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
STEPS_PER_PROGRAM = 8


@dataclass
class SoakResult:
    served: int = 0
    programs_done: int = 0
    errors: dict[int | str, int] = field(default_factory=dict)
    rss_kib: list[int] = field(default_factory=list)
    audit_steps: int = 0
    exit_code: int | None = None

    @property
    def proxy_errors(self) -> int:
        return sum(self.errors.values())


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def _start(backend: str, db: Path) -> tuple[trio.Process, str]:
    argv = [sys.executable, "-m", "thunderproxy", "serve", "--port", "0", "--router", "tr"]
    argv += ["--backends", backend, "--db", str(db)]
    return await spawn_serving([*argv, "--metrics-interval", "1", "--max-connections", "2048"])


async def soak(
    tmp: Path, *, programs: int, seconds: float, seed: int = 0, report: bool = False
) -> SoakResult:
    """Keep ``programs`` agent programs running for ``seconds``; each does a few steps with
    tool gaps and is released, and a new one takes its place."""
    result = SoakResult()
    rng = random.Random(seed)
    db = tmp / "soak.db"
    sim_config = SimConfig(
        enable_prompt_tokens_details=True, output_len_dist="fixed:16", time_scale=0.05
    )
    async with open_simulator(sim_config) as sim:
        process, url = await _start(sim.url, db)
        limits = httpx.Limits(max_connections=programs + 16, max_keepalive_connections=programs)
        try:
            # Longer than --max-wait: under tr a call may wait that long for KV capacity.
            async with httpx.AsyncClient(base_url=url, timeout=400, limits=limits) as client:
                stop_at = trio.current_time() + seconds

                async def program(slot: int) -> None:
                    generation = 0
                    while trio.current_time() < stop_at:
                        pid = f"soak-{slot}-{generation}"
                        history = f"task {pid}: " + "fix the bug in module " * rng.randint(20, 80)
                        for step in range(STEPS_PER_PROGRAM):
                            body = {
                                "model": MODEL,
                                "messages": [{"role": "user", "content": history}],
                                "program_id": pid,
                                "stream": step % 2 == 0,
                            }
                            try:
                                r = await client.post("/v1/chat/completions", json=body)
                                outcome: int | str = r.status_code
                            except httpx.HTTPError as exc:
                                outcome = type(exc).__name__  # e.g. a reset connection
                            if outcome == 200:
                                result.served += 1
                            else:
                                result.errors[outcome] = result.errors.get(outcome, 0) + 1
                            history += " observation line" * rng.randint(5, 30)
                            await trio.sleep(rng.uniform(0.2, 2.0))  # the tool runs
                            if trio.current_time() >= stop_at:
                                break
                        await client.post("/programs/release", json={"program_id": pid})
                        result.programs_done += 1
                        generation += 1

                async def sample_memory() -> None:
                    while True:
                        result.rss_kib.append(rss_kib(process.pid))
                        if report:
                            print(
                                f"t={len(result.rss_kib) * 5:>4}s served={result.served} "
                                f"errors={result.errors} rss={result.rss_kib[-1]} KiB",
                                flush=True,
                            )
                        await trio.sleep(5)

                async def drain_log() -> None:
                    # A full stderr pipe would block the proxy's logging, and the proxy with it.
                    assert process.stderr is not None
                    while await process.stderr.receive_some():
                        pass

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(sample_memory)
                    nursery.start_soon(drain_log)
                    async with trio.open_nursery() as load:
                        for slot in range(programs):
                            load.start_soon(program, slot)
                            await trio.sleep(0.005)  # ramp up over a few seconds
                    nursery.cancel_scope.cancel()
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(60):
                result.exit_code = await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
    result.audit_steps = query(db, "select count(*) as n from steps where status = 200")[0]["n"]
    return result
