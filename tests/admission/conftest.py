"""A real redis-server for the shared-limits tests: on a free loopback port, in its own
directory, without persistence; installed with apt-get when missing, skipped only when it cannot
be installed."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def _redis_binary() -> str | None:
    found = shutil.which("redis-server")
    if found is not None:
        return found
    apt = shutil.which("apt-get")
    if apt is None:
        return None
    for argv in ([apt, "update", "-qq"], [apt, "install", "-y", "-qq", "redis-server"]):
        if subprocess.run(argv, capture_output=True, check=False, timeout=600).returncode != 0:
            return None
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class RedisServer:
    binary: str
    port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--dir", str(self.directory), "--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Ready when it accepts a connection (bounded: 10 s).
        for _ in range(1000):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.1).close()
                return
            except OSError:
                time.sleep(0.01)
        raise AssertionError(f"redis-server did not listen on {self.port}")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@pytest.fixture(scope="session")
def redis_binary() -> str:
    binary = _redis_binary()
    if binary is None:
        pytest.skip("redis-server is not installed and apt-get could not install it")
    return binary


@pytest.fixture
def redis_server(redis_binary: str, tmp_path: Path) -> Iterator[RedisServer]:
    directory = tmp_path / "redis"
    directory.mkdir()
    server = RedisServer(redis_binary, free_port(), directory)
    server.start()
    try:
        yield server
    finally:
        server.kill()
