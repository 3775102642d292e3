"""Client faults and overload: a client that leaves while queued, slow senders, and a queue
that would wait too long (429 with Retry-After)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import query, running_proxy, wait_for
from thunderproxy.sim import SimConfig, open_simulator

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BIG = "inspect every module of the repository and report " * 40  # 889 simulator tokens


def chat(program_id: str) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": BIG}],
        "program_id": program_id,
    }


# Room for one such program, not two.
TIGHT = SimConfig(
    kv_capacity_tokens=1536, enable_prompt_tokens_details=True, output_len_dist="fixed:4"
)
TR = {
    "router": "tr",
    "metrics_interval": 0.1,
    "monitor_interval": 0.05,
    "acting_half_life": 0.0,  # the finished hog keeps its claim: the newcomer must queue
    "return_evidence": False,  # ... though the hog never came back
    "pause_cooldown": 0.0,
    "resume_cooldown": 0.0,
}


async def test_a_client_leaving_the_queue_is_never_sent_and_frees_its_place(
    tmp_path: Path,
) -> None:
    db = tmp_path / "audit.db"
    async with (
        open_simulator(TIGHT) as sim,
        running_proxy(db, backends=sim.url, **TR) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        assert (await client.post("/v1/chat/completions", json=chat("hog"))).status_code == 200
        prompts_before = sim.engine.scheduler.stats.prompt_tokens
        with trio.move_on_after(0.5) as waited:
            await client.post("/v1/chat/completions", json=chat("queued"))
        assert waited.cancelled_caught
        registry = proxy.services.scheduler.registry
        queued = registry.get("queued")
        await wait_for(lambda: queued.waiting_since is None)
        assert queued.status.value == "paused"
        await client.post("/programs/release", json={"program_id": "hog"})
        # Resumed into the freed room (when it would have been sent), but the abandoned
        # request was not sent after all.
        await wait_for(lambda: queued.status.value != "paused")
        assert sim.engine.scheduler.stats.prompt_tokens == prompts_before
    steps = query(db, "select program_id, status, backend from steps order by id")
    assert steps == [
        {"program_id": "hog", "status": 200, "backend": sim.url},
        {"program_id": "queued", "status": 499, "backend": None},
    ]
    cancels = query(db, "select rule from decisions where action = 'cancel'")
    assert cancels == [{"rule": "client_disconnected"}]


async def test_overload_answers_429_with_retry_after(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    async with (
        open_simulator(TIGHT) as sim,
        running_proxy(db, backends=sim.url, max_queue_wait=5.0, max_wait=30, **TR) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        assert (await client.post("/v1/chat/completions", json=chat("hog"))).status_code == 200
        start = trio.current_time()
        r = await client.post("/v1/chat/completions", json=chat("late"))
        # Answered at once, not after waiting its 5 s (the margin is for a busy machine).
        assert trio.current_time() - start < 2.5
        assert r.status_code == 429
        assert r.headers["retry-after"] == "30"
        error = r.json()["error"]
        assert error["type"] == "rate_limit_error"
        assert "--max-queue-wait" in error["message"]
        assert "late" not in proxy.services.scheduler.registry
    assert query(db, "select program_id, status from rejections") == [
        {"program_id": "late", "status": 429}
    ]
    assert query(db, "select program_id, rule from decisions where action = 'reject'") == [
        {"program_id": "late", "rule": "capacity_full"}
    ]


async def _open(url: str) -> trio.SocketStream:
    host, port = url.removeprefix("http://").split(":")
    return await trio.open_tcp_stream(host, int(port))


async def _read_until_closed(stream: trio.SocketStream) -> bytes:
    data = b""
    while chunk := await stream.receive_some():
        data += chunk
    return data


async def test_a_slowloris_head_is_cut_off(tmp_path: Path) -> None:
    async with (
        open_simulator(TIGHT) as sim,
        running_proxy(tmp_path / "a.db", backends=sim.url, client_timeout=1.0) as proxy,
    ):
        stream = await _open(proxy.url)
        start = trio.current_time()
        async with stream:
            await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            with trio.fail_after(5):
                async with trio.open_nursery() as nursery:

                    async def dribble() -> None:
                        try:
                            for _ in range(100):
                                await stream.send_all(b"X")
                                await trio.sleep(0.2)
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            pass

                    nursery.start_soon(dribble)
                    await _read_until_closed(stream)
                    nursery.cancel_scope.cancel()
        assert trio.current_time() - start < 3.0


async def test_a_slow_body_gets_408(tmp_path: Path) -> None:
    async with (
        open_simulator(TIGHT) as sim,
        running_proxy(tmp_path / "a.db", backends=sim.url, client_timeout=1.0) as proxy,
    ):
        stream = await _open(proxy.url)
        async with stream:
            await stream.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
            )
            with trio.fail_after(5):
                answer = await stream.receive_some()
        assert answer.startswith(b"HTTP/1.1 408")
        assert sim.engine.scheduler.stats.prompt_tokens == 0


@pytest.mark.parametrize("front", ["fast", "hypercorn"])
@pytest.mark.parametrize(
    ("path", "declared"),
    [
        ("/v1/chat/completions", True),
        ("/v1/messages", True),
        ("/v1/responses", False),
        # Served by Quart: a passthrough path and the proxy's own endpoint.
        ("/v1/embeddings", True),
        ("/programs/release", False),
    ],
)
async def test_a_client_leaving_mid_body_leaves_a_rejection_row(
    tmp_path: Path, front: str, path: str, declared: bool
) -> None:
    """Before: no row at all. The body is half sent (with a Content-Length it never reaches,
    or chunked and never ended), then the connection closes."""
    db = tmp_path / "a.db"
    async with (
        open_simulator(TIGHT) as sim,
        running_proxy(db, backends=sim.url, http_front=front) as proxy,
    ):
        stream = await _open(proxy.url)
        async with stream:
            framing = b"Content-Length: 1000" if declared else b"Transfer-Encoding: chunked"
            half = b'{"model": "m", "messages": [' if declared else b'10\r\n{"model": "m", "me'
            await stream.send_all(
                b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\n" + framing + b"\r\n\r\n" + half
            )
        await wait_for(lambda: query(db, "SELECT * FROM rejections"), timeout=10)
        [row] = query(db, "SELECT * FROM rejections")
        assert row["path"] == path
        assert row["status"] == 499
        assert row["error_type"] == "client_closed_request"
        assert "closed the connection" in row["message"]
        if declared:
            assert "of the 1000 its Content-Length declared" in row["message"]
        assert query(db, "SELECT * FROM steps") == []
        assert sim.engine.scheduler.stats.prompt_tokens == 0
