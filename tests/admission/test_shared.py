"""Three ``thunderproxy serve`` processes share one model's limits through a real redis-server:
the global count holds across instances, a killed instance's share goes to the others within one
heartbeat, and Redis leaving and coming back under a continuous load fails no call that is not a
429."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.admission.conftest import RedisServer
from tests.conftest import query, spawn_serving
from thunderproxy.sim import SimConfig, open_simulator

BIG = "qwen-32b"
HEARTBEAT = 0.25


def config(tmp_path: Path, rpm: int | None = None, tpm: int | None = None) -> Path:
    path = tmp_path / "limits.toml"
    limits = "".join(f"{k} = {v}\n" for k, v in (("rpm", rpm), ("tpm", tpm)) if v is not None)
    path.write_text(
        f"""
[limits.models.{BIG}]
{limits}
[limits.classes.default]
ratio = 1.0
max_wait = 0
"""
    )
    return path


async def serve(tmp_path: Path, name: str, cfg: Path, redis: str, backend: str) -> tuple[Any, str]:
    argv = [sys.executable, "-m", "thunderproxy", "serve", "--config", str(cfg), "--port", "0"]
    argv += ["--redis", redis, "--redis-heartbeat", str(HEARTBEAT), "--backends", backend]
    argv += ["--db", str(tmp_path / f"{name}.db"), "--no-datasette", "--router", "default"]
    argv += ["--metrics-interval", "60"]
    return await spawn_serving(argv)


def chat(program: str) -> dict[str, Any]:
    return {
        "model": BIG,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "program_id": program,
    }


@asynccontextmanager
async def killed_at_exit() -> AsyncIterator[list[tuple[Any, str]]]:
    """The serve processes a test starts: whatever happens, none outlives it."""
    procs: list[tuple[Any, str]] = []
    try:
        yield procs
    finally:
        for process, _ in procs:
            if process.returncode is None:
                process.kill()
        with trio.CancelScope(shield=True):
            for process, _ in procs:
                await process.wait()


async def drain(process: Any, log: Path) -> None:
    """Keep a child's log (it never blocks on a full pipe, and a failure can be read)."""
    with log.open("ab") as out:
        while chunk := await process.stderr.receive_some():
            out.write(chunk)


async def start_instances(
    n: int,
    tmp_path: Path,
    cfg: Path,
    redis: str,
    backend: str,
    procs: list[tuple[Any, str]],
    nursery: trio.Nursery,
) -> list[str]:
    """Start ``n`` serve processes (``i0``, ``i1``, ...) into ``procs``, their logs drained by
    ``nursery``; their URLs."""
    for i in range(n):
        process, url = await serve(tmp_path, f"i{i}", cfg, redis, backend)
        nursery.start_soon(drain, process, tmp_path / f"i{i}.log")
        procs.append((process, url))
    return [url for _, url in procs]


async def stop_instances(procs: list[tuple[Any, str]], within_s: float) -> None:
    """Ask every serve process to stop (each drains as it would in production) and wait."""
    for process, _ in procs:
        process.terminate()
    with trio.fail_after(within_s):
        for process, _ in procs:
            await process.wait()


async def test_three_instances_share_one_limit(tmp_path: Path, redis_server: RedisServer) -> None:
    # Every step below happens inside one wall-clock minute (the limiter's window).
    into_minute = time.time() % 60
    if into_minute > 30:
        await trio.sleep(60.5 - into_minute)
    started = time.time()
    cfg = config(tmp_path, rpm=30)
    async with (
        open_simulator(SimConfig(served_model_name=BIG, time_scale=0.02)) as sim,
        httpx.AsyncClient(timeout=30) as client,
        killed_at_exit() as procs,
        trio.open_nursery() as nursery,
    ):
        urls = await start_instances(3, tmp_path, cfg, redis_server.url, sim.url, procs, nursery)

        async def health(url: str) -> dict[str, Any]:
            answer: dict[str, Any] = (await client.get(url + "/health")).json()["admission"]
            return answer

        async def shares_are(n: int, among: list[str]) -> bool:
            for url in among:
                if (await health(url))["redis"]["instances"] != n:
                    return False
            return True

        with trio.fail_after(10):
            while not await shares_are(3, urls):
                await trio.sleep(HEARTBEAT)
        # 30 a minute among three: ten each, locally, whatever the others do.
        statuses: dict[str, list[int]] = {url: [] for url in urls}
        for url in urls:
            for k in range(12):
                r = await client.post(url + "/v1/chat/completions", json=chat(f"{url}-{k}"))
                statuses[url].append(r.status_code)
        assert [s.count(200) for s in statuses.values()] == [10, 10, 10]
        assert [s.count(429) for s in statuses.values()] == [2, 2, 2]

        # One instance dies; the survivors see it gone and take its share...
        victim, _ = procs.pop()
        killed_at = time.monotonic()
        victim.kill()
        await victim.wait()
        survivors = urls[:2]
        with trio.fail_after(10):
            while not await shares_are(2, survivors):
                await trio.sleep(0.01)
        # When each survivor counted it out, by its own clock (not when this loop saw it).
        counted = []
        for url in survivors:
            redis = (await health(url))["redis"]
            counted.append(time.monotonic() - redis["counted_s_ago"] - killed_at)
        redistributed_s = max(counted)
        # Within one heartbeat of the kill, and a second one's allowance: each survivor is a
        # process of its own whose beat comes late when the machine is busy (the suite on two
        # loaded cores measured 0.354 s, one beat and 0.104 s, where the allowance was an
        # eighth of a beat; without a redistribution it would be never, and the wait above
        # fails at 10 s).
        assert redistributed_s <= HEARTBEAT * 2, counted
        # ...but the minute's 30 are spent globally: Redis refuses what the local shares allow.
        answers = [
            await client.post(url + "/v1/chat/completions", json=chat(f"late-{i}"))
            for i, url in enumerate(survivors)
        ]
        assert [a.status_code for a in answers] == [429, 429], [a.text for a in answers]
        refusal = await client.post(survivors[0] + "/v1/chat/completions", json=chat("why"))
        assert "rpm: 30 used of 30" in refusal.json()["error"]["message"]
        assert time.time() - started < 60, "the test left its minute; its counts mean nothing"

        # Redis goes away: the instances keep serving on their local share, and say so.
        redis_server.kill()
        with trio.fail_after(10):
            while (await health(survivors[0]))["redis"]["reachable"]:
                await trio.sleep(0.05)
        away = await client.post(survivors[0] + "/v1/chat/completions", json=chat("away"))
        assert away.status_code in (200, 429)
        redis_server.start()
        with trio.fail_after(10):
            while not (await health(survivors[0]))["redis"]["reachable"]:
                await trio.sleep(0.05)
        await stop_instances(procs, within_s=20)
        nursery.cancel_scope.cancel()
    print(json.dumps({"redistributed_s": round(redistributed_s, 3)}))


#: The saturating load's limits: 300 calls, or 3000 tokens (about 210 of these 14-token calls),
#: a minute.
SATURATED = {"rpm": 300, "tpm": 3000}


@pytest.mark.slow
@pytest.mark.parametrize("instances", [1, 3])
@pytest.mark.parametrize("dimension", ["rpm", "tpm"])
async def test_saturated_instances_stay_within_the_limit_and_use_it(
    tmp_path: Path, redis_server: RedisServer, instances: int, dimension: str
) -> None:
    """A load generator offers far more than the limit (rpm = 300, or tpm = 3000) through every
    instance for a little over a minute; in the one wall-clock minute it covers whole, what was
    admitted over all instances (calls, or the tokens the backend reported for them) is at most
    2% above the limit and at least 90% of it."""
    limit = SATURATED[dimension]
    cfg = config(tmp_path, **{dimension: limit})
    # Start the instances some seconds before a minute begins, so that minute is covered whole.
    await trio.sleep((48 - time.time() % 60) % 60)
    async with (
        open_simulator(SimConfig(served_model_name=BIG, time_scale=0.02)) as sim,
        httpx.AsyncClient(timeout=30) as client,
        killed_at_exit() as procs,
        trio.open_nursery() as nursery,
    ):
        await start_instances(instances, tmp_path, cfg, redis_server.url, sim.url, procs, nursery)
        failures: list[int] = []
        refused_at: list[float] = []
        # Until just past the end of the first minute that starts after the load does.
        stop_at = trio.current_time() + (math.ceil(time.time() / 60) * 60 + 62 - time.time())

        async def worker(url: str, n: int) -> None:
            k = 0
            while trio.current_time() < stop_at:
                r = await client.post(url + "/v1/chat/completions", json=chat(f"{url}-{n}-{k}"))
                if r.status_code not in (200, 429):
                    failures.append(r.status_code)
                if r.status_code == 429:
                    refused_at.append(time.time())
                k += 1
                await trio.sleep(0.05)  # the generator's pace: ~20 attempts/s per worker

        async with trio.open_nursery() as load:
            for _, url in procs:
                for n in range(4):
                    load.start_soon(worker, url, n)
        await stop_instances(procs, within_s=30)
        nursery.cancel_scope.cancel()
    assert failures == []
    # Calls: admissions by the minute they were admitted in. Tokens: what the backend reported
    # for the calls that arrived in each minute (the window their reservation was counted in).
    sql = {
        "rpm": "select cast(at / 60 as integer) as m, count(*) as n from decisions "
        "where action = 'admit' and rule like 'admission.%' group by m",
        "tpm": "select cast(arrived_at / 60 as integer) as m, "
        "sum(prompt_tokens + completion_tokens) as n from steps where status = 200 group by m",
    }[dimension]
    per_minute: dict[int, int] = {}
    for i in range(instances):
        for row in query(tmp_path / f"i{i}.db", sql):
            per_minute[row["m"]] = per_minute.get(row["m"], 0) + row["n"]
    whole = sorted(per_minute)[1:-1]  # the first and last minutes are partly covered
    assert whole, per_minute
    for minute in whole:
        used = per_minute[minute]
        seen = {"instances": instances, "dimension": dimension, "minute": minute, "used": used}
        print(json.dumps({**seen, "limit": limit, "of_limit_pct": round(100 * used / limit, 1)}))
        assert used <= limit * 1.02
        assert used >= limit * 0.9
        # The load saturated the limit: calls were refused in that minute.
        assert any(math.floor(t / 60) == minute for t in refused_at)


async def test_redis_restarted_under_continuous_load(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A load generator keeps calling two instances while Redis is killed and, a little later,
    started again: every call is answered 200 or 429, calls are still served while Redis is away,
    and both instances say they rejoined in /health and count each other again."""
    cfg = config(tmp_path, rpm=100_000)
    async with (
        open_simulator(SimConfig(served_model_name=BIG, time_scale=0.02)) as sim,
        httpx.AsyncClient(timeout=30) as client,
        killed_at_exit() as procs,
        trio.open_nursery() as nursery,
    ):
        urls = await start_instances(2, tmp_path, cfg, redis_server.url, sim.url, procs, nursery)

        async def redis_of(url: str) -> dict[str, Any]:
            answer: dict[str, Any] = (await client.get(url + "/health")).json()["admission"]
            return dict(answer["redis"])

        async def joined() -> bool:
            for url in urls:
                seen = await redis_of(url)
                if not seen["reachable"] or seen["instances"] != 2:
                    return False
            return True

        with trio.fail_after(10):
            while not await joined():
                await trio.sleep(0.05)
        # (phase, status) of every call the generator made.
        calls: list[tuple[str, int]] = []
        phase = "before"
        stop = trio.Event()

        async def worker(url: str, n: int) -> None:
            k = 0
            while not stop.is_set():
                r = await client.post(url + "/v1/chat/completions", json=chat(f"{url}-{n}-{k}"))
                calls.append((phase, r.status_code))
                k += 1
                await trio.sleep(0.02)

        async with trio.open_nursery() as load:
            for url in urls:
                for n in range(3):
                    load.start_soon(worker, url, n)
            await trio.sleep(1.0)
            phase = "away"
            redis_server.kill()
            with trio.fail_after(10):
                while any([(await redis_of(url))["reachable"] for url in urls]):
                    await trio.sleep(0.05)
            await trio.sleep(1.0)
            phase = "back"
            redis_server.start()
            with trio.fail_after(10):
                while not await joined():
                    await trio.sleep(0.05)
            phase = "after"
            await trio.sleep(1.0)
            stop.set()
        for url in urls:
            seen = await redis_of(url)
            assert seen["reachable"], seen
            assert seen["away_since_s"] is None, seen
        await stop_instances(procs, within_s=20)
        nursery.cancel_scope.cancel()
    failed = [(p, s) for p, s in calls if s not in (200, 429)]
    phases = ("before", "away", "after")
    served = {p: sum(1 for q, s in calls if q == p and s == 200) for p in phases}
    print(json.dumps({"calls": len(calls), "failed": len(failed), "served": served}))
    assert failed == []
    assert all(served.values()), served
