"""A shared proxy limits each client (``[limits.clients.<name>]``): a client over its own limit
gets 429 with Retry-After while another client's calls pass, and the refusal's row names the
client; a council job's member calls are the calls of the client that started it."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import query, running_proxy
from tests.fakebackend import FakeBackend
from tests.reliability.test_client_keys import ALICE, BOB, CHAT, bearer, write_config
from thunderproxy.config import load_settings
from thunderproxy.errors import ConfigError

LIMITS = """
[limits.clients.alice]
rpm = 2

[limits.classes.shared]
ratio = 1.0
max_wait = 0
"""


async def test_a_client_over_its_own_limit_gets_429_while_another_clients_calls_pass(
    backend: FakeBackend, tmp_path: Path
) -> None:
    db = tmp_path / "audit.db"
    async with (
        running_proxy(
            db, config=str(write_config(tmp_path, LIMITS)), backends=backend.url, datasette=False
        ) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=10) as client,
    ):
        statuses = []
        for key in (ALICE, ALICE, ALICE, BOB, BOB, BOB):
            r = await client.post("/v1/chat/completions", json=CHAT, headers=bearer(key))
            statuses.append(r.status_code)
            if r.status_code == 429:
                refused = r
        assert statuses == [200, 200, 429, 200, 200, 200]
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert "client alice" in refused.json()["error"]["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        health = (await client.get("/health")).json()
        assert health["admission"]["clients"]["alice"]["used"]["rpm"] == 2
    rows = query(db, "SELECT status, client FROM rejections")
    assert [(r["status"], r["client"]) for r in rows] == [(429, "alice")]
    steps = query(db, "SELECT client, count(*) AS n FROM steps GROUP BY client ORDER BY client")
    assert [(s["client"], s["n"]) for s in steps] == [("alice", 2), ("bob", 3)]
    rejected = query(
        db,
        "SELECT detail FROM decisions WHERE action = 'reject' AND rule LIKE 'admission.%'",
    )
    detail = json.loads(rejected[0]["detail"])
    assert (detail["client"], detail["limited_by"], detail["dimension"]) == (
        "alice",
        "client",
        "rpm",
    )


@pytest.mark.parametrize(
    ("clients", "says"),
    [
        pytest.param(True, "no configured client has this name; name one of: alice, bob", id="u"),
        pytest.param(False, "client limits need client keys", id="no-clients"),
    ],
)
def test_a_limit_for_no_configured_client_stops_with_the_remedy(
    tmp_path: Path, clients: bool, says: str
) -> None:
    section = "[limits.clients.carol]\nconcurrent = 2\n"
    config = write_config(tmp_path, section)
    if not clients:
        config.write_text(section)
    with pytest.raises(ConfigError, match=says):
        load_settings({"config": str(config), "backends": "http://b:1"})


async def test_a_council_job_records_its_client_on_its_member_steps(tmp_path: Path) -> None:
    from tests.council.helpers import ask_streaming, council_proxy, new_conversation, types

    db = tmp_path / "c.db"
    async with (
        council_proxy(db, config=str(write_config(tmp_path))) as (proxy, _sim),
        httpx.AsyncClient(base_url=proxy.url, timeout=30, headers=bearer(BOB)) as client,
    ):
        conversation = await new_conversation(client)
        events = await ask_streaming(client, conversation, "Which is larger, 3 or 4?")
        assert types(events)[-1] == "complete"
    steps = query(db, "SELECT program_id, client FROM steps")
    assert steps, "the council made no calls"
    assert all(s["program_id"].startswith("council:") for s in steps)
    assert {s["client"] for s in steps} == {"bob"}
    jobs = query(db, "SELECT client FROM council_jobs")
    assert [j["client"] for j in jobs] == ["bob"]
