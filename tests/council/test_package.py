"""The council from the single-file app on a bare interpreter: its page and migrations are
package data, and a whole council answers."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import query, spawn_serving
from tests.council.helpers import MODELS, sim_config
from tests.e2e.test_process import command
from thunderproxy.sim import open_simulator


@pytest.mark.slow  # builds the archive (tests/e2e/test_process.py says why that is slow)
async def test_the_zipapp_serves_the_page_and_runs_a_council(
    pyz: Path,
    tmp_path: Path,
) -> None:
    db = tmp_path / "audit.db"
    env = dict(os.environ)  # the run's own THUNDERPROXY_PYZ_CACHE (conftest.py)
    async with open_simulator(sim_config()) as sim:
        argv = [
            *command("pyz", pyz), "serve", "--port", "0", "--backends", sim.url, "--db", str(db),
            "--council-models", ",".join(MODELS), "--no-datasette",
        ]  # fmt: skip
        process, url = await spawn_serving(argv, env)
        try:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                page = await client.get("/council/")
                assert "Ask the council" in page.text
                script = await client.get("/council/static/markdown.js")
                assert "CouncilMarkdown" in script.text
                conversation = (await client.post("/council/api/conversations")).json()["id"]
                answer = await client.post(
                    f"/council/api/conversations/{conversation}/message", json={"content": "q?"}
                )
            assert answer.status_code == 200
            assert answer.json()["stage3"]["model"] == MODELS[0]
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(20):
                assert await process.wait() == 0
        finally:
            if process.returncode is None:
                process.kill()
    assert query(db, "select status from council_jobs") == [{"status": "complete"}]
