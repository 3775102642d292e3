"""A throw-away redis-server for benchmarks and tests: on a free loopback port, in a directory of
its own, without persistence, killed when done."""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


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
        """Start it and wait (10 s at most) until it accepts a connection."""
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--dir", str(self.directory), "--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(1000):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.1).close()
                return
            except OSError:
                time.sleep(0.01)
        self.kill()
        raise RuntimeError(
            f"redis-server ({self.binary}) did not listen on 127.0.0.1:{self.port} within 10 s"
        )

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None
