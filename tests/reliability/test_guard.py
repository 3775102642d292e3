"""The passthrough allow-list and the read guard: what an anonymous client can reach on a
backend through the proxy, and what it can learn from the proxy itself."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import query, running_proxy
from thunderproxy.config import load_settings
from thunderproxy.errors import ConfigError, Forbidden, Unauthorized
from thunderproxy.http.guard import (
    DEFAULT_PASSTHROUGH,
    PassthroughGuard,
    normalize_path,
    parse_prefixes,
    path_allowed,
)
from thunderproxy.sim import SimConfig, open_simulator

DEFAULT = parse_prefixes(",".join(DEFAULT_PASSTHROUGH))
ADMIN = "admin-secret"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"

#: vLLM's state-changing endpoints and the simulator's hooks: never relayed without the token.
STATE_CHANGING = [
    "/sleep",
    "/wake_up",
    "/reset_prefix_cache",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/collective_rpc",
    "/start_profile",
    "/stop_profile",
    "/_sim/reset",
    "/_sim/kill",
    "/_sim/config",
]


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("/v1/models", "/v1/models"),
        ("/v1/models/", "/v1/models"),
        ("//v1///models", "/v1/models"),
        ("/v1/models/../load_lora_adapter", "/v1/load_lora_adapter"),
        ("/v1/models/./x", "/v1/models/x"),
        ("/v1/models/%2e%2e/load_lora_adapter", "/v1/load_lora_adapter"),
        ("/v1/models/%252e%252e/load_lora_adapter", "/v1/load_lora_adapter"),
        ("/v1/models/..%2fload_lora_adapter", "/v1/load_lora_adapter"),
        ("/v1/models\\..\\load_lora_adapter", "/v1/load_lora_adapter"),
        ("/v1/models/..;/load_lora_adapter", "/v1/load_lora_adapter"),
        ("/../../sleep", "/sleep"),
        ("/%2F%2Fsleep", "/sleep"),
        ("/", "/"),
    ],
)
def test_paths_are_normalised_as_a_backend_would_route_them(raw: str, normal: str) -> None:
    assert normalize_path(raw) == normal


@pytest.mark.parametrize(
    "raw", ["/v1/models/%00", "/a\x01b", "/%25252525252e", "/v1/models/%ff%fe"]
)
def test_paths_no_honest_client_sends_have_no_normal_form(raw: str) -> None:
    assert normalize_path(raw) is None


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/x/y", "/v1/audio/transcriptions"])
def test_the_default_list_allows_the_read_only_api(path: str) -> None:
    assert path_allowed(path, DEFAULT)


@pytest.mark.parametrize("path", [*STATE_CHANGING, "/v1/models-admin", "/tokenizex", "/"])
def test_the_default_list_allows_no_state_change(path: str) -> None:
    assert not path_allowed(normalize_path(path) or "", DEFAULT)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/models/../load_lora_adapter",
        "/v1/models/%2e%2e/load_lora_adapter",
        "/v1/models/%252e%252e/%252e%252e/sleep",
        "/tokenize/..%2F..%2Fsleep",
        "/v1/models\\..\\..\\_sim\\kill",
        "/v1/models/..;/load_lora_adapter",
        "/v1/models/%00/../../sleep",
    ],
)
def test_bypass_attempts_are_refused_with_the_setting_named(path: str) -> None:
    with pytest.raises(Forbidden) as refused:
        PassthroughGuard(DEFAULT).check(path, None)
    message = refused.value.message
    assert "--passthrough" in message or "send a plain path" in message


def test_outside_the_list_the_admin_token_is_asked_for_when_one_is_set() -> None:
    guard = PassthroughGuard(DEFAULT, ADMIN)
    with pytest.raises(Unauthorized):
        guard.check("/sleep", None)
    with pytest.raises(Unauthorized):
        guard.check("/sleep", "Bearer wrong")
    assert guard.check("/v1/models/../../sleep", f"Bearer {ADMIN}") == "/sleep"
    assert guard.check("/v1/models", None) == "/v1/models"


def test_what_is_forwarded_is_what_was_checked() -> None:
    guard = PassthroughGuard(DEFAULT)
    assert guard.check("/v1/models/org%2Fname/", None) == "/v1/models/org/name/"
    assert guard.check("/v1/models/100%25 sure", None) == "/v1/models/100%25%20sure"
    assert PassthroughGuard(("*",)).check("/a/../b", None) == "/b"


@pytest.mark.parametrize("value", ["v1/models", "/ok,nope"])
def test_a_prefix_that_is_not_a_path_is_refused_at_startup(value: str) -> None:
    with pytest.raises(ConfigError, match="--passthrough"):
        load_settings(passthrough=value)


def test_protect_reads_without_a_token_is_refused_at_startup() -> None:
    with pytest.raises(ConfigError, match="--admin-token"):
        load_settings(protect_reads=True)


async def test_state_changing_backend_paths_are_refused_through_the_proxy(
    tmp_path: Path,
) -> None:
    db = tmp_path / "audit.db"
    config = SimConfig(dev_mode=True, output_len_dist="fixed:4")
    async with (
        open_simulator(config) as sim,
        running_proxy(db, backends=sim.url) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        for path in STATE_CHANGING:
            refused = await client.post(path, json={})
            assert refused.status_code == 403, path
            error = refused.json()["error"]
            assert error["type"] == "permission_error"
            assert "--passthrough" in error["message"]
        # The engine never saw any of them: still awake, cache untouched.
        assert (await client.get(f"{sim.url}/is_sleeping")).json() == {"is_sleeping": False}
        # Raw (unnormalised) request targets, as an attacker would send them.
        for raw in ("/v1/models/%2e%2e/load_lora_adapter", "/v1/models/%252e%252e/..%2fsleep"):
            response = await client.send(client.build_request("POST", raw, json={}))
            assert response.status_code in (403, 404), raw
            assert sim.engine.sleeping is False
        tokenize = await client.post("/tokenize", json={"model": MODEL, "prompt": "hello"})
        assert tokenize.status_code == 200
        assert (await client.get("/v1/models")).status_code == 200
    refusals = query(db, "select status, path from rejections where status = 403")
    assert len(refusals) == len(STATE_CHANGING) + 2


async def test_the_admin_token_opens_other_paths_and_is_not_forwarded(tmp_path: Path) -> None:
    config = SimConfig(dev_mode=True, output_len_dist="fixed:4")
    async with (
        open_simulator(config) as sim,
        running_proxy(tmp_path / "audit.db", backends=sim.url, admin_token=ADMIN) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        assert (await client.post("/sleep")).status_code == 401
        assert sim.engine.sleeping is False
        admin = {"Authorization": f"Bearer {ADMIN}"}
        assert (await client.post("/sleep", headers=admin)).status_code == 200
        assert sim.engine.sleeping is True
        assert (await client.post("/wake_up", headers=admin)).status_code == 200
        assert sim.engine.sleeping is False


async def test_protect_reads_hides_the_listings_but_not_the_health_status(
    tmp_path: Path,
) -> None:
    pid = "program-nobody-should-see"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "program_id": pid}
    async with (
        open_simulator(SimConfig(output_len_dist="fixed:4")) as sim,
        running_proxy(
            tmp_path / "audit.db", backends=sim.url, admin_token=ADMIN, protect_reads=True
        ) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        for path in ("/programs", "/profiles", f"/profiles/{pid}", "/metrics"):
            refused = await client.get(path)
            assert refused.status_code == 401, path
            assert pid not in refused.text.replace(path, "")
        assert (await client.get("/health")).json() == {"status": "ok"}
        admin = {"Authorization": f"Bearer {ADMIN}"}
        assert pid in (await client.get("/programs", headers=admin)).json()
        assert (await client.get(f"/profiles/{pid}", headers=admin)).status_code == 200
        assert (await client.get("/metrics", headers=admin)).status_code == 200
        detail = (await client.get("/health", headers=admin)).json()
        assert detail["programs_count"] == 1
