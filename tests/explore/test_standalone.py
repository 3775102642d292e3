"""``thunderproxy explore DB`` as users run it (a separate process, from the module and from the
zipapp on a bare interpreter), and ``serve``'s mounted Datasette from the zipapp."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.explore.conftest import run_canned
from tests.explore.scenario import History
from tests.fakebackend import FakeBackend, serve_fake_backend
from thunderproxy.errors import AuditError
from thunderproxy.explore.instance import check_database

ROOT = Path(__file__).resolve().parents[2]
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)
EXPLORING = re.compile(rb"read-only at (http://127\.0\.0\.1:\d+/datasette/)")
LISTENING = re.compile(rb"listening on (http://127\.0\.0\.1:\d+)")


def command(kind: str, pyz: Path | None) -> list[str]:
    if kind == "module":
        return [sys.executable, "-m", "thunderproxy"]
    assert pyz is not None
    return [BASE_PYTHON, "-S", str(pyz)]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ)  # the run's own THUNDERPROXY_PYZ_CACHE (conftest.py)


async def start(
    argv: list[str], env: dict[str, str], pattern: re.Pattern[bytes]
) -> tuple[trio.Process, str]:
    process = await trio.lowlevel.open_process(
        argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, cwd=ROOT
    )
    assert process.stderr is not None
    output = b""
    try:
        with trio.fail_after(30):
            while (match := pattern.search(output)) is None:
                chunk = await process.stderr.receive_some()
                if not chunk:
                    raise AssertionError(output.decode())
                output += chunk
    except BaseException:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()
        raise
    return process, match.group(1).decode()


@pytest.fixture
async def stopped_after() -> AsyncIterator[list[trio.Process]]:
    processes: list[trio.Process] = []
    yield processes
    for process in processes:
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            assert await process.wait() == 0


@pytest.mark.parametrize(
    "kind", ["module", pytest.param("pyz", marks=pytest.mark.slow)]
)  # slow: see test_process
async def test_explore_serves_the_same_pages_read_only(
    kind: str,
    request: pytest.FixtureRequest,
    history: History,
    env: dict[str, str],
    stopped_after: list[trio.Process],
) -> None:
    pyz = request.getfixturevalue("pyz") if kind == "pyz" else None
    argv = [*command(kind, pyz), "explore", str(history.db), "--port", "0"]
    process, url = await start(argv, env, EXPLORING)
    stopped_after.append(process)
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        index = await c.get("")
        assert index.status_code == 200
        assert "thunderproxy scheduling history" in index.text
        for name, params in (("waited_longest", {}), ("program_timeline", {"program_id": "alpha"})):
            r = await c.get(f"audit/{name}.json", params={"_shape": "objects", **params})
            assert r.json()["rows"] == run_canned(history.db, name, **params)
        vega = await c.get("-/static-plugins/datasette_dashboards/vega.min.js")
        assert vega.status_code == 200
        root = await c.get(url.removesuffix("/datasette/") + "/")
        assert (root.status_code, root.headers["location"]) == (302, "/datasette/")
        assert (await c.post("audit/throughput")).status_code == 405


async def test_explore_refuses_a_missing_or_unmigrated_db(tmp_path: Path) -> None:
    missing = await trio.run_process(
        [sys.executable, "-m", "thunderproxy", "explore", str(tmp_path / "nope.db")],
        capture_stderr=True,
        check=False,
    )
    assert missing.returncode == 1
    assert b"No audit db at" in missing.stderr
    old = tmp_path / "old.db"
    conn = __import__("sqlite3").connect(old)
    conn.executescript(
        "CREATE TABLE schema_migrations (name TEXT PRIMARY KEY, applied_at REAL);"
        "INSERT INTO schema_migrations VALUES ('001_initial', 0);"
    )
    conn.close()
    outdated = await trio.run_process(
        [sys.executable, "-m", "thunderproxy", "explore", str(old)],
        capture_stderr=True,
        check=False,
    )
    assert outdated.returncode == 1
    assert b"thunderproxy migrate --db" in outdated.stderr


def test_explore_names_the_missing_wal_file(history: History, tmp_path: Path) -> None:
    # A proxy that has not checkpointed yet: the tables exist only in its -wal file.
    source = tmp_path / "live.db"
    conn = sqlite3.connect(source)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA wal_autocheckpoint=0")
    conn.execute("CREATE TABLE schema_migrations (name TEXT PRIMARY KEY, applied_at REAL)")
    conn.commit()
    copied = tmp_path / "copied.db"
    shutil.copy(source, copied)  # the -wal file left behind
    conn.close()
    with pytest.raises(AuditError) as refused:
        check_database(str(copied))
    message = str(refused.value)
    assert "copied.db-wal" in message
    assert "stop the proxy before copying" in message


@pytest.mark.slow  # builds the archive (test_process says why that is slow)
async def test_serve_from_the_zipapp_mounts_datasette(
    pyz: Path,
    tmp_path: Path,
    env: dict[str, str],
    nursery: trio.Nursery,
    stopped_after: list[trio.Process],
) -> None:
    backend = FakeBackend()
    await nursery.start(serve_fake_backend, backend)
    argv = [
        *command("pyz", pyz),
        "serve",
        "--port",
        "0",
        "--backends",
        backend.url,
        "--db",
        str(tmp_path / "audit.db"),
    ]
    process, url = await start(argv, env, LISTENING)
    stopped_after.append(process)
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
        assert (await c.post("/v1/chat/completions", json={**body, "program_id": "z"})).is_success
        assert (await c.get("/datasette/-/static/app.css")).status_code == 200
        with trio.fail_after(5):
            while True:
                r = await c.get("/datasette/audit/program_steps.json?program_id=z&_shape=objects")
                if r.json()["rows"]:
                    break
                await trio.sleep(0.05)
        assert r.json()["rows"][0]["prompt_tokens"] == 10
