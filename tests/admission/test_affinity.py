"""Program -> backend affinity through a real redis-server: a program placed by one instance
keeps its backend (and the prefix cached there) when its next call reaches another instance.
Without Redis the other instance places it by load, on the other backend."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import coredis
import httpx
import trio

from tests.admission.conftest import RedisServer
from tests.admission.test_shared import drain, killed_at_exit
from tests.conftest import query, spawn_serving
from thunderproxy.sim import SimConfig, open_simulator

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


async def serve(tmp_path: Path, name: str, backends: str, redis: str | None) -> tuple[Any, str]:
    argv = [sys.executable, "-m", "thunderproxy", "serve", "--port", "0", "--backends", backends]
    argv += ["--db", str(tmp_path / f"{name}.db"), "--no-datasette", "--router", "default"]
    if redis is not None:
        argv += ["--redis", redis, "--redis-heartbeat", "0.1"]
    return await spawn_serving(argv)


def chat(program_id: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello " * 50}],
        "max_tokens": 4,
        "program_id": program_id,
    }


async def second_backend(tmp_path: Path, redis: str | None) -> tuple[str, str, str, str]:
    """Program ``p`` runs its first call on instance A, on A's second backend (a filler holds
    the first); its second call goes to instance B. Its backend on A, on B, and the two."""
    await trio.Path(tmp_path).mkdir()
    sim_config = SimConfig(time_scale=0.02)
    async with (
        open_simulator(sim_config) as first,
        open_simulator(sim_config) as second,
        killed_at_exit() as procs,
        trio.open_nursery() as logs,
    ):
        backends = f"{first.url},{second.url}"
        for name in ("a", "b"):
            process, url = await serve(tmp_path, name, backends, redis)
            procs.append((process, url))
            logs.start_soon(drain, process, tmp_path / f"{name}.log")
        (_, a), (_, b) = procs
        async with httpx.AsyncClient(timeout=30) as client:
            for program, url in (("filler", a), ("p", a)):
                r = await client.post(f"{url}/v1/chat/completions", json=chat(program))
                assert r.status_code == 200, r.text
            if redis is not None:
                # The placement is written off the call's path: wait until B can read it.
                async with coredis.Redis.from_url(redis, decode_responses=True) as r_client:
                    with trio.fail_after(5):
                        while await r_client.get("thunderproxy:kv:affinity:p") is None:
                            await trio.sleep(0.02)
            r = await client.post(f"{b}/v1/chat/completions", json=chat("p"))
            assert r.status_code == 200, r.text
        for process, _ in procs:
            process.terminate()
        # Both have exited (their audit logs are flushed) before the logs' nursery closes.
    sql = "select backend from steps where program_id = 'p'"
    on_a = query(tmp_path / "a.db", sql)[0]["backend"]
    on_b = query(tmp_path / "b.db", sql)[0]["backend"]
    return on_a, on_b, first.url, second.url


async def test_another_instance_keeps_a_program_on_its_backend(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    on_a, on_b, _, second = await second_backend(tmp_path / "shared", redis_server.url)
    assert on_a == on_b == second
    # The same without Redis: B knows nothing of p and places it by load (its first backend).
    on_a, on_b, first, second = await second_backend(tmp_path / "apart", None)
    assert (on_a, on_b) == (second, first)
