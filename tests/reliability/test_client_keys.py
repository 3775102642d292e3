"""Client keys (``[clients]``): a shared proxy serves only its configured clients, scopes each
client's program ids by its name, records the client on every step and rejection, counts its
council jobs by it, and never hands a client's key to a backend that is not set to receive it.

Before: no keys at all. Any caller could send calls under another client's ``program_id`` (the
proxy paused the victim's program for the attacker's calls and recorded them as the victim's),
the council's per-client cap counted source addresses, and the client's ``Authorization`` went
to every backend."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import query, running_proxy
from tests.fakebackend import FakeBackend
from thunderproxy.config import load_settings
from thunderproxy.config.clients import ClientsSpec, key_digest
from thunderproxy.errors import ConfigError
from thunderproxy.runtime import RunningProxy

ALICE = "tp-alice-key-0123456789"
BOB = "tp-bob-key-9876543210"
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hello there"}]}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def write_config(folder: Path, extra: str = "") -> Path:
    path = folder / "shared.toml"
    path.write_text(
        f'[clients.keys]\nalice = "{key_digest(ALICE)}"\nbob = ["{key_digest(BOB)}"]\n' + extra
    )
    return path


# --- the section ----------------------------------------------------------------------------


def test_the_section_keeps_names_and_digests_never_a_key(tmp_path: Path) -> None:
    settings = load_settings({"config": str(write_config(tmp_path)), "backends": "http://b:1"})
    assert settings.clients is not None
    assert settings.clients.names == ("alice", "bob")
    assert settings.clients.client_of(ALICE) == "alice"
    assert settings.clients.client_of(BOB) == "bob"
    assert settings.clients.client_of("tp-guess") is None
    stored = json.dumps(settings.public())
    assert ALICE not in stored
    assert key_digest(ALICE) not in stored
    assert settings.public()["clients"]["clients"] == ["alice", "bob"]


def test_a_keys_file_beside_the_config(tmp_path: Path) -> None:
    (tmp_path / "clients.keys").write_text(
        f"# team keys\nalice {key_digest(ALICE)}\n\nbob {key_digest(BOB)}  # rotated 2025\n"
    )
    config = tmp_path / "shared.toml"
    config.write_text('[clients]\nkeys_file = "clients.keys"\n')
    settings = load_settings({"config": str(config), "backends": "http://b:1"})
    assert settings.clients is not None
    assert settings.clients.client_of(BOB) == "bob"


@pytest.mark.parametrize(
    ("section", "says"),
    [
        pytest.param(f'[clients.keys]\nalice = "{ALICE}"\n', "never be written here", id="clear"),
        pytest.param('[clients.keys]\nalice = "sha256:12"\n', "64 hex digits", id="short"),
        pytest.param(
            f'[clients.keys]\n"a:b" = "{key_digest(ALICE)}"\n', "usable client name", id="name"
        ),
        pytest.param(
            f'[clients.keys]\nalice = "{key_digest(ALICE)}"\nbob = "{key_digest(ALICE)}"\n',
            "already 'alice'",
            id="shared-key",
        ),
        pytest.param("[clients]\n", "names no client", id="empty"),
        pytest.param(f'[clients]\nkey = "{key_digest(ALICE)}"\n', "clients go under", id="unknown"),
        pytest.param(
            f'[clients]\nforward_key_to = ["gpu9"]\n[clients.keys]\na = "{key_digest(ALICE)}"\n',
            "no configured backend",
            id="forward-unknown",
        ),
    ],
)
def test_a_bad_section_stops_with_the_key_and_the_remedy(
    tmp_path: Path, section: str, says: str
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(section)
    with pytest.raises(ConfigError, match=says):
        load_settings({"config": str(config), "backends": "http://b:1"})


# --- the edge -------------------------------------------------------------------------------


@asynccontextmanager
async def shared_proxy(backend: FakeBackend, tmp_path: Path) -> AsyncIterator[RunningProxy]:
    """Two clients in front of ``backend``; the audit db is whole once the block is left."""
    async with running_proxy(
        tmp_path / "audit.db",
        config=str(write_config(tmp_path)),
        backends=backend.url,
        passthrough="/v1/models,/echo",
        datasette=False,
    ) as proxy:
        yield proxy


@pytest.mark.parametrize(
    ("path", "body", "shape"),
    [
        ("/v1/chat/completions", CHAT, "openai"),
        ("/v1/completions", {"model": "fake", "prompt": "hi"}, "openai"),
        ("/v1/messages", {**CHAT, "max_tokens": 8}, "anthropic"),
        ("/v1/responses", {"model": "fake", "input": "hi"}, "openai"),
        ("/v1/messages/count_tokens", CHAT, "anthropic"),
        ("/echo/x", {"a": 1}, "openai"),
    ],
    ids=["chat", "completions", "messages", "responses", "count_tokens", "passthrough"],
)
@pytest.mark.parametrize("key", [None, "tp-not-a-client"], ids=["no-key", "wrong-key"])
async def test_a_call_without_a_clients_key_is_401_in_its_routes_shape(
    backend: FakeBackend,
    tmp_path: Path,
    path: str,
    body: dict[str, Any],
    shape: str,
    key: str | None,
) -> None:
    async with (
        shared_proxy(backend, tmp_path) as shared,
        httpx.AsyncClient(base_url=shared.url, timeout=10) as client,
    ):
        headers = {} if key is None else {"x-api-key": key}
        r = await client.post(path, json={**body, "program_id": "p"}, headers=headers)
        assert r.status_code == 401, r.text
        error = r.json()
        if shape == "anthropic":
            assert error["type"] == "error"
            assert error["error"]["type"] == "authentication_error"
        else:
            assert error["error"]["type"] == "authentication_error"
            assert error["error"]["code"] == 401
        message = error["error"]["message"]
        assert "Authorization: Bearer <key>" in message
        assert ("no configured client's" in message) == (key is not None)
        # The connection stays usable: the body was read before the refusal.
        assert (await client.get("/health")).status_code == 200
        listed = await client.get("/v1/models")
        assert listed.status_code == 401
    assert backend.received == []
    assert backend.headers == []
    rows = query(tmp_path / "audit.db", "SELECT * FROM rejections WHERE path = ?", path)
    assert [(r["status"], r["client"]) for r in rows] == [(401, None)]


async def test_each_clients_program_is_its_own_and_steps_name_the_client(
    backend: FakeBackend, tmp_path: Path
) -> None:
    async with (
        shared_proxy(backend, tmp_path) as shared,
        httpx.AsyncClient(base_url=shared.url, timeout=10) as client,
    ):
        body = {**CHAT, "program_id": "task-42"}
        first = await client.post("/v1/chat/completions", json=body, headers=bearer(ALICE))
        assert first.is_success
        # The same id from bob, with the key as the Anthropic SDK sends it.
        bob = {"x-api-key": BOB}
        assert (await client.post("/v1/chat/completions", json=body, headers=bob)).is_success
        assert (await client.post("/v1/chat/completions", json=body, headers=bob)).is_success
        programs = (await client.get("/programs")).json()
        assert {p: v["step_count"] for p, v in programs.items()} == {
            "alice:task-42": 1,
            "bob:task-42": 2,
        }
        # A client releases its own program only: bob's release leaves alice's.
        released = await client.post(
            "/programs/release", json={"program_id": "task-42"}, headers=bob
        )
        assert released.status_code == 200
        assert set((await client.get("/programs")).json()) == {"alice:task-42"}
        unauthorised = await client.post("/programs/release", json={"program_id": "task-42"})
        assert unauthorised.status_code == 401
        # A refusal after the key was checked names the client.
        bad = await client.post("/v1/chat/completions", json={"model": 1}, headers=bob)
        assert bad.status_code == 400
    # Neither key reached the backend, nor any header that could carry one.
    assert len(backend.headers) == 3
    for sent in backend.headers:
        names = {name.lower() for name in sent}
        assert not names & {"authorization", "x-api-key"}, sent
    assert [h["X-Request-Id"] for h in backend.headers] == [
        "alice:task-42-1",
        "bob:task-42-1",
        "bob:task-42-2",
    ]
    db = tmp_path / "audit.db"
    steps = query(db, "SELECT program_id, client FROM steps ORDER BY id")
    assert steps == [
        {"program_id": "alice:task-42", "client": "alice"},
        {"program_id": "bob:task-42", "client": "bob"},
        {"program_id": "bob:task-42", "client": "bob"},
    ]
    rejected = query(db, "SELECT status, client FROM rejections ORDER BY id")
    assert rejected == [{"status": 401, "client": None}, {"status": 400, "client": "bob"}]


async def test_prompt_recognition_never_crosses_clients(
    backend: FakeBackend, tmp_path: Path
) -> None:
    """A call that continues another client's conversation (same prompt, its answer, a next
    turn) starts a program of the caller's, not one of the other client's."""
    async with (
        shared_proxy(backend, tmp_path) as shared,
        httpx.AsyncClient(base_url=shared.url, timeout=10) as client,
    ):
        first = await client.post("/v1/chat/completions", json=CHAT, headers=bearer(ALICE))
        answer = first.json()["choices"][0]["message"]
        follow = {
            **CHAT,
            "messages": [*CHAT["messages"], answer, {"role": "user", "content": "go on"}],
        }
        for key in (ALICE, BOB):
            r = await client.post("/v1/chat/completions", json=follow, headers=bearer(key))
            assert r.status_code == 200
        programs = (await client.get("/programs")).json()
    by_client: dict[str, int] = {}
    for program_id, view in programs.items():
        owner = program_id.split(":", 1)[0]
        by_client[owner] = by_client.get(owner, 0) + view["step_count"]
    assert by_client == {"alice": 2, "bob": 1}
    assert len(programs) == 2


async def test_a_backend_set_to_receive_it_gets_the_clients_key(
    backend: FakeBackend, tmp_path: Path
) -> None:
    config = write_config(tmp_path, f'\n[clients]\nforward_key_to = ["{backend_placeholder()}"]\n')
    config.write_text(config.read_text().replace(backend_placeholder(), backend.url))
    async with (
        running_proxy(
            tmp_path / "a.db", config=str(config), backends=backend.url, datasette=False
        ) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=10) as client,
    ):
        r = await client.post("/v1/chat/completions", json=CHAT, headers=bearer(ALICE))
        assert r.status_code == 200
    assert backend.headers[-1]["Authorization"] == f"Bearer {ALICE}"


def backend_placeholder() -> str:
    return "http://placeholder.invalid:1"


def test_the_spec_of_forwarding_is_matched_by_shown_url() -> None:
    spec = ClientsSpec((("sha256:" + "0" * 64, "a"),), forward_key_to=("gpu0",))
    backends = [("http://u:p@h:1", "gpu0"), ("http://other:2", None)]
    assert spec.receiving(backends) == frozenset({"http://h:1"})


async def test_council_jobs_count_the_client_not_its_address(tmp_path: Path) -> None:
    """Both clients call from 127.0.0.1: before, the per-client cap counted that address, so
    one client's job refused the other's (and one client with several addresses took all)."""
    from tests.council.helpers import council_proxy, new_conversation, sim_config

    slow = sim_config(time_scale=1.0, output_len_dist="fixed:4000")
    async with (
        council_proxy(
            tmp_path / "c.db",
            sim=slow,
            config=str(write_config(tmp_path)),
            council_max_jobs_per_client=1,
        ) as (proxy, _sim),
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        assert (await client.post("/council/api/conversations")).status_code == 401
        statuses = []
        for key in (ALICE, ALICE, BOB):
            client.headers.update(bearer(key))
            conversation = await new_conversation(client)
            url = f"/council/api/conversations/{conversation}/message/stream"
            async with client.stream("POST", url, json={"content": "Long one"}) as r:
                statuses.append(r.status_code)
                if r.status_code != 200:
                    assert "Client alice has 1" in json.loads(await r.aread())["error"]["message"]
        assert statuses == [200, 429, 200]
