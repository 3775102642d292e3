"""Recording never fails serving: the audit writer stores what it can, drops only what SQLite
still refuses, counts every loss by cause and keeps running."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import trio

from tests.conftest import query, wait_for
from thunderproxy.audit import AuditLog, serve_audit_writer
from thunderproxy.audit.records import RejectionRecord, StepRecord
from thunderproxy.audit.sanitize import INT64_MAX, INT64_MIN, normalise_row, storable_text


def step(**overrides: object) -> StepRecord:
    fields: dict[str, object] = {
        "request_id": "r-1",
        "program_id": "p",
        "step": 1,
        "backend": "http://b",
        "endpoint": "/v1/chat/completions",
        "model": "m",
        "stream": False,
        "arrived_at": 1.0,
        "sent_at": 1.5,
        "first_token_at": None,
        "finished_at": 2.0,
        "tool_s": None,
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "cached_tokens": None,
        "status": 200,
    }
    fields.update(overrides)
    return StepRecord(**fields)  # type: ignore[arg-type]


def rejection(method: object) -> RejectionRecord:
    return RejectionRecord(
        at=1.0,
        method=method,  # type: ignore[arg-type]
        path="/v1/chat/completions",
        status=400,
        error_type="invalid_request_error",
        message="refused",
    )


def test_normalise_row_makes_every_value_storable() -> None:
    row, notes = normalise_row(
        {
            "program_id": "a\ud800b",
            "big": 2**70,
            "small": -(2**70),
            "nan": math.nan,
            "inf": -math.inf,
            "fine": 3,
            "flag": True,
            "other": [1, 2],
            "error": "upstream said no",
        }
    )
    assert row["program_id"] == "a\\ud800b"
    assert row["big"] == INT64_MAX
    assert row["small"] == INT64_MIN
    assert row["nan"] is None
    assert row["inf"] is None
    assert row["fine"] == 3
    assert row["flag"] == 1
    assert row["other"] == "[1, 2]"
    assert len(notes) == 6
    assert row["error"].startswith("upstream said no (audit: program_id held text")
    assert "big out of SQLite's integer range, clamped" in row["error"]


def test_clean_rows_are_left_alone() -> None:
    clean = {"program_id": "task-7 ✓", "n": 2**63 - 1, "x": 0.5, "error": None}
    assert normalise_row(clean) == (clean, [])
    assert storable_text("😀") == ("😀", False)


async def test_refused_rows_are_dropped_counted_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "audit.db"
    async with trio.open_nursery() as nursery:
        audit: AuditLog = await nursery.start(
            lambda task_status: serve_audit_writer(str(db), run_info={}, task_status=task_status)
        )
        with caplog.at_level(logging.ERROR, logger="thunderproxy.audit"):
            audit.record(step(request_id="good"))
            # NOT NULL: SQLite refuses these rows whatever is done to their values.
            audit.record(rejection(None))
            audit.record(rejection(None))
            audit.record(
                step(
                    request_id="odd",
                    program_id="\ud800",
                    model="m\udfff",
                    prompt_tokens=2**64,
                    tool_s=math.nan,
                    error="bad \ud801",
                )
            )
            await wait_for(lambda: audit.written + audit.dropped >= 4)
            # The writer is still running: a later row is written too.
            audit.record(step(request_id="after"))
            await wait_for(lambda: audit.written >= 3)
        stats = audit.statistics()
        assert stats.written == 3
        assert stats.invalid == 1
        assert stats.dropped == 2
        assert stats.dropped_by_cause == {
            "rejections: NOT NULL constraint failed: rejections.method": 2
        }
        assert stats.as_dict()["dropped_by_cause"] == dict(stats.dropped_by_cause)
        refused = [r for r in caplog.records if "dropped" in r.getMessage()]
        assert len(refused) == 1, "one log line per cause, not per row"
        await audit.aclose()
    rows = {r["request_id"]: r for r in query(db, "SELECT * FROM steps")}
    assert set(rows) == {"good", "odd", "after"}
    odd = rows["odd"]
    assert odd["program_id"] == "\\ud800"
    assert odd["model"] == "m\\udfff"
    assert odd["prompt_tokens"] == INT64_MAX
    assert odd["tool_s"] is None
    assert odd["error"].startswith("bad \\ud801 (audit: ")
    assert "prompt_tokens out of SQLite's integer range" in odd["error"]
    assert query(db, "SELECT stopped_at FROM runs")[0]["stopped_at"] is not None


async def test_a_full_queue_is_a_counted_cause(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    async with trio.open_nursery() as nursery:
        audit: AuditLog = await nursery.start(
            lambda task_status: serve_audit_writer(
                str(db), run_info={}, queue_size=1, task_status=task_status
            )
        )
        # Nothing yields between these: the waiting writer takes the first, the one-slot channel
        # holds the second, the rest are dropped.
        for i in range(4):
            audit.record(step(request_id=f"r{i}"))
        assert audit.statistics().dropped_by_cause == {"queue full (raise --audit-queue)": 2}
        await audit.aclose()
    assert len(query(db, "SELECT * FROM steps")) == 2
