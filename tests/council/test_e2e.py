"""A whole council through a real proxy on loopback, against a simulator serving three model
names: every member's calls are scheduled programs, every event lands in SQLite."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import trio

from tests.conftest import query
from tests.council.helpers import (
    MODELS,
    EventReader,
    ask_streaming,
    council_programs,
    council_proxy,
    new_conversation,
    read_sse,
    sim_config,
    types,
)


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
    # A program per context: each member's answer and ranking, the synthesis, the title.
    assert programs == council_programs(job, MODELS, MODELS[0], MODELS[0])
    released = query(
        db, "SELECT program_id FROM transitions WHERE to_status = 'stopped' AND program_id LIKE ?",
        f"council:{job}:%",
    )  # fmt: skip
    assert {r["program_id"] for r in released} == programs


async def test_a_member_that_fails_is_left_out_and_the_council_still_answers(
    tmp_path: Path,
) -> None:
    models = (*MODELS, "delta-unserved")
    async with (
        council_proxy(tmp_path / "c.db", models=models) as (proxy, _sim),
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        conversation = await new_conversation(client)
        events = await ask_streaming(client, conversation, "Which is faster?")
        failed = [e for e in events if e["type"] == "stage1_member" and not e["ok"]]
        assert [e["model"] for e in failed] == ["delta-unserved"]
        assert "does not exist" in failed[0]["error"]
        assert "delta-unserved" in failed[0]["error"]
        stage1 = next(e for e in events if e["type"] == "stage1_complete")
        assert [r["model"] for r in stage1["results"]] == list(MODELS)
        assert stage1["failed"] == [{"model": "delta-unserved", "error": failed[0]["error"]}]
        stage2 = next(e for e in events if e["type"] == "stage2_start")
        assert sorted(stage2["label_to_model"].values()) == sorted(MODELS)
        assert events[-1]["type"] == "complete"


async def test_a_council_with_no_member_answering_fails_with_the_reason(tmp_path: Path) -> None:
    async with (
        council_proxy(tmp_path / "c.db", models=("nobody-1", "nobody-2")) as (proxy, _sim),
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        conversation = await new_conversation(client)
        events = await ask_streaming(client, conversation, "Anyone?")
        assert types(events) == ["stage1_start", "stage1_member", "stage1_member", "error"]
        assert "No council member answered" in events[-1]["message"]
        assert "--council-models" in events[-1]["message"]
        status = await client.get(f"/council/api/conversations/{conversation}/job/status")
        assert status.json()["status"] == "error"
        assert status.json()["active"] is False


async def test_a_second_job_while_one_runs_is_refused_with_409(tmp_path: Path) -> None:
    async with (
        council_proxy(tmp_path / "c.db") as (proxy, _sim),
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        conversation = await new_conversation(client)
        url = f"/council/api/conversations/{conversation}/message/stream"
        async with client.stream("POST", url, json={"content": "first"}) as response:
            first = EventReader(response)
            await first.read(stop_after=1)
            second = await client.post(url, json={"content": "second"})
            assert second.status_code == 409
            assert "already has council job" in second.json()["error"]["message"]
            whole = await client.post(
                f"/council/api/conversations/{conversation}/message", json={"content": "x"}
            )
            assert whole.status_code == 409
            status = await client.get(f"/council/api/conversations/{conversation}/job/status")
            assert status.json()["active"] is True
            rest = await first.read()
        assert rest[-1]["type"] == "complete"
        # Once it is done, the next question runs, and this time the whole answer comes back.
        whole = await client.post(
            f"/council/api/conversations/{conversation}/message", json={"content": "again"}
        )
        assert whole.status_code == 200
        body = whole.json()
        assert body["status"] == "complete"
        assert len(body["stage1"]) == len(MODELS)
        assert body["stage3"]["model"] == MODELS[0]
        saved = (await client.get(f"/council/api/conversations/{conversation}")).json()
        assert [m["role"] for m in saved["messages"]] == ["user", "assistant"] * 2


async def test_a_stream_replays_from_any_event_during_and_after_the_job(tmp_path: Path) -> None:
    async with (
        council_proxy(tmp_path / "c.db") as (proxy, _sim),
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        conversation = await new_conversation(client)
        url = f"/council/api/conversations/{conversation}/message/stream"
        replay = f"/council/api/conversations/{conversation}/job/stream"
        with trio.fail_after(60):
            async with client.stream("POST", url, json={"content": "Tell me"}) as response:
                live = EventReader(response)
                head = await live.read(stop_after=4)
                # A second client joins mid-job from event 2 and follows it to the end.
                async with client.stream("GET", replay, params={"after": 2}) as joined:
                    late = await read_sse(joined)
                tail = await live.read()
        everything = head + tail
        assert everything[-1]["type"] == "complete"
        assert [e["seq"] for e in late] == [e["seq"] for e in everything[2:]]
        assert late == everything[2:]
        # After the job: the same events from the db, by ?after= or by Last-Event-ID.
        async with client.stream("GET", replay, params={"after": 0}) as again:
            assert await read_sse(again) == everything
        headers = {"last-event-id": str(len(everything) - 2)}
        async with client.stream("GET", replay, headers=headers) as resumed:
            assert await read_sse(resumed) == everything[-2:]


async def test_a_job_interrupted_by_a_restart_resumes_after_its_last_completed_stage(
    tmp_path: Path,
) -> None:
    db = tmp_path / "c.db"
    # Slow enough that the proxy stops while stage 2 is under way.
    slow = sim_config(time_scale=0.2)
    async with (
        council_proxy(db, sim=slow) as (proxy, _sim),
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        conversation = await new_conversation(client)
        url = f"/council/api/conversations/{conversation}/message/stream"
        with trio.fail_after(60):
            async with client.stream("POST", url, json={"content": "Long one"}) as response:
                live = EventReader(response)
                seen = await live.read(stop_after=1)
                while seen[-1]["type"] != "stage2_chunk":
                    seen += await live.read(stop_after=1)
        # Leaving the block stops this proxy mid-stage-2.
    job = seen[0]["job_id"]
    assert query(db, "SELECT status, completed_stage FROM council_jobs") == [
        {"status": "stage2", "completed_stage": 1}
    ]
    async with (
        council_proxy(db) as (proxy, _sim),
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        replay = f"/council/api/conversations/{conversation}/job/stream"
        with trio.fail_after(60):
            async with client.stream("GET", replay, params={"after": seen[-1]["seq"]}) as r:
                rest = await read_sse(r)
        after_restart = types(rest)
        resumed_at = after_restart.index("resumed")
        assert next(e for e in rest if e["type"] == "resumed")["completed_stage"] == 1
        assert "stage1_start" not in after_restart
        assert after_restart[resumed_at + 1] == "stage2_start"
        assert after_restart[-1] == "complete"
        status = (await client.get(f"/council/api/conversations/{conversation}/job/status")).json()
        assert status["status"] == "complete"
        assert status["job_id"] == job
    row = query(db, "SELECT status, completed_stage, resumes FROM council_jobs")[0]
    assert row == {"status": "complete", "completed_stage": 3, "resumes": 1}
    seqs = [r["seq"] for r in query(db, "SELECT seq FROM council_events ORDER BY seq")]
    assert seqs == list(range(1, len(seqs) + 1))


async def test_the_page_and_api_are_served_and_guarded_by_the_admin_token(
    tmp_path: Path,
) -> None:
    async with (
        council_proxy(tmp_path / "c.db", admin_token="s3cret") as (proxy, _sim),
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        refused = await client.get("/council/")
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"].startswith("Basic")
        assert "--admin-token" in refused.json()["error"]["message"]
        assert (await client.post("/council/api/conversations")).status_code == 401
        client.headers["authorization"] = "Bearer s3cret"
        page = await client.get("/council/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert "Ask the council" in page.text
        for name, kind in (("council.js", "text/javascript"), ("council.css", "text/css")):
            asset = await client.get(f"/council/static/{name}")
            assert asset.status_code == 200
            assert asset.headers["content-type"].startswith(kind)
        assert (await client.get("/council/static/..%2Fstore.py")).status_code == 404
        config = (await client.get("/council/api/config")).json()
        assert config == {
            "members": list(MODELS), "chairman": MODELS[0], "title_model": MODELS[0], "tools": []
        }  # fmt: skip
        missing = await client.get("/council/api/conversations/nope")
        assert missing.status_code == 404
        assert "does not exist" in missing.json()["error"]["message"]
        first = await new_conversation(client)
        other = await new_conversation(client)
        events = await ask_streaming(client, first, "q")
        stolen = await client.get(
            f"/council/api/conversations/{other}/job/stream",
            params={"job_id": events[0]["job_id"]},
        )
        assert stolen.status_code == 400
        empty = await client.post(f"/council/api/conversations/{first}/message", json={})
        assert empty.status_code == 400
        deleted = await client.delete(f"/council/api/conversations/{first}")
        assert deleted.json() == {"id": first, "deleted": True}
        listed = (await client.get("/council/api/conversations")).json()
        assert [c["id"] for c in listed] == [other]


async def test_members_call_tools_through_the_proxy_within_their_budget(tmp_path: Path) -> None:
    # Every reply that may call a tool does: each member uses its whole budget of two rounds,
    # then is asked once more without tools.
    sim = sim_config(tool_call_probability=1.0, tool_call_after_result_probability=1.0)
    db = tmp_path / "c.db"
    async with (
        council_proxy(db, sim=sim, council_tools=True, council_tool_rounds=2) as (proxy, _),
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        conversation = await new_conversation(client)
        events = await ask_streaming(client, conversation, "Look it up")
    assert events[-1]["type"] == "complete"
    tools = [e for e in events if e["type"] == "stage1_tool"]
    assert sorted((e["model"], e["round"]) for e in tools) == sorted(
        (m, r) for m in MODELS for r in (1, 2)
    )
    assert {e["name"] for e in tools} == {"fetch_url"}
    job = events[0]["job_id"]
    for model in MODELS:
        calls = query(
            db, "SELECT count(*) AS n FROM steps WHERE program_id = ?", f"council:{job}:{model}"
        )
        # Three stage-1 calls (two with tools, one forced answer) on the answer's program;
        # its ranking, the synthesis and the title are programs of their own.
        assert calls[0]["n"] == 3


async def test_an_event_number_out_of_range_is_refused_before_the_stream(tmp_path: Path) -> None:
    """Before: ``Last-Event-ID: 99999999999999999999999`` opened a 200 stream that then failed
    with SQLite's OverflowError; now a 400 naming the header, as for ``?after=``."""
    async with (
        council_proxy(tmp_path / "c.db") as (proxy, _sim),
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        conversation = await new_conversation(client)
        await ask_streaming(client, conversation, "Short")
        replay = f"/council/api/conversations/{conversation}/job/stream"
        for headers, params, param in [
            ({"last-event-id": "99999999999999999999999"}, {}, "last-event-id"),
            ({"last-event-id": "-1"}, {}, "last-event-id"),
            ({}, {"after": str(2**63)}, "after"),
            ({}, {"after": "\u00b2"}, "after"),
        ]:
            r = await client.get(replay, headers=headers, params=params)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param
            assert "integer from 0 to" in error["message"]
        fine = await client.get(replay, headers={"last-event-id": str(2**63 - 1)})
        assert fine.status_code == 200
        assert await read_sse(fine) == []


async def test_a_client_that_starts_many_jobs_and_leaves_gets_429_past_its_cap(
    tmp_path: Path,
) -> None:
    """Before: 30 jobs from a client that disconnected at once all ran to the end (120 calls).
    Now the client's first --council-max-jobs-per-client jobs run and the rest are refused in
    the council API's error shape."""
    db = tmp_path / "c.db"
    slow = sim_config(time_scale=1.0, output_len_dist="fixed:4000")
    async with (
        council_proxy(db, sim=slow, council_max_jobs_per_client=3) as (proxy, _sim),
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        statuses = []
        refusals = []
        for _ in range(30):
            conversation = await new_conversation(client)
            url = f"/council/api/conversations/{conversation}/message/stream"
            async with client.stream("POST", url, json={"content": "Long one"}) as r:
                statuses.append(r.status_code)
                if r.status_code != 200:
                    refusals.append(json.loads(await r.aread()))
            # The client leaves at once.
        assert statuses == [200] * 3 + [429] * 27
        error = refusals[0]["error"]
        assert error["type"] == "rate_limit_error"
        assert error["code"] == 429
        assert "--council-max-jobs-per-client" in error["message"]
        jobs = query(db, "SELECT count(*) AS n FROM council_jobs")[0]["n"]
        assert jobs == 3
