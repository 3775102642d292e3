"""KV claims made atomically in a real redis-server (``SharedBackends.claim``, CLAIM_KV): two
instances claiming the same backend at once never claim more than its target between them; a
killed ``serve`` process's claims leave every sum within one heartbeat, and a released
program's as soon as the next beat; a refused claim holds the call as a full backend would;
with Redis away calls are served on the local view and /health says so."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.admission.conftest import RedisServer, free_port
from tests.admission.test_shared import drain, killed_at_exit
from tests.conftest import query, spawn_serving
from thunderproxy.admission.shared_kv import SharedBackends
from thunderproxy.sim import SimConfig, open_simulator

BACKEND = "http://gpu0:8000"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@asynccontextmanager
async def instance(
    redis: str, name: str, mine: Callable[[], dict[str, int]], heartbeat_s: float = 1.0
) -> AsyncIterator[SharedBackends]:
    """One instance's side of the shared KV, publishing ``mine()`` until the block ends."""
    shared = SharedBackends(redis, name, heartbeat_s=heartbeat_s)
    async with trio.open_nursery() as nursery:
        # Unix time, as every serve process beats with: liveness compares the instances' beats.
        await nursery.start(shared.serve, time.time() - trio.current_time(), mine)
        yield shared
        nursery.cancel_scope.cancel()


class Claimant:
    """What the scheduler does around a claim, reduced to one backend: the call is counted in
    this instance's claims before the claim is sent (so its own concurrent claims see it), and
    taken out again when Redis refuses it."""

    def __init__(self) -> None:
        self.counted = 0
        self.granted: list[int] = []
        self.shared: SharedBackends | None = None

    def mine(self) -> dict[str, int]:
        return {BACKEND: self.counted}

    async def call(self, tokens: int, whole: int) -> None:
        assert self.shared is not None
        self.counted += tokens
        if await self.shared.claim(BACKEND, self.counted, whole):
            self.granted.append(tokens)
        else:
            self.counted -= tokens


async def test_two_instances_claiming_at_once_never_pass_the_target(
    redis_server: RedisServer,
) -> None:
    whole = 10_000
    a, b = Claimant(), Claimant()
    async with (
        instance(redis_server.url, "a", a.mine) as a.shared,
        instance(redis_server.url, "b", b.mine) as b.shared,
    ):
        # Bursts from both at once, calls of uneven size, several rounds: the sum granted
        # never passes the target, and the room is used (refusals come only near the top).
        sizes = [300 + 37 * (i % 11) for i in range(60)]
        async with trio.open_nursery() as nursery:
            for i, tokens in enumerate(sizes):
                nursery.start_soon((a if i % 2 else b).call, tokens, whole)
        total = sum(a.granted) + sum(b.granted)
        assert total <= whole, (a.granted, b.granted)
        assert total > whole - max(sizes) * 8, (total, a.granted, b.granted)
        refused = a.shared.refused + b.shared.refused
        assert a.shared.granted + b.shared.granted == len(a.granted) + len(b.granted)
        assert refused == len(sizes) - len(a.granted) - len(b.granted) > 0
        # Each reads what the other claims (refused calls taken out again).
        await b.shared.publish(b.mine())
        await a.shared.publish(a.mine())
        assert a.shared.others(BACKEND) == b.counted

        # One at a time, the test is exact: the last room goes to whoever asks first.
        a.counted = b.counted = 0
        await a.shared.publish(a.mine())
        await b.shared.publish(b.mine())
        for _ in range(6):
            await a.call(1000, 9500)
        assert a.counted == 6000
        for _ in range(4):
            await b.call(1000, 9500)
        assert b.counted == 3000
        assert b.shared.others(BACKEND) == 6000  # the refusal brought the others' claims


async def test_without_the_atomic_claim_the_same_burst_overfills(
    redis_server: RedisServer,
) -> None:
    """The check the claim replaces, on the same burst: each instance tests the others' claims
    as last published, then publishes its own; both pass the target (what the scale-out load
    met as a preemption)."""
    whole = 10_000
    a, b = Claimant(), Claimant()
    async with (
        instance(redis_server.url, "a", a.mine) as a.shared,
        instance(redis_server.url, "b", b.mine) as b.shared,
    ):

        async def call(c: Claimant, tokens: int) -> None:
            assert c.shared is not None
            await c.shared.publish(c.mine())  # read the others' claims
            if c.counted + tokens + c.shared.others(BACKEND) <= whole:
                c.counted += tokens
                c.granted.append(tokens)
                await c.shared.publish(c.mine())

        async with trio.open_nursery() as nursery:
            for i in range(60):
                nursery.start_soon(call, a if i % 2 else b, 300)
        assert sum(a.granted) + sum(b.granted) > whole


async def serve_tr(
    tmp_path: Path, name: str, backend: str, redis: str, heartbeat: float
) -> tuple[Any, str]:
    argv = [sys.executable, "-m", "thunderproxy", "serve", "--port", "0", "--backends", backend]
    argv += ["--db", str(tmp_path / f"{name}.db"), "--no-datasette", "--router", "tr"]
    # No decay: an acting program claims its tokens whole until it ends, so what Redis holds
    # changes only when the program is released or the instance dies.
    argv += ["--acting-half-life", "0", "--metrics-interval", "0.2"]
    argv += ["--redis", redis, "--redis-heartbeat", str(heartbeat)]
    return await spawn_serving(argv)


def chat(program_id: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{program_id}: " + "fix the test " * 60}],
        "max_tokens": 8,
        "program_id": program_id,
    }


async def test_a_killed_instance_claims_nothing_within_a_heartbeat(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    heartbeat = 0.5
    async with (
        open_simulator(SimConfig(time_scale=0.02)) as sim,
        killed_at_exit() as procs,
        trio.open_nursery() as logs,
        instance(redis_server.url, "observer", dict, heartbeat_s=heartbeat) as observer,
    ):
        process, url = await serve_tr(tmp_path, "w", sim.url, redis_server.url, heartbeat)
        procs.append((process, url))
        logs.start_soon(drain, process, tmp_path / "w.log")
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for program in ("p1", "p2"):
                r = await client.post("/v1/chat/completions", json=chat(program))
                assert r.status_code == 200, r.text
            with trio.fail_after(5):
                while (both := observer.others(sim.url)) == 0:
                    await trio.sleep(0.02)
            # A released program's claim goes with the next beat.
            r = await client.post("/programs/release", json={"program_id": "p1"})
            assert r.status_code == 200, r.text
            with trio.fail_after(heartbeat):
                while not 0 < observer.others(sim.url) < both:
                    await trio.sleep(0.01)
            health = (await client.get("/health")).json()["shared_kv"]
            assert health["reachable"] is True
            assert health["claims"]["granted"] == 2, health
        process.kill()
        killed_at = trio.current_time()
        with trio.fail_after(5):
            while observer.others(sim.url):
                await trio.sleep(0.01)
        # Counted out once its last beat is LIVE (7/8) heartbeats old; the observer reads a
        # beat (1/8) later at most.
        assert trio.current_time() - killed_at <= heartbeat + 0.2


async def test_redis_away_calls_are_served_unchecked_and_health_says_so(
    tmp_path: Path,
) -> None:
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    async with (
        open_simulator(SimConfig(time_scale=0.02)) as sim,
        killed_at_exit() as procs,
        trio.open_nursery() as logs,
    ):
        process, url = await serve_tr(tmp_path, "alone", sim.url, nowhere, 0.2)
        procs.append((process, url))
        logs.start_soon(drain, process, tmp_path / "alone.log")
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for program in ("p1", "p2", "p3"):
                r = await client.post("/v1/chat/completions", json=chat(program))
                assert r.status_code == 200, r.text
            health = (await client.get("/health")).json()
        process.terminate()
        shared = health["shared_kv"]
        assert shared["reachable"] is False
        assert shared["away_since_s"] is not None
        assert shared["last_error"]
        assert {k: shared["claims"][k] for k in ("granted", "refused", "unchecked")} == {
            "granted": 0,
            "refused": 0,
            "unchecked": 3,
        }
        assert health["status"] == "ok"


async def test_a_refused_claim_holds_the_call_as_a_full_backend_would(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Instance B's own view says its program's first call fits (it last read the others'
    claims before instance A claimed most of the backend); the claim in Redis says no, and B
    queues the call as on a full backend, until its bound forces it out."""
    kv_tokens, max_wait = 4096, 3.0
    whole = int(kv_tokens * 0.9)  # --target-fill's default

    async def start(name: str, heartbeat: float) -> str:
        argv = [sys.executable, "-m", "thunderproxy", "serve", "--port", "0"]
        argv += ["--backends", sim.url, "--db", str(tmp_path / f"{name}.db"), "--no-datasette"]
        argv += ["--router", "tr", "--acting-half-life", "0", "--max-wait", str(max_wait)]
        argv += ["--metrics-interval", "0.2", "--redis", redis_server.url]
        argv += ["--redis-heartbeat", str(heartbeat)]
        process, url = await spawn_serving(argv)
        procs.append((process, url))
        logs.start_soon(drain, process, tmp_path / f"{name}.log")
        return url

    def call(program: str, chars: int) -> dict[str, Any]:
        # Distinct from the first character: no prefix shared between programs.
        text = (program + " " + "abcdefgh " * (chars // 9))[:chars]
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 8,
            "program_id": program,
        }

    async with (
        open_simulator(SimConfig(time_scale=0.02, kv_capacity_tokens=kv_tokens)) as sim,
        killed_at_exit() as procs,
        trio.open_nursery() as logs,
        instance(redis_server.url, "observer", dict, heartbeat_s=0.2) as observer,
    ):
        # B first, beating every 30 s: what it knows of the others' claims is from its start.
        b_url = await start("b", 240.0)
        a_url = await start("a", 0.2)
        async with httpx.AsyncClient(timeout=30) as client:
            for program in ("a1", "a2"):
                r = await client.post(f"{a_url}/v1/chat/completions", json=call(program, 4000))
                assert r.status_code == 200, r.text
            # A's claims once both calls have ended (two reads a few beats apart agree).
            claimed, seen = 0, -1
            with trio.fail_after(5):
                while not claimed or claimed != seen:
                    seen = claimed
                    await trio.sleep(0.3)
                    claimed = observer.others(sim.url)
            # Sized (4 characters a token until measured) to fit alone but not beside A's.
            tokens = whole - claimed - 256 + 200
            assert 0 < tokens + 256 <= whole, claimed
            started = trio.current_time()
            r = await client.post(f"{b_url}/v1/chat/completions", json=call("b1", 4 * tokens))
            assert r.status_code == 200, r.text
            waited = trio.current_time() - started
            health = (await client.get(f"{b_url}/health")).json()["shared_kv"]
        for process, _ in procs:
            process.terminate()
    assert health["claims"]["refused"] == 1, health
    assert waited >= max_wait - 0.5
    rows = query(tmp_path / "b.db", "select action, rule, detail from decisions order by id")
    assert [(row["action"], row["rule"]) for row in rows] == [
        ("admit", "fits"),
        ("queue", "claim_refused"),
        ("force_resume", "max_wait"),
    ]
    assert json.loads(rows[1]["detail"])["others_tokens"] == claimed
