"""Security: the admin token guards state changes, client credentials pass through untouched
and are never written down, secrets stay out of the audit db, which only its owner can read."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from tests.conftest import running_proxy
from thunderproxy.sim import SimConfig, open_simulator

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "program_id": "p"}
CLIENT_KEY = "sk-client-key-that-must-never-be-logged"
ADMIN = "admin-token-that-must-never-be-logged"


async def test_admin_token_guards_release_and_secrets_never_land_anywhere(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    db = tmp_path / "audit.db"
    config = SimConfig(api_key=CLIENT_KEY, output_len_dist="fixed:4")
    async with (
        open_simulator(config) as sim,
        running_proxy(db, backends=sim.url, admin_token=ADMIN) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        # The client's own credential reaches the backend unchanged (the simulator checks it).
        no_key = await client.post("/v1/chat/completions", json=CHAT)
        assert no_key.status_code == 401
        auth = {"Authorization": f"Bearer {CLIENT_KEY}"}
        assert (
            await client.post("/v1/chat/completions", json=CHAT, headers=auth)
        ).status_code == 200

        release = {"program_id": "p"}
        missing = await client.post("/programs/release", json=release)
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        wrong = await client.post(
            "/programs/release", json=release, headers={"Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 401
        assert "p" in (await client.get("/programs")).json()
        right = await client.post(
            "/programs/release", json=release, headers={"Authorization": f"Bearer {ADMIN}"}
        )
        assert right.json() == {"program_id": "p", "released": True}

    files = [f for f in tmp_path.iterdir() if f.name.startswith("audit.db")]  # noqa: ASYNC240
    stored = b"".join(f.read_bytes() for f in files)
    for secret in (CLIENT_KEY, ADMIN):
        assert secret.encode() not in stored
        assert secret not in caplog.text
    assert (db.stat().st_mode & 0o777) == 0o600


async def test_credentials_in_a_backend_url_reach_that_backend_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    db = tmp_path / "audit.db"
    password = "backend-password-that-must-never-be-shown"
    async with open_simulator(SimConfig(output_len_dist="fixed:4")) as sim:
        host = sim.url.removeprefix("http://")
        backend = f"http://operator:{password}@{host}"
        async with (
            running_proxy(db, backends=backend) as proxy,
            httpx.AsyncClient(base_url=proxy.url) as client,
        ):
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            for path in ("/health", "/metrics", "/programs", "/v1/models"):
                text = (await client.get(path)).text
                assert password not in text
                assert "operator" not in text
            assert sim.url in (await client.get("/health")).text
    stored = b"".join(
        f.read_bytes()
        for f in tmp_path.iterdir()  # noqa: ASYNC240
        if f.name.startswith("audit.db")
    )
    assert password.encode() not in stored
    assert b"operator" not in stored
    assert password not in caplog.text
