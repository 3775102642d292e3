"""What an operator reads when Redis goes away under load and comes back: one line when it is
lost and one when it is back, from one ``thunderproxy serve`` process at the default log level,
with no line from the Redis client's own retries (it retried dozens of times a second), and
nothing about scripts at start-up."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
import trio

from tests.admission.conftest import RedisServer
from tests.admission.test_shared import chat, config, drain, killed_at_exit, serve, stop_instances
from thunderproxy.admission.shared import RedisLink
from thunderproxy.sim import SimConfig, open_simulator

BIG = "qwen-32b"


async def test_a_redis_outage_is_two_lines_not_a_flood(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    cfg = config(tmp_path, rpm=100_000)
    log = tmp_path / "i0.log"
    async with (
        open_simulator(SimConfig(served_model_name=BIG, time_scale=0.02)) as sim,
        httpx.AsyncClient(timeout=30) as client,
        killed_at_exit() as procs,
        trio.open_nursery() as nursery,
    ):
        process, url = await serve(tmp_path, "i0", cfg, redis_server.url, sim.url)
        procs.append((process, url))
        nursery.start_soon(drain, process, log)

        async def reachable() -> bool:
            answer = (await client.get(url + "/health")).json()["admission"]["redis"]
            return bool(answer["reachable"])

        async def until(want: bool) -> None:
            with trio.fail_after(10):
                while await reachable() != want:
                    await trio.sleep(0.05)

        await until(True)
        statuses: list[int] = []
        stop = trio.Event()

        async def caller(n: int) -> None:
            k = 0
            while not stop.is_set():
                answer = await client.post(url + "/v1/chat/completions", json=chat(f"p{n}-{k}"))
                statuses.append(answer.status_code)
                k += 1
                await trio.sleep(0.02)

        async with trio.open_nursery() as load:
            for n in range(3):
                load.start_soon(caller, n)
            await trio.sleep(0.5)
            redis_server.kill()
            await until(False)
            await trio.sleep(2.0)  # calls and heartbeats keep failing meanwhile
            redis_server.start()
            await until(True)
            await trio.sleep(0.5)
            stop.set()
        await stop_instances(procs, within_s=20)
        nursery.cancel_scope.cancel()
    lines = log.read_text().splitlines()
    assert set(statuses) <= {200, 429}
    # Nothing from the client itself: no retries, no scripts, no tracebacks.
    assert not [line for line in lines if "coredis" in line or "Traceback" in line]
    # The start-up line came before "listening on" (read by spawn_serving): the outage's two.
    redis = [line for line in lines if "Redis" in line]
    url = redis_server.url
    assert len(redis) == 2, redis
    lost, back = redis
    assert f"WARNING thunderproxy.admission.redis: Redis at {url} is unreachable (" in lost
    assert lost.endswith(
        "until it returns: tr checks no KV claim with the other instances; limits on a local "
        "share of 1/1 of every limit"
    )
    assert f"INFO thunderproxy.admission.redis: Redis at {url} is reachable again after " in back
    assert back.endswith("s; KV claims and limits shared with the other instances again")


async def test_the_link_logs_once_for_every_part_and_back_when_the_last_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="thunderproxy.admission.redis")
    link = RedisLink("redis://user:secret@redis.example:6379/0")
    link.join("limits", lambda: "limits on a local share")
    link.join("kv", lambda: "no KV claims checked")
    link.answered("limits")
    link.answered("kv")
    link.lost("kv", trio.TooSlowError())
    link.lost("limits", ConnectionError("refused"))
    link.lost("kv", ConnectionError("refused"))
    link.answered("kv")  # the limits still fail: not back yet
    link.answered("limits")
    link.answered("kv")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "Redis at redis://redis.example:6379/0 reachable; limits and KV claims shared with the "
        "other instances",
        "Redis at redis://redis.example:6379/0 is unreachable (TooSlowError); until it returns: "
        "limits on a local share; no KV claims checked",
        "Redis at redis://redis.example:6379/0 is reachable again after 0.0 s; limits and KV "
        "claims shared with the other instances again",
    ]
