"""What a newcomer hits when starting ``serve``: each mistake is one line naming the problem and
the remedy, a non-zero exit, no traceback, nothing started; and a proxy whose backend comes up
late listens at once and answers 503 until it is there."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import trio

from thunderproxy.sim import SimConfig, open_simulator

SERVE = [sys.executable, "-m", "thunderproxy", "serve"]


def serve_fails(*args: str, env: dict[str, str] | None = None) -> str:
    """Run ``serve`` with ``args``; it must exit non-zero with exactly one line on stderr."""
    result = subprocess.run(
        [*SERVE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr
    # Nothing was started: not even the embedded simulator announced itself.
    assert "SIMULATED" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    return lines[0].removeprefix("Error: ")


def test_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        db = tmp_path / "audit.db"
        message = serve_fails("--port", str(port), "--db", str(db))
    assert message == (
        f"Port {port} on 127.0.0.1 is already in use; stop the process that holds it or pass "
        "--port with a free port (0: any)."
    )
    # The port is checked first: nothing else was touched.
    assert not db.exists()


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_an_invalid_port(tmp_path: Path, port: str) -> None:
    message = serve_fails("--port", port, "--db", str(tmp_path / "audit.db"))
    assert message == f"--port: {port} is not a TCP port: use 1-65535, or 0 for any free port."


def test_a_db_that_is_a_directory(tmp_path: Path) -> None:
    message = serve_fails("--port", "0", "--db", str(tmp_path))
    assert message == (
        f"--db {str(tmp_path)!r} is a directory; pass a file path such as "
        f"{str(tmp_path / 'thunderproxy.db')!r}."
    )


def test_a_db_in_a_folder_that_does_not_exist(tmp_path: Path) -> None:
    db = tmp_path / "missing" / "audit.db"
    message = serve_fails("--port", "0", "--db", str(db))
    assert message == (
        f"--db {str(db)!r}: the folder {str(db.parent)!r} does not exist; create it first or "
        "pass --db a path in an existing folder."
    )
    assert not db.parent.exists()


@contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` read-only, for root too (root ignores permission bits, not the immutable
    flag)."""
    mode = path.stat().st_mode
    path.chmod(mode & ~0o222)
    immutable = False
    try:
        if os.geteuid() == 0:
            chattr = shutil.which("chattr")
            done = chattr and subprocess.run([chattr, "+i", str(path)], capture_output=True)
            if not done or done.returncode != 0:
                pytest.skip("running as root without chattr +i: nothing here is read-only")
            immutable = True
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        path.chmod(mode)


def test_a_db_file_that_cannot_be_written(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    db.write_bytes(b"")
    with read_only(db):
        message = serve_fails("--port", "0", "--db", str(db))
    assert re.fullmatch(
        re.escape(f"--db {str(db)!r} cannot be written (")
        + r"(Permission denied|Operation not permitted)"
        + re.escape("); make it writable or pass --db another file."),
        message,
    ), message


def test_a_db_in_a_folder_that_cannot_be_written(tmp_path: Path) -> None:
    folder = tmp_path / "locked"
    folder.mkdir()
    db = folder / "audit.db"
    with read_only(folder):
        message = serve_fails("--port", "0", "--db", str(db))
    assert message.startswith(f"--db {str(db)!r}: the folder {str(folder)!r} is not writable (")
    assert message.endswith(
        "SQLite writes its -wal and -shm files beside the db. Pass --db a path in a writable "
        "folder."
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            None,
            "--config {path!r}: no such file; pass the path of a TOML file "
            "(docs/CONFIG.md has an example).",
            id="missing",
        ),
        pytest.param("port = [", "{path}: invalid TOML: ", id="invalid-toml"),
        pytest.param(
            "prot = 8400\n", "{path}: prot: unknown key; did you mean 'port'?", id="unknown-key"
        ),
    ],
)
def test_a_bad_config_file(tmp_path: Path, text: str | None, expected: str) -> None:
    path = tmp_path / "thunderproxy.toml"
    if text is not None:
        path.write_text(text)
    db = tmp_path / "audit.db"
    message = serve_fails("--port", "0", "--db", str(db), env={"THUNDERPROXY_CONFIG": str(path)})
    assert message.startswith(expected.format(path=str(path)))
    assert not db.exists()


# --- listening at once, 503 until the backends answer ---------------------------------------

SIM = SimConfig(output_len_dist="fixed:4")
ACCEPTING = re.compile(rb"accepting connections at (http://127\.0\.0\.1:\d+)")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_a_backend_that_starts_late_gets_traffic_once_it_answers(tmp_path: Path) -> None:
    backend_port = free_port()
    backend = f"http://127.0.0.1:{backend_port}"
    argv = [*SERVE, "--port", "0", "--backends", backend, "--db", str(tmp_path / "audit.db")]
    argv += ["--ready-timeout", "60", "--no-datasette"]
    process = await trio.lowlevel.open_process(
        argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL
    )
    assert process.stderr is not None
    seen = b""
    try:
        with trio.fail_after(30):
            while not (match := ACCEPTING.search(seen)):
                chunk = await process.stderr.receive_some()
                assert chunk, seen.decode()
                seen += chunk
        url = match.group(1).decode()
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            body = {"model": SIM.served_model_name, "messages": [{"role": "user", "content": "hi"}]}
            refused = await client.post("/v1/chat/completions", json=body)
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["type"] == "service_unavailable"
            assert error["message"] == (
                f"thunderproxy is starting: waiting for backends to answer /health: {backend} "
                "(at most --ready-timeout seconds); retry in a moment."
            )
            assert (await client.get("/v1/models")).status_code == 503
            health = await client.get("/health")
            assert health.status_code == 503
            assert health.json()["status"] == "starting"
            assert backend in health.json()["reason"]
            # The proxy's own endpoints answer while it starts.
            assert (await client.get("/programs")).status_code == 200

            async with open_simulator(SIM, port=backend_port):
                with trio.fail_after(30):
                    while True:
                        answer = await client.post("/v1/chat/completions", json=body)
                        if answer.status_code != 503:
                            break
                        await trio.sleep(0.1)
                assert answer.status_code == 200, answer.text
                health = await client.get("/health")
                assert health.status_code == 200
                assert health.json()["status"] == "ok"
                assert health.json()["reason"] is None
                process.send_signal(signal.SIGTERM)
                with trio.fail_after(30):
                    assert await process.wait() == 0
        rest = await process.stderr.receive_some()
        while rest:
            seen += rest
            rest = await process.stderr.receive_some()
        assert b"listening on " + url.encode() in seen
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
