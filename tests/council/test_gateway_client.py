"""The council on the proxy's gateway in process: the same stages and records as over HTTP,
without the loopback hop."""

from __future__ import annotations

from pathlib import Path

import trio

from tests.conftest import query
from tests.council.helpers import MODELS, council_programs, council_proxy
from thunderproxy.council.gateway_client import GatewayChatClient
from thunderproxy.council.pipeline import CouncilConfig
from thunderproxy.council.runner import CouncilRunner
from thunderproxy.council.store import JobStore


async def test_a_council_runs_on_the_gateway_in_process(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    db = tmp_path / "c.db"
    config = CouncilConfig(
        members=(*MODELS, "delta-unserved"), chairman=MODELS[0], title_model=MODELS[1]
    )
    async with council_proxy(db) as (proxy, _sim):
        store = await JobStore.open(str(db))
        runner = CouncilRunner(store, config)
        client = GatewayChatClient(proxy.services.gateway)
        async with trio.open_nursery() as jobs:
            await jobs.start(runner.serve, client)
            conversation = (await store.create_conversation())["id"]
            with trio.fail_after(60):
                job = await runner.start(conversation, "In process?")
                await runner.wait(job)
            jobs.cancel_scope.cancel()
        row = await store.get_job(job)
        await store.aclose()
    assert row is not None
    assert row.status == "complete"
    assert [f["model"] for f in row.metadata["failed_members"]] == ["delta-unserved"]
    assert "delta-unserved" in row.metadata["failed_members"][0]["error"]
    programs = {r["program_id"] for r in query(db, "SELECT DISTINCT program_id FROM steps")}
    assert programs == council_programs(job, MODELS, MODELS[0], MODELS[1])
    released = query(db, "SELECT DISTINCT program_id FROM transitions WHERE to_status = 'stopped'")
    assert {r["program_id"] for r in released} == programs
