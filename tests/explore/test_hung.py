"""An explorer whose process runs but answers nothing (here stopped with SIGSTOP, as a deadlock
or a debugger would leave it) is seen by its probes: ``/health`` says ``degraded`` within
seconds, ``ok`` once it answers again, and one that stays silent without using the CPU is
killed and restarted, so requests meanwhile are served by the next process instead of hanging
for the relay's read timeout."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.conftest import running_proxy
from tests.explore.test_isolation import explorer_status
from tests.fakebackend import FakeBackend
from thunderproxy.explore.mount import (
    HUNG_CPU_S,
    HUNG_S,
    SILENT_S,
    STUCK_S,
    ExplorerProcess,
    Liveness,
)

#: Bounds the checks here keep on a busy machine; the probes' own timing (``SILENT_S``,
#: ``HUNG_S``) is what a quiet one sees (docs/RELIABILITY.md has the measured times).
DEGRADED_WITHIN_S = 10.0
RECOVERED_WITHIN_S = 10.0


async def health_until(client: httpx.AsyncClient, check: Any, timeout: float) -> dict[str, Any]:
    with trio.fail_after(timeout):
        while True:
            body: dict[str, Any] = (await client.get("/health")).json()
            if check(body):
                return body
            await trio.sleep(0.1)


def explorer_reasons(body: dict[str, Any]) -> list[str]:
    return [reason for reason in body["degraded"] if reason.startswith("explorer")]


async def test_a_stopped_explorer_is_degraded_then_ok_then_restarted_when_it_stays_silent(
    backend: FakeBackend,
    tmp_path: Path,
) -> None:
    async with (
        running_proxy(tmp_path / "audit.db", backends=backend.url, metrics_interval=3600) as p,
        httpx.AsyncClient(base_url=p.url, timeout=60) as client,
    ):
        assert (await client.get("/datasette/")).status_code == 200
        pid = (await explorer_status(client))["pid"]
        assert isinstance(pid, int)
        await health_until(client, lambda b: b["status"] == "ok", RECOVERED_WITHIN_S)

        # Stopped for a moment, then going on: seen, and well again once it answers.
        os.kill(pid, signal.SIGSTOP)
        try:
            body = await health_until(
                client, lambda b: b["status"] == "degraded", DEGRADED_WITHIN_S
            )
        finally:
            os.kill(pid, signal.SIGCONT)
        (reason,) = explorer_reasons(body)
        assert f"pid {pid}" in reason
        assert "has not answered a probe" in reason
        assert body["explorer"]["state"] == "up"
        assert body["components"]["explorer"]["problem"] is not None
        await health_until(client, lambda b: b["status"] == "ok", RECOVERED_WITHIN_S)
        assert (await explorer_status(client))["pid"] == pid  # not restarted for that

        # Stopped for good: a request sent meanwhile waits for the next process.
        os.kill(pid, signal.SIGSTOP)
        try:
            await health_until(client, lambda b: b["status"] == "degraded", DEGRADED_WITHIN_S)
            with trio.fail_after(60):
                page = await client.get("/datasette/audit/steps")
            assert page.status_code == 200, page.text[:300]
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # killed, as it should be
        status = await explorer_status(client)
        assert status["pid"] != pid
        assert status["restarts"] == 1
        assert "hung" in str(status["last_exit"])
        body = await health_until(client, lambda b: b["status"] == "ok", RECOVERED_WITHIN_S)
        assert body["components"]["explorer"]["restarts"] == 1


def test_liveness_tells_silent_from_hung_from_busy() -> None:
    alive = Liveness(now=100.0, cpu=5.0)
    assert alive.problem(100.0 + SILENT_S - 0.1) is None
    assert alive.problem(100.0 + SILENT_S) == f"has not answered a probe for {SILENT_S:.0f} s"
    # Silent, but not yet long enough to be called hung.
    assert alive.hung(100.0 + HUNG_S - 0.1, 5.0) is None
    # Silent and idle: stopped or deadlocked.
    hung = alive.hung(100.0 + HUNG_S, 5.0 + HUNG_CPU_S / 2)
    assert hung is not None
    assert "hung" in hung
    # Silent and busy (a heavy page): left alone until it has been silent far too long.
    assert alive.hung(100.0 + HUNG_S, 5.0 + 2.0) is None
    assert alive.hung(100.0 + STUCK_S, 5.0 + 50.0) is not None
    # Without /proc nothing is known of its CPU: only STUCK_S restarts it.
    assert alive.hung(100.0 + HUNG_S, None) is None
    # An answer after silence says so (requests waiting for it are woken).
    assert alive.answered(100.0 + SILENT_S + 1, 6.0) is True
    assert alive.answered(100.0 + SILENT_S + 2, 6.0) is False
    assert alive.problem(100.0 + SILENT_S + 2) is None


def test_a_request_refused_meanwhile_says_why() -> None:
    explorer = ExplorerProcess("audit.db", "explorer.sock", time_limit_ms=5000)
    explorer.state = "up"
    explorer.liveness = Liveness(now=0.0, cpu=0.0)
    assert explorer.unavailable(20.0) == "has not answered a probe for 20 s"
    explorer.state, explorer.liveness = "starting", None
    explorer.hung = "it answered no probe for 6 s and used 0.00 s of CPU: hung"
    assert explorer.unavailable(30.0) == (
        "is starting: the last process was killed because it answered no probe for 6 s and "
        "used 0.00 s of CPU: hung"
    )
