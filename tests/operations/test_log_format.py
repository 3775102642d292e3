"""``--log-format json``: a real ``serve`` process, in front of a port nothing listens on,
writes one JSON object per line; a traceback stays inside its line."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import trio

from tests.conftest import spawn_serving
from thunderproxy.bench.studies.redisserver import free_port
from thunderproxy.cli import JsonFormatter


async def test_serve_logs_one_json_object_per_line(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "thunderproxy", "serve", "--port", "0", "--log-format", "json"]
    argv += ["--db", str(tmp_path / "audit.db"), "--no-datasette", "--backends", dead]
    argv += ["--ready-timeout", "0.5", "--metrics-interval", "0.2"]
    process, _ = await spawn_serving(argv)
    try:
        await trio.sleep(0.5)
        process.terminate()
        with trio.fail_after(20):
            await process.wait()
        assert process.stderr is not None
        rest = b""
        while chunk := await process.stderr.receive_some():
            rest += chunk
    finally:
        if process.returncode is None:
            process.kill()
    # spawn_serving read the lines up to "listening on"; the rest are read here.
    lines = [json.loads(line) for line in rest.decode().splitlines()]
    assert lines, "no line after start-up"
    for line in lines:
        assert set(line) >= {"time", "level", "logger", "message"}, line
    assert any(line["message"].startswith("SIGTERM: draining") for line in lines), lines


def test_a_record_with_a_traceback_stays_one_line() -> None:
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        record = logging.LogRecord(
            "thunderproxy", logging.ERROR, __file__, 1, "failed: %s", ("x",), sys.exc_info()
        )
    line = JsonFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["level"] == "ERROR"
    assert parsed["message"] == "failed: x"
    assert parsed["exception"].startswith("Traceback (most recent call last):")
    assert parsed["time"].endswith("+00:00")
