"""The proxy as its users run it: a separate process (``python -m thunderproxy`` or the zipapp on
a bare interpreter), the official OpenAI client, SIGTERM, and the audit rows left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import trio

from tests.conftest import LISTENING, query, spawn_serving
from thunderproxy.sim import SimConfig, open_simulator

ROOT = Path(__file__).resolve().parents[2]
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)


async def serve_simulator_task(
    config: SimConfig, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    async with open_simulator(config) as sim:
        task_status.started(sim.url)
        await trio.sleep_forever()


def command(kind: str, pyz: Path | None) -> list[str]:
    if kind == "module":
        return [sys.executable, "-m", "thunderproxy"]
    assert pyz is not None
    # -S: no site-packages at all, so everything must come from the archive itself.
    return [BASE_PYTHON, "-S", str(pyz)]


MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SIM = SimConfig(enable_prompt_tokens_details=True, output_len_dist="fixed:8")


def openai_calls(base_url: str) -> list[str]:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    texts = []
    for step in range(2):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"step {step}"}],
            extra_body={"program_id": "openai-agent"},
        )
        texts.append(reply.choices[0].message.content or "")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream"}],
        stream=True,
        extra_body={"program_id": "openai-agent"},
    )
    texts.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
    return texts


# The archive's runs are slow: the pyz fixture pip-installs every dependency to build it (some
# two minutes, and a network); `pytest -m slow` runs them, the module runs cover the rest.
@pytest.mark.parametrize("kind", ["module", pytest.param("pyz", marks=pytest.mark.slow)])
async def test_served_process_speaks_to_the_openai_client_and_stops_cleanly_on_sigterm(
    kind: str, request: pytest.FixtureRequest, nursery: trio.Nursery, tmp_path: Path
) -> None:
    pyz = request.getfixturevalue("pyz") if kind == "pyz" else None
    sim = await nursery.start(serve_simulator_task, SIM)
    db = tmp_path / "audit.db"
    env = dict(os.environ)  # the run's own THUNDERPROXY_PYZ_CACHE (conftest.py)
    argv = [*command(kind, pyz), "serve", "--port", "0", "--backends", sim, "--db", str(db)]
    process, url = await spawn_serving(argv, env)
    try:
        texts = await trio.to_thread.run_sync(openai_calls, url)
        assert all(texts)
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
    rows = query(db, "select step, status, completion_tokens, stream from steps order by step")
    assert rows == [
        {"step": 1, "status": 200, "completion_tokens": 8, "stream": 0},
        {"step": 2, "status": 200, "completion_tokens": 8, "stream": 0},
        {"step": 3, "status": 200, "completion_tokens": 8, "stream": 1},
    ]
    assert query(db, "select distinct program_id from steps") == [{"program_id": "openai-agent"}]
    assert (db.stat().st_mode & 0o777) == 0o600


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup"])
async def test_sigterm_drains_a_stream_in_flight(
    signum: signal.Signals, nursery: trio.Nursery, tmp_path: Path
) -> None:
    # SIGHUP (a closed terminal, a supervisor hanging up) drains as SIGTERM does: before, it
    # killed the process at once, exit 129, with the stream cut and no steps row.
    import httpx

    sim = await nursery.start(serve_simulator_task, SIM)
    db = tmp_path / "audit.db"
    # No Datasette: its import is most of a start, and the drain does not involve it.
    argv = [*command("module", None), "serve", "--port", "0", "--backends", sim, "--no-datasette"]
    process, url = await spawn_serving([*argv, "--db", str(db)], dict(os.environ))
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
        # ~150 decode steps of ~7 ms: still streaming when the signal arrives after chunk one.
        headers = {"X-Sim-Output-Tokens": "150", "X-Program-Id": "drain"}
        chunks = []
        async with (
            httpx.AsyncClient(base_url=url) as client,
            client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r,
        ):
            async for chunk in r.aiter_text():
                if not chunks:
                    process.send_signal(signum)
                chunks.append(chunk)
        with trio.fail_after(20):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
    assert "".join(chunks).endswith("data: [DONE]\n\n")
    assert query(db, "select status from steps") == [{"status": 200}]
    # The run's row was closed: the writer flushed and stopped in order.
    assert query(db, "select stopped_at is not null as stopped from runs") == [{"stopped": 1}]


async def test_sighup_is_left_alone_where_it_is_ignored(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # nohup starts a process with SIGHUP ignored, to outlive its terminal: draining on it then
    # would stop what the user asked to keep running.
    import httpx

    sim = await nursery.start(serve_simulator_task, SIM)
    argv = [
        *command("module", None),
        "serve",
        "--port",
        "0",
        "--backends",
        sim,
        "--db",
        str(tmp_path / "a.db"),
    ]
    process = await trio.lowlevel.open_process(
        ["sh", "-c", 'trap "" HUP; exec "$@"', "sh", *argv],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    assert process.stderr is not None
    seen = b""
    try:
        with trio.fail_after(30):
            while not (match := LISTENING.search(seen)):
                chunk = await process.stderr.receive_some()
                assert chunk, seen.decode()
                seen += chunk
        process.send_signal(signal.SIGHUP)
        async with httpx.AsyncClient(base_url=match.group(1).decode(), timeout=10) as client:
            for _ in range(3):  # a stop would answer 503 "shutting down", then refuse
                assert (await client.get("/health")).status_code == 200
                await trio.sleep(0.2)
        assert process.returncode is None
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
