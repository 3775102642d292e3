"""``thunderproxy serve --workers 2 --redis``: two proxy processes on one port, sharing tr's view
of the backends through a real redis-server, in front of a real simulated vLLM process. The
kernel spreads the connections over both; every stream is served; and the two together never
drive the backend into preemption, read from the simulator's own /metrics."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

# The fixtures: a redis-server (installed if missing) on a free port.
from tests.admission.conftest import RedisServer, redis_binary, redis_server  # noqa: F401
from tests.conftest import hangup_as_default
from thunderproxy.bench.studies.scaleout import ScaleoutConfig, run_arrangement
from thunderproxy.scaleout import process_db
from thunderproxy.sim import SimConfig, open_simulator

# Agents on backends whose KV holds a fraction of their programs at once. The small load runs in
# the default suite; the slow one is the scale-out's target, 256 streams at once.
SMALL = ScaleoutConfig(
    streams=16,
    steps=2,
    backends=1,
    kv_tokens=8192,
    tool_s=0.05,
    time_scale=0.02,
    arrangements=("shared",),
    limit_s=60.0,
    # A call whose claim was refused waits for its backend's next resume round: one second
    # here, not the default five, so that the default suite's run stays short (the load took
    # 6.6 to 26.3 s with five, 2.7 to 4.8 s with one, five runs each; docs/BENCHMARKS.md).
    serve_flags=("--resume-cooldown", "1"),
)
FULL = ScaleoutConfig(
    streams=256,
    steps=3,
    backends=2,
    kv_tokens=32_768,
    tool_s=0.5,
    time_scale=0.02,
    arrangements=("shared",),
    limit_s=600.0,
)


@pytest.mark.parametrize(
    "load", [SMALL, pytest.param(FULL, marks=pytest.mark.slow)], ids=["16-streams", "256-streams"]
)
async def test_two_workers_share_one_port_and_tr_state(
    tmp_path: Path,
    redis_binary: str,  # noqa: F811
    load: ScaleoutConfig,
) -> None:
    outcome = await run_arrangement(load, "shared", tmp_path)
    print(outcome)
    assert outcome.failed == 0, outcome.failures
    assert outcome.calls == load.streams * load.steps
    # Both workers took connections, and between them recorded every call.
    assert len(outcome.calls_per_worker) == 2
    assert min(outcome.calls_per_worker) > 0, outcome.calls_per_worker
    assert sum(outcome.calls_per_worker) == outcome.calls
    # The two together never made the engine preempt a running call for want of KV: every
    # call that adds KV goes out only once Redis granted its claim against the claims of both
    # workers at once, and while the other worker is live tr holds whatever its hold ledger
    # measured (docs/DEPLOY.md, "KV claims").
    assert outcome.preemptions == 0, outcome


def test_workers_without_redis_are_refused_with_the_remedy(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "thunderproxy", "serve", "--workers", "2"]
    argv += ["--backends", "http://127.0.0.1:9", "--db", str(tmp_path / "p.db")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert "--workers 2 needs --redis" in done.stderr
    assert "pass --redis redis://host:6379/0, or --workers 1" in done.stderr
    assert not (tmp_path / "p.db").exists()
    assert not Path(process_db(str(tmp_path / "p.db"), 1)).exists()


@pytest.mark.parametrize(
    ("db", "k", "expected"),
    [
        ("thunderproxy.db", 1, "thunderproxy.w1.db"),
        ("/var/tp/audit", 2, "/var/tp/audit.w2"),
        ("", 3, ""),
    ],
)
def test_each_worker_has_its_own_audit_db(db: str, k: int, expected: str) -> None:
    assert process_db(db, k) == expected


async def test_a_dead_worker_is_started_again_and_a_signal_stops_them_all(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    async with open_simulator(SimConfig(time_scale=0.02)) as sim:
        argv = two_workers(tmp_path, sim.url, redis_server.url)
        process = await trio.lowlevel.open_process(argv, stderr=subprocess.PIPE)
        stderr = Stderr(process)

        async def until(pattern: bytes) -> re.Match[bytes]:
            return await stderr.until(pattern, timeout_s=30)

        try:
            listening = await until(rb"listening on (http://\S+) \(2 workers, pids (\d+),(\d+)")
            url = listening.group(1).decode()
            first, second = int(listening.group(2)), int(listening.group(3))
            os.kill(first, signal.SIGKILL)
            await until(rb"worker 1 \(pid %d\) exited with -9; starting it again" % first)
            again = await until(rb"worker 1 \(pid (\d+)\) serves again")
            restarted = int(again.group(1))
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                for _ in range(4):  # new connections: the kernel may send each to either worker
                    r = await client.get("/health", headers={"Connection": "close"})
                    assert r.status_code == 200
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                assert await process.wait() == 0
            for pid in (second, restarted):
                with pytest.raises(ProcessLookupError):
                    os.kill(pid, 0)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


def two_workers(tmp_path: Path, backends: str, redis_url: str) -> list[str]:
    """``thunderproxy serve --workers 2`` on a free port, sharing through ``redis_url``."""
    argv = [sys.executable, "-m", "thunderproxy", "serve", "--workers", "2", "--port", "0"]
    argv += ["--backends", backends, "--redis", redis_url, "--no-datasette"]
    return [*argv, "--db", str(tmp_path / "p.db")]


class Stderr:
    """What a process has written on stderr so far, read on until a pattern shows."""

    def __init__(self, process: trio.Process) -> None:
        assert process.stderr is not None
        self.stream = process.stderr
        self.seen = b""

    async def until(self, pattern: bytes, *, timeout_s: float) -> re.Match[bytes]:
        with trio.fail_after(timeout_s):
            while not (found := re.search(pattern, self.seen)):
                chunk = await self.stream.receive_some()
                assert chunk, self.seen.decode()
                self.seen += chunk
        return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no one has reaped yet counts as gone: it serves nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGHUP], ids=["sigkill", "sighup"])
async def test_workers_die_with_their_supervisor(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
    signum: signal.Signals,
) -> None:
    # Before, a supervisor killed (or hung up on: SIGHUP's default action) left its workers
    # serving the port with parent 1.
    async with open_simulator(SimConfig(time_scale=0.02)) as sim:
        argv = two_workers(tmp_path, sim.url, redis_server.url)
        process = await trio.lowlevel.open_process(
            argv, stderr=subprocess.PIPE, preexec_fn=hangup_as_default
        )
        pids: list[int] = []
        try:
            pattern = rb"listening on http://127\.0\.0\.1:(\d+) \(2 workers, pids (\d+),(\d+)"
            listening = await Stderr(process).until(pattern, timeout_s=60)
            port = int(listening.group(1))
            pids = [int(listening.group(2)), int(listening.group(3))]
            assert all(alive(pid) for pid in pids)
            process.send_signal(signum)
            with trio.fail_after(60):
                code = await process.wait()
                # Generous: each worker drains (nothing is in flight) and flushes its db.
                while any(alive(pid) for pid in pids):
                    await trio.sleep(0.1)
            assert code == (-signal.SIGKILL if signum == signal.SIGKILL else 0)
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=10).close()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            for pid in pids:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


async def test_a_supervisor_refuses_a_port_that_others_listen_on(tmp_path: Path) -> None:
    # What a killed supervisor's workers left behind: sockets listening with SO_REUSEPORT.
    # Before, a new `serve --workers 2` bound beside them and the two sets split the traffic.
    with socket.socket() as orphan:
        orphan.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        orphan.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        orphan.bind(("127.0.0.1", 0))
        orphan.listen()
        port = orphan.getsockname()[1]
        argv = [sys.executable, "-m", "thunderproxy", "serve", "--workers", "2"]
        argv += ["--port", str(port), "--backends", "http://127.0.0.1:9", "--no-datasette"]
        argv += ["--redis", "redis://127.0.0.1:9/0", "--db", str(tmp_path / "p.db")]
        process = await trio.lowlevel.open_process(
            argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL
        )
        assert process.stderr is not None
        stderr = b""
        try:
            with trio.move_on_after(60):
                while chunk := await process.stderr.receive_some():
                    stderr += chunk
                await process.wait()
        finally:
            if process.returncode is None:
                process.terminate()  # reaches the workers it may have started, which stop
                with trio.fail_after(60):
                    await process.wait()
    text = stderr.decode()
    assert process.returncode == 1, text
    errors = [line for line in text.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, text
    assert f"Port {port} on 127.0.0.1 is already in use by processes listening there" in errors[0]
    assert f"`ss -ltnp 'sport = :{port}'` lists their pids" in errors[0]
    assert "pass --port with a free port" in errors[0]
    assert not await trio.Path(process_db(str(tmp_path / "p.db"), 1)).exists()
