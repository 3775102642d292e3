"""A real redis-server for the shared-limits tests: on a free loopback port, in its own
directory, without persistence; installed with apt-get when missing, skipped only when it cannot
be installed."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from thunderproxy.bench.redisserver import RedisServer, free_port

__all__ = ["RedisServer", "free_port"]


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
