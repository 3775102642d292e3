"""SIGTERM and SIGHUP end a real-time bench run as Ctrl-C does (``realtime.ended_by_signals``):
the run is cancelled, the cleanups that stop its processes run, and the error names the signal.
Before, either signal ended the bench at once and left its engine and proxies running."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import sys
import trio
from thunderproxy.bench.agents.agent import BenchError, ungrouped_errors
from thunderproxy.bench.runs import realtime

async def main(flag):
    async with realtime.ended_by_signals():
        try:
            print("ready", flush=True)
            await trio.sleep(60)
        finally:
            # A cleanup that awaits, as stopping a process does (engine.stop_process).
            with trio.CancelScope(shield=True):
                await trio.sleep(0.1)
                open(flag, "w").write("stopped")

try:
    with ungrouped_errors():
        trio.run(main, sys.argv[1])
except BenchError as exc:
    print(exc.message, flush=True)
    sys.exit(3)
"""


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_cancels_the_run_and_its_cleanups_run(
    tmp_path: Path, stop: signal.Signals
) -> None:
    flag = tmp_path / "cleanup"
    child = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(flag)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "ready\n"
        child.send_signal(stop)
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 3, out
    assert f"stopped by {stop.name}" in out
    assert flag.read_text() == "stopped"
