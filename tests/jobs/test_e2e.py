"""A whole council through a real proxy on loopback, against a simulator serving three model
names: every member's calls are scheduled programs, every event lands in SQLite."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.conftest import query
from tests.jobs.helpers import MODELS, ask_streaming, council_proxy, new_conversation, types


async def test_a_council_streams_three_stages_and_records_every_event(tmp_path: Path) -> None:
    db = tmp_path / "council.db"
    async with council_proxy(db) as (proxy, _sim), httpx.AsyncClient(base_url=proxy.url) as client:
        conversation = await new_conversation(client)
        events = await ask_streaming(client, conversation, "Why is the sky blue?")
        shape = types(events)
        assert shape[0] == "stage1_start"
        assert shape[-3:] == ["stage3_complete", "title_complete", "complete"]
        for stage in ("stage1", "stage2", "stage3"):
            assert f"{stage}_start" in shape
            assert f"{stage}_complete" in shape
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
        chunks = {e["model"] for e in events if e["type"] == "stage1_chunk"}
        assert chunks == set(MODELS)
        stage2 = next(e for e in events if e["type"] == "stage2_complete")
        assert set(stage2["label_to_model"].values()) == set(MODELS)
        for ranking in stage2["rankings"]:
            assert sorted(ranking["parsed_ranking"]) == ["Response A", "Response B", "Response C"]
        leaderboard = stage2["aggregate_rankings"]
        assert {s["model"] for s in leaderboard} == set(MODELS)
        assert sum(s["first_places"] for s in leaderboard) == 3
        final = next(e for e in events if e["type"] == "stage3_complete")
        assert final["model"] == MODELS[0]
        assert "## The council's answer" in final["response"]
        title = next(e for e in events if e["type"] == "title_complete")["title"]
        assert title == "Why is the sky"

        saved = (await client.get(f"/council/api/conversations/{conversation}")).json()
        assert saved["title"] == title
        assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
        assistant = saved["messages"][1]
        assert assistant["status"] == "complete"
        assert assistant["stage3"]["response"] == final["response"]

    rows = query(db, "SELECT seq, type FROM council_events ORDER BY seq")
    assert [(r["seq"], r["type"]) for r in rows] == [(e["seq"], e["type"]) for e in events]
    programs = {r["program_id"] for r in query(db, "SELECT DISTINCT program_id FROM steps")}
    job = events[0]["job_id"]
    assert programs == {f"council:{job}:{m}" for m in MODELS}
    released = query(
        db, "SELECT program_id FROM transitions WHERE to_status = 'stopped' AND program_id LIKE ?",
        f"council:{job}:%",
    )  # fmt: skip
    assert {r["program_id"] for r in released} == programs
