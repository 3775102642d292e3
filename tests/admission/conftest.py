"""A real redis-server for the shared-limits tests: on a free loopback port, in its own
directory, without persistence; installed with apt-get when missing, skipped only when it cannot
be installed."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import apt_install
from thunderproxy.bench.studies.redisserver import RedisServer, free_port

__all__ = ["RedisServer", "free_port"]


@pytest.fixture(scope="session")
def redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None and apt_install("redis-server", timeout_s=600):
        binary = shutil.which("redis-server")
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
