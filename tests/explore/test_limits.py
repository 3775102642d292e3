"""One Datasette query can neither stall the proxy nor hold gigabytes: huge values are refused
by SQLite before they are built, large results by the row budget, long queries by the time
limit, while the proxy keeps answering."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import running_proxy
from thunderproxy.explore.limits import (
    MAX_COLUMNS,
    MAX_RESULT_BYTES,
    ResultTooLarge,
    bound_connection,
    budgeted,
)

#: Far above what answering /health takes, far below the 40 s one 1 GB value used to stall it.
HEALTH_BOUND_S = 2.0
ROWS_OF_1MB = (
    "with recursive r(i) as (select 1 union all select i + 1 from r limit 1000) "
    "select randomblob(1000000), randomblob(1000000) from r"
)


def test_the_budget_counts_each_cursor_on_its_own() -> None:
    conn = sqlite3.connect(":memory:")
    conn.row_factory = budgeted(lambda _c, values: values, budget=100)
    rows = "with recursive r(i) as (select 1 union all select i + 1 from r limit 9) "
    assert len(conn.execute(rows + "select printf('%.10c', 'x') from r").fetchall()) == 9
    # A fresh cursor starts from zero; this one passes the budget on its eleventh row.
    with pytest.raises(ResultTooLarge, match="select fewer rows"):
        conn.execute(rows.replace("9", "20") + "select printf('%.10c', 'x') from r").fetchall()
    assert conn.execute("select 1").fetchall() == [(1,)]


def test_a_bounded_connection_refuses_huge_values_and_wide_rows() -> None:
    conn = sqlite3.connect(":memory:")
    conn.row_factory = sqlite3.Row
    bound_connection(conn)
    with pytest.raises(sqlite3.DataError, match="string or blob too big"):
        conn.execute("select randomblob(1e9)")
    wide = "select " + ", ".join(["1"] * (MAX_COLUMNS + 1))
    with pytest.raises(sqlite3.OperationalError, match="too many columns"):
        conn.execute(wide)
    row = conn.execute("select 1 as one").fetchone()
    assert row["one"] == 1  # Datasette's sqlite3.Row still comes back


@pytest.mark.parametrize(
    "sql",
    [
        "select hex(fts3_tokenizer('simple'))",  # leaked the tokenizer's address
        "select fts3_tokenizer('simple', x'4141414141414141')",  # would overwrite it
        "select upper(FTS3_TOKENIZER('porter'))",
    ],
)
def test_a_bounded_connection_refuses_fts3_tokenizer(sql: str) -> None:
    conn = sqlite3.connect(":memory:")
    bound_connection(conn)
    with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
        conn.execute(sql)
    assert conn.execute("select lower('OK'), length('abc')").fetchone() == ("ok", 3)


@pytest.mark.parametrize(
    ("sql", "error"),
    [
        pytest.param("select randomblob(1e9)", "string or blob too big", id="1GB-value"),
        pytest.param(ROWS_OF_1MB, f"larger than {MAX_RESULT_BYTES >> 20} MiB", id="2GB-result"),
    ],
)
async def test_a_huge_query_fails_fast_and_the_proxy_keeps_answering(
    tmp_path: Path, sql: str, error: str
) -> None:
    async with (
        running_proxy(tmp_path / "audit.db") as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        assert (await client.get("/datasette/audit")).status_code == 200
        health_s: list[float] = []
        answer: list[httpx.Response] = []

        async def ask() -> None:
            answer.append(await client.get("/datasette/audit.json", params={"sql": sql}))

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                while not answer:
                    started = trio.current_time()
                    assert (await client.get("/health")).status_code == 200
                    health_s.append(trio.current_time() - started)
                    await trio.sleep(0.01)
        assert answer[0].status_code == 400
        assert error in answer[0].json()["error"]
        assert max(health_s) < HEALTH_BOUND_S
