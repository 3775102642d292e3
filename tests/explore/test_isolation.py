"""Datasette cannot take the relay's time: its pages are rendered in a process of its own, which
is supervised (restarted when it dies, shown in /health), never outlives the proxy, and whose
queries all stop near the time limit, runaway single SQLite instructions included."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import running_proxy, spawn_serving
from tests.fakebackend import FakeBackend
from thunderproxy.explore import instance

#: Page size of the load: 1,000 rows (max_returned_rows) of 100 URL-valued columns (the column
#: limit). Datasette renders such a page, 13 MB of HTML, in one synchronous stretch of 1 to 8 s
#: depending on the machine; on the relay's loop that stretch stalled everything.
HEAVY_SQL = (
    "with recursive r(i) as (select 1 union all select i + 1 from r limit 1000) select "
    + ", ".join(f"'https://example.com/item/' || i || '/{c}' as c{c}" for c in range(100))
    + " from r"
)
#: Concurrent heavy pages: enough for several renders back to back, few enough to stay quick.
PAGES = 3
#: The bound on /health's latency and on the gap between two chunks of a live stream. A
#: stream's chunks come every 20 ms; a single heavy page rendered on the loop exceeds it.
BOUND_S = 0.5
#: On a machine busy with other work the proxy's own steps stretch too, with no page on its
#: loop; the bound then grows to this share of the quickest page's time, which a page rendered
#: on the loop (a stall as long as the page itself) still exceeds by four times.
SHARE_OF_A_PAGE = 0.25
#: The issue's query: one LIKE instruction that ran 87 s past a 5 s limit.
PATHOLOGICAL_LIKE = (
    "select printf('%.*c', 1000000, 'a') like '%' || printf('%.*c', 20000, 'a') || 'b'"
)
#: instr() of a 1 MB value and a 500 kB needle that never matches: one instruction of 2.5e11
#: byte comparisons (tens of seconds), with no pattern limit to refuse it.
RUNAWAY_INSTR = "select instr(printf('%.*c', 1000000, 'a'), printf('%.*c', 500000, 'a') || 'b')"


async def explorer_status(client: httpx.AsyncClient) -> dict[str, object]:
    status: dict[str, object] = (await client.get("/health")).json()["explorer"]
    return status


async def test_heavy_pages_take_no_time_from_health_or_a_live_stream(
    backend: FakeBackend, tmp_path: Path
) -> None:
    async with (
        running_proxy(tmp_path / "audit.db", backends=backend.url, metrics_interval=3600) as p,
        httpx.AsyncClient(base_url=p.url, timeout=120) as client,
    ):
        # Started on the first request, before the measurement.
        assert (await client.get("/datasette/audit", params={"sql": "select 1"})).is_success
        health_s: list[float] = []
        gaps: list[float] = []
        sizes: list[int] = []
        page_s: list[float] = []
        done = trio.Event()

        async def poll_health() -> None:
            while not done.is_set():
                started = trio.current_time()
                assert (await client.get("/health")).status_code == 200
                health_s.append(trio.current_time() - started)
                await trio.sleep(0.02)

        async def stream(task_status: trio.TaskStatus[None]) -> None:
            body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
            headers = {"x-fake-words": "100000", "x-fake-delay": "0.02"}
            body |= {"stream": True, "program_id": "live"}
            async with client.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as response:
                assert response.status_code == 200
                chunks = response.aiter_raw()
                await anext(chunks)
                last = trio.current_time()
                task_status.started()
                async for _ in chunks:
                    now = trio.current_time()
                    gaps.append(now - last)
                    last = now
                    if done.is_set():
                        return

        async def page() -> None:
            started = trio.current_time()
            async with client.stream("GET", "/datasette/audit", params={"sql": HEAVY_SQL}) as r:
                assert r.status_code == 200
                size = 0
                async for chunk in r.aiter_raw():
                    size += len(chunk)
                sizes.append(size)
            page_s.append(trio.current_time() - started)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll_health)
            await nursery.start(stream)
            async with trio.open_nursery() as pages:
                for _ in range(PAGES):
                    pages.start_soon(page)
            done.set()
    # Every page came whole: 100,000 links each.
    assert len(sizes) == PAGES
    assert min(sizes) > 10_000_000
    assert len(gaps) > 10
    bound = max(BOUND_S, SHARE_OF_A_PAGE * min(page_s))
    assert max(health_s) <= bound, f"/health took up to {max(health_s):.2f} s of {bound:.2f} s"
    assert max(gaps) <= bound, f"the stream went {max(gaps):.2f} s without a chunk ({bound:.2f} s)"


async def test_runaway_queries_stop_near_the_time_limit(
    backend: FakeBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit_s = 1.0
    monkeypatch.setitem(instance.SETTINGS, "sql_time_limit_ms", int(limit_s * 1000))
    async with (
        running_proxy(tmp_path / "audit.db", backends=backend.url, metrics_interval=3600) as p,
        httpx.AsyncClient(base_url=p.url, timeout=120) as client,
    ):
        assert (await client.get("/datasette/audit", params={"sql": "select 1"})).is_success
        # The LIKE: its pattern is over the limit, refused before it runs.
        started = trio.current_time()
        like = await client.get("/datasette/audit.json", params={"sql": PATHOLOGICAL_LIKE})
        assert trio.current_time() - started < limit_s
        assert like.status_code == 400
        assert "LIKE or GLOB pattern too complex" in like.json()["error"]
        # A recursive query runs many instructions: the progress handler ends it.
        started = trio.current_time()
        spin = (
            "with recursive r(i) as (select 1 union all select i + 1 from r) select max(i) from r"
        )
        spun = await client.get("/datasette/audit.json", params={"sql": spin})
        assert limit_s * 0.9 < trio.current_time() - started < limit_s + 2.0
        assert spun.status_code == 400
        assert "too long" in spun.json()["error"]
        # One instruction of tens of seconds: the explorer's process ends it by ending, at
        # the limit plus HARD_GRACE_S (1 s), and the supervisor starts a new one.
        started = trio.current_time()
        runaway = await client.get("/datasette/audit.json", params={"sql": RUNAWAY_INSTR})
        assert trio.current_time() - started < limit_s + 3.0
        assert runaway.status_code == 502
        assert "explorer" in runaway.json()["error"]["message"]
        with trio.fail_after(30):
            # Up again, after the supervisor saw the old process end.
            while (status := await explorer_status(client))["state"] != "up" or not status[
                "last_exit"
            ]:
                await trio.sleep(0.05)
        assert "time limit" in str(status["last_exit"])
        assert status["restarts"] == 1
        again = await client.get("/datasette/audit.json", params={"sql": "select 2 as two"})
        assert again.json()["rows"] == [[2]]


async def test_the_explorer_is_restarted_when_it_dies(backend: FakeBackend, tmp_path: Path) -> None:
    async with (
        running_proxy(tmp_path / "audit.db", backends=backend.url, metrics_interval=3600) as p,
        httpx.AsyncClient(base_url=p.url, timeout=60) as client,
    ):
        assert (await explorer_status(client))["state"] == "idle"  # nobody asked for it yet
        # Waiting for its first request is no failure: the proxy is well.
        body = (await client.get("/health")).json()
        assert body["components"]["explorer"]["restarts"] == 0
        assert body["status"] == "ok"
        assert (await client.get("/datasette/")).status_code == 200
        first = await explorer_status(client)
        assert first["state"] == "up"
        assert isinstance(first["pid"], int)
        os.kill(first["pid"], signal.SIGKILL)
        with trio.fail_after(30):
            while (status := await explorer_status(client))["pid"] in (first["pid"], None):
                await trio.sleep(0.05)
        assert status["restarts"] == 1
        assert status["last_exit"] == "killed by SIGKILL"
        assert (await client.get("/datasette/audit/steps")).status_code == 200
        # A supervised component like every other long-lived one: its restarts are counted.
        component = (await client.get("/health")).json()["components"]["explorer"]
        assert component["state"] == "running"
        assert component["restarts"] == 1
        assert (
            component["last_error"]
            == "ExplorerEnded: Datasette's process ended (killed by SIGKILL)"
        )
        exposition = (await client.get("/metrics/prometheus")).text
        assert 'thunderproxy_component_up{component="explorer"} 1.0' in exposition
        assert 'thunderproxy_component_restarts_total{component="explorer"} 1.0' in exposition
        pid = status["pid"]
    assert isinstance(pid, int)
    assert not alive(pid)  # stopped with the proxy


async def test_the_explorer_dies_with_a_killed_proxy(tmp_path: Path, backend: FakeBackend) -> None:
    argv = [sys.executable, "-m", "thunderproxy", "serve", "--port", "0"]
    argv += ["--backends", backend.url, "--db", str(tmp_path / "audit.db")]
    process, url = await spawn_serving(argv)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.get("/datasette/")).status_code == 200
            pid = (await explorer_status(client))["pid"]
        assert isinstance(pid, int)
    finally:
        process.kill()  # no cleanup runs: only the kernel can stop the explorer now
        await process.wait()
    with trio.fail_after(10):
        while alive(pid):
            await trio.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (dead, not yet reaped by whoever adopted it) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"
