"""The council store tries a refused statement again after a pause (trio time), and after
``ATTEMPTS`` refusals fails with ``StoreUnavailable`` naming the db and the cause."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from thunderproxy.council import store as job_store
from thunderproxy.council.errors import StoreUnavailable
from thunderproxy.council.store import JobStore


def refusing(times: int, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Event commits refused ``times`` times as a held write lock refuses them; returns the
    trio times of every try."""
    tries: list[float] = []
    real_insert = JobStore._insert

    def insert(conn: sqlite3.Connection, rows: Any) -> None:
        tries.append(trio.from_thread.run_sync(trio.current_time))
        if len(tries) <= times:
            raise sqlite3.OperationalError("database is locked")
        real_insert(conn, rows)

    monkeypatch.setattr(JobStore, "_insert", staticmethod(insert))
    return tries


async def test_a_refused_event_is_tried_again_and_then_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    tries = refusing(2, monkeypatch)
    store = await JobStore.open(str(tmp_path / "jobs.db"))
    try:
        event = await store.append("job", 1, "stage1_start", {})
        assert [e.seq for e in await store.events("job")] == [event.seq]
    finally:
        await store.aclose()
    assert store.retries == 2
    assert store.failures == 0
    pauses = [round(b - a, 3) for a, b in zip(tries, tries[1:], strict=False)]
    assert pauses == [job_store.RETRY_PAUSE_S, 2 * job_store.RETRY_PAUSE_S]


async def test_an_event_refused_every_time_fails_with_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    tries = refusing(10**6, monkeypatch)
    db = str(tmp_path / "jobs.db")
    store = await JobStore.open(db)
    try:
        with pytest.raises(StoreUnavailable) as failed:
            await store.append("job", 1, "stage1_start", {})
    finally:
        await store.aclose()
    assert len(tries) == job_store.ATTEMPTS
    assert store.failures == 1
    assert db in failed.value.message
    assert "database is locked" in failed.value.message
