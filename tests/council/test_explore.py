"""The council's canned queries and the council demo, on the db of real council runs."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from tests.council.helpers import MODELS, ask_streaming, council_proxy, new_conversation
from tests.explore.conftest import run_canned
from thunderproxy.council_demo import CouncilDemoConfig, describe, run_council_demo


async def test_the_canned_queries_answer_about_real_council_jobs(tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    models = (*MODELS, "delta-unserved")
    async with (
        council_proxy(db, models=models) as (proxy, _),
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        conversation = await new_conversation(client)
        first = await ask_streaming(client, conversation, "One?")
        second = await ask_streaming(client, conversation, "Two?")
    # The latest job by default, one event per row, streamed text left out.
    timeline = run_canned(db, "council_job_timeline")
    assert timeline[0]["job_id"] == second[0]["job_id"]
    assert [r["seq"] for r in timeline] == [
        e["seq"] for e in second if not e["type"].endswith("_chunk")
    ]
    failed = next(r for r in timeline if r["model"] == "delta-unserved")
    assert "does not exist" in failed["detail"]
    answered = next(r for r in timeline if r["type"] == "stage1_member" and r["model"] == MODELS[1])
    assert answered["chunks_before"] >= 1
    assert timeline[-1]["type"] == "complete"
    older = run_canned(db, "council_job_timeline", job_id=first[0]["job_id"])
    assert [r["type"] for r in older][-2:] == ["title_complete", "complete"]

    winners = run_canned(db, "council_winners")
    assert {r["model"] for r in winners} == set(MODELS)
    assert sum(r["wins"] for r in winners) == 2
    assert all(r["jobs"] == 2 for r in winners)
    expected_first = [
        e["aggregate_rankings"][0]["model"]
        for e in first + second
        if e["type"] == "stage2_complete"
    ]
    assert {r["model"]: r["wins"] for r in winners if r["wins"]} == {
        m: expected_first.count(m) for m in set(expected_first)
    }

    times = run_canned(db, "council_stage_times")
    assert [r["job_id"] for r in times] == [second[0]["job_id"], first[0]["job_id"]]
    for row in times:
        assert row["status"] == "complete"
        assert 0 < row["stage1_s"] < row["total_s"]
        assert 0 < row["stage3_s"] < row["total_s"]


def test_the_demo_describes_each_stage_in_a_line_or_a_few() -> None:
    assert describe({"type": "stage1_chunk", "model": "m", "text": "x"}) == []
    assert describe({"type": "stage1_member", "model": "m", "ok": False, "error": "gone"}) == [
        "  m: FAILED: gone"
    ]
    lines = describe(
        {"type": "stage2_complete", "aggregate_rankings": [
            {"model": "m", "average_rank": 1.5, "rankings_count": 2, "first_places": 1}]}
    )  # fmt: skip
    assert lines[1] == "    1. m                  1.50  2  1"


async def test_the_council_demo_runs_a_council_on_the_simulator(tmp_path: Path) -> None:
    lines: list[str] = []
    config = CouncilDemoConfig(port=0, db=str(tmp_path / "demo.db"), time_scale=0.02, wait=False)
    with trio.fail_after(120):
        events = await run_council_demo(config, echo=lines.append)
    assert events[-1]["type"] == "complete"
    text = "\n".join(lines)
    for heading in ("Stage 1: 3 members", "Stage 2: each member ranks", "Stage 3: the chairman"):
        assert heading in text
    assert "leaderboard" in text
    assert "## The council's answer" in text
    assert "/council/#" in text
    assert "/datasette/audit/council_job_timeline?job_id=" + events[0]["job_id"] in text
