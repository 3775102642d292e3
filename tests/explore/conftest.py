"""Fixtures of the explorer tests: one scripted end-to-end run (``scenario.py``) per session,
whose audit db every test reads, and a way to run a canned query the way Datasette does."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.explore.scenario import History, run_scenario
from thunderproxy.explore.instance import canned_queries


@pytest.fixture(scope="session")
def history(tmp_path_factory: pytest.TempPathFactory) -> History:
    db = tmp_path_factory.mktemp("history") / "audit.db"
    return trio.run(run_scenario, db)


@pytest.fixture
def history_copy(history: History, tmp_path: Path) -> Path:
    """A private copy of the scenario's db, for tests that run a proxy on it (which writes)."""
    target = tmp_path / "copied.db"
    for suffix in ("", "-wal"):
        source = Path(str(history.db) + suffix)
        if source.exists():
            shutil.copy(source, str(target) + suffix)
    return target


def run_canned(db: Path, name: str, **params: str) -> list[dict[str, Any]]:
    """Run canned query ``name`` on a read-only connection; parameters not given are blank, as
    Datasette sends them."""
    query = canned_queries()[name]
    unknown = set(params) - set(query["params"])
    assert not unknown, f"{name} takes no {unknown}"
    values = {param: params.get(param, "") for param in query["params"]}
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(row) for row in conn.execute(query["sql"], values)]
    finally:
        conn.close()


def raw(db: Path, sql: str, *args: Any) -> list[dict[str, Any]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(row) for row in conn.execute(sql, args)]
    finally:
        conn.close()
