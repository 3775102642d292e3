"""``/health`` tells the truth about the three causes it once missed, each produced for real and
timed: the audit db on a full tmpfs, the explorer's process stopped with SIGSTOP, and the proxy
process under a lowered ``RLIMIT_NOFILE`` with more idle connections than it may hold. Each
turns ``/health`` ``degraded`` within 5 s and back to ``ok`` within 5 s of the cause going, and
out of descriptors takes no backend out. The times are printed (``-s``); docs/RELIABILITY.md
has them.

    pytest -m slow tests/reliability/test_health_causes.py -s
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import running_proxy, spawn_serving
from tests.fakebackend import FakeBackend

pytestmark = pytest.mark.slow

#: The bound each cause is held to, both ways.
WITHIN_S = 5.0
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def health(client: httpx.AsyncClient) -> dict[str, Any]:
    body: dict[str, Any] = (await client.get("/health")).json()
    return body


async def seconds_until(
    client: httpx.AsyncClient, status: str, since: float, within: float = WITHIN_S
) -> float:
    """Seconds from ``since`` until /health says ``status`` (failing past ``within``)."""
    with trio.fail_after(within - (trio.current_time() - since)):
        while (await health(client))["status"] != status:
            await trio.sleep(0.05)
    return trio.current_time() - since


@contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    folder.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path) -> Path:
    """Take every byte left on ``folder``'s file system."""
    filler = folder / "filler"
    with open(filler, "wb") as out:
        try:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return filler


async def test_a_full_disk(tmp_path: Path, backend: FakeBackend) -> None:
    with small_tmpfs(tmp_path / "small", "3m") as small:
        async with (
            running_proxy(small / "audit.db", backends=backend.url, metrics_interval=3600) as p,
            httpx.AsyncClient(base_url=p.url, timeout=30) as client,
        ):
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            assert (await health(client))["status"] == "ok"

            async def calls() -> None:
                while True:
                    response = await client.post("/v1/chat/completions", json=CHAT)
                    assert response.status_code == 200
                    await trio.sleep(0.05)

            async with trio.open_nursery() as traffic:
                traffic.start_soon(calls)
                filler = fill(small)
                full_at = trio.current_time()
                to_degraded = await seconds_until(client, "degraded", full_at)
                body = await health(client)
                traffic.cancel_scope.cancel()
            assert any("audit rows are being dropped" in r for r in body["degraded"])
            assert body["audit"]["status"] == "degraded"
            assert body["audit"]["dropped"] > 0
            # No rows coming now, the disk still full: the writer's probe does not clear it.
            await trio.sleep(2.5)
            assert (await health(client))["status"] == "degraded"
            # The room made is seen by the probe alone.
            filler.unlink()
            to_ok = await seconds_until(client, "ok", trio.current_time())
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            print(f"\nfull tmpfs: degraded after {to_degraded:.2f} s, ok {to_ok:.2f} s after room")


async def test_a_stopped_explorer(tmp_path: Path, backend: FakeBackend) -> None:
    async with (
        running_proxy(tmp_path / "audit.db", backends=backend.url, metrics_interval=3600) as p,
        httpx.AsyncClient(base_url=p.url, timeout=60) as client,
    ):
        assert (await client.get("/datasette/")).status_code == 200
        pid = (await health(client))["explorer"]["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            to_degraded = await seconds_until(client, "degraded", trio.current_time())
        finally:
            os.kill(pid, signal.SIGCONT)
        to_ok = await seconds_until(client, "ok", trio.current_time())

        # Stopped for good: killed once found hung, then the next one serves.
        os.kill(pid, signal.SIGSTOP)
        stopped = trio.current_time()
        while (explorer := (await health(client))["explorer"])["pid"] == pid:
            await trio.sleep(0.05)
        killed_after = trio.current_time() - stopped
        assert "hung" in explorer["last_exit"]
        # Ok once the next process is up: Python and Datasette's imports, 1 to 3.5 s on a
        # busy two-core machine; bounded looser than the rest, since that start is the wait.
        to_ok_again = await seconds_until(client, "ok", trio.current_time(), within=15.0)
        assert (await client.get("/datasette/audit/steps")).status_code == 200
        print(
            f"\nstopped explorer: degraded after {to_degraded:.2f} s, ok {to_ok:.2f} s after "
            f"SIGCONT; left stopped, killed after {killed_after:.2f} s and ok "
            f"{to_ok_again:.2f} s later (the next process started)"
        )


async def keep_asking(client: httpx.AsyncClient, seconds: float, backend: str) -> None:
    """Ask /health twice a second for ``seconds``, each time finding ``backend`` healthy. The
    asking keeps the client's one connection busy: left idle past Hypercorn's 2 s idle timeout
    it is closed, and a request sent as it closes fails (while the proxy is out of descriptors,
    a new connection waits behind the queued idle ones)."""
    end = trio.current_time() + seconds
    while trio.current_time() < end:
        assert (await health(client))["healthy_backends"] == [backend]
        await trio.sleep(0.5)


@pytest.mark.parametrize("front", ["fast", "hypercorn"])
async def test_out_of_descriptors(tmp_path: Path, backend: FakeBackend, front: str) -> None:
    argv = [sys.executable, "-m", "thunderproxy", "serve", "--port", "0", "--no-datasette"]
    argv += ["--http-front", front]
    if front == "hypercorn":
        # Hypercorn keeps a connection its client closed before sending anything until the
        # idle timeout (--client-timeout, 60 s by default); the fast front closes it at once.
        argv += ["--client-timeout", "2"]
    argv += ["--backends", backend.url, "--db", str(tmp_path / "audit.db")]
    process, url = await spawn_serving(argv)
    assert process.stderr is not None
    log = bytearray()

    async def drain() -> None:
        assert process.stderr is not None
        while chunk := await process.stderr.receive_some():
            log.extend(chunk)

    idle: list[socket.socket] = []
    try:
        async with (
            trio.open_nursery() as nursery,
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            nursery.start_soon(drain)
            assert (await health(client))["status"] == "ok"  # the connection /health keeps
            hard = resource.prlimit(process.pid, resource.RLIMIT_NOFILE)[1]
            resource.prlimit(process.pid, resource.RLIMIT_NOFILE, (256, hard))
            address = url.removeprefix("http://").split(":")
            for _ in range(300):  # the kernel queues what the proxy cannot accept
                idle.append(socket.create_connection((address[0], int(address[1]))))
            out_at = trio.current_time()
            to_degraded = await seconds_until(client, "degraded", out_at)
            body = await health(client)
            assert any("out of file descriptors" in r for r in body["degraded"]), body
            # A call now cannot reach its backend: the proxy's trouble, not the backend's.
            refused = await client.post("/v1/chat/completions", json=CHAT)
            assert refused.status_code == 503, refused.text
            assert "out of file descriptors" in refused.json()["error"]["message"]
            # The accept loop retries every 0.1 s meanwhile; no backend is marked for it.
            await keep_asking(client, 3.0, backend.url)
            for sock in idle:
                sock.close()
            idle.clear()
            closed_at = trio.current_time()
            if front == "hypercorn":
                await keep_asking(client, 2.0, backend.url)  # the cause goes only then
                closed_at = trio.current_time()
            to_ok = await seconds_until(client, "ok", closed_at)
            served = await client.post("/v1/chat/completions", json=CHAT)
            assert served.status_code == 200
            body = await health(client)
            assert body["healthy_backends"] == [backend.url]
            assert body["descriptors"]["refused"] > 10
            nursery.cancel_scope.cancel()
    finally:
        for sock in idle:
            sock.close()
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(30):
            await process.wait()
        if process.returncode is None:
            process.kill()
    text = log.decode(errors="replace")
    lines = [line for line in text.splitlines() if "out of file descriptors" in line]
    assert len(lines) == 1, lines  # once a minute; the run lasted seconds
    assert "accept failed" not in text
    assert "accept returned" not in text  # trio's own line, under Hypercorn
    assert "is unhealthy" not in text
    print(
        f"\nout of descriptors ({front} front): degraded after {to_degraded:.2f} s, ok "
        f"{to_ok:.2f} s after the idle connections closed; "
        f"{body['descriptors']['refused']} failures, 1 log line"
    )
