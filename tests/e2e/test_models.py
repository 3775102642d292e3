"""Two backends serving two different models behind one proxy: calls go by model, /v1/models is
the union, an unknown model is refused as vLLM refuses it, and tr never moves a program to a
backend that does not serve its model."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.conftest import query, running_proxy
from tests.e2e.agents import agent
from thunderproxy.runtime import RunningProxy
from thunderproxy.sim import SimConfig, open_simulator

CODER, HELPER = "qwen-coder-32b", "llama-helper-8b"


@asynccontextmanager
async def two_models(
    db: Path, *, coder_kv: int = 64_000, **overrides: Any
) -> AsyncIterator[tuple[RunningProxy, str, str]]:
    coder_config = SimConfig(
        served_model_name=CODER,
        kv_capacity_tokens=coder_kv,
        enable_prompt_tokens_details=True,
        time_scale=0.02,
    )
    helper_config = SimConfig(
        served_model_name=HELPER, enable_prompt_tokens_details=True, time_scale=0.02
    )
    async with (
        open_simulator(coder_config) as coder,
        open_simulator(helper_config) as helper,
        running_proxy(db, backends=f"{coder.url},{helper.url}", **overrides) as proxy,
    ):
        yield proxy, coder.url, helper.url


def chat(model: str, program_id: str, text: str = "hello", **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "program_id": program_id,
        **extra,
    }


async def test_calls_go_to_the_backend_serving_their_model(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    async with (
        two_models(db) as (proxy, coder_url, helper_url),
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        for i in range(6):
            model = CODER if i % 2 == 0 else HELPER
            r = await client.post("/v1/chat/completions", json=chat(model, f"p{i}"))
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
        streamed = await client.post("/v1/chat/completions", json=chat(HELPER, "s1", stream=True))
        assert streamed.status_code == 200
        assert "[DONE]" in streamed.text

        models = (await client.get("/v1/models")).json()
        assert sorted(card["id"] for card in models["data"]) == sorted([CODER, HELPER])
        assert all(card["object"] == "model" for card in models["data"])
        programs = (await client.get("/programs")).json()
    rows = query(db, "select program_id, model, backend, status from steps order by id")
    assert len(rows) == 7
    for row in rows:
        assert row["status"] == 200
        assert row["backend"] == (coder_url if row["model"] == CODER else helper_url)
    assert {pid: p["backend"] for pid, p in programs.items()}["p1"] == helper_url


async def test_an_unknown_model_gets_vllms_404_and_leaves_no_program(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    async with (
        two_models(db) as (proxy, _, _),
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        r = await client.post("/v1/chat/completions", json=chat("gpt-17", "lost"))
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["type"] == "NotFoundError"
        assert error["param"] == "model"
        assert "`gpt-17` does not exist" in error["message"]
        assert CODER in error["message"]
        assert HELPER in error["message"]
        programs = (await client.get("/programs")).json()
        assert "lost" not in programs
    assert query(db, "select count(*) as n from steps")[0]["n"] == 0
    rejected = query(db, "select status, error_type, program_id from rejections")
    assert rejected == [{"status": 404, "error_type": "NotFoundError", "program_id": "lost"}]


async def coding_agent(client: httpx.AsyncClient, model: str, program_id: str, steps: int) -> None:
    await agent(
        client,
        program_id,
        model=model,
        system="You fix bugs. " * 80,
        task="make the test pass " * 200,
        observation="ok " * 300,
        steps=steps,
        tool_s=0.05,
    )


async def test_tr_never_moves_a_program_to_a_backend_without_its_model(tmp_path: Path) -> None:
    """The coder backend is oversubscribed and the helper one idle: tr pauses and resumes coder
    programs, and resumes them only on the coder backend."""
    db = tmp_path / "audit.db"
    async with (
        two_models(
            db,
            coder_kv=6_144,
            router="tr",
            metrics_interval=0.1,
            monitor_interval=0.05,
            pause_cooldown=0.05,
            resume_cooldown=0.05,
            decode_buffer=64,
            acting_half_life=1.0,
            max_wait=3.0,
        ) as (proxy, coder_url, helper_url),
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(6):
                    nursery.start_soon(coding_agent, client, CODER, f"coder-{i}", 3)
                nursery.start_soon(coding_agent, client, HELPER, "helper-0", 3)
    steps = query(db, "select program_id, backend, status from steps")
    assert {s["status"] for s in steps} == {200}
    assert {s["backend"] for s in steps if s["program_id"].startswith("coder")} == {coder_url}
    decisions = query(db, "select action, program_id, target_backend from decisions")
    actions = {d["action"] for d in decisions}
    assert actions & {"pause", "queue", "mark"}, "the coder backend was never under pressure"
    moved = [
        d
        for d in decisions
        if d["program_id"].startswith("coder") and d["target_backend"] not in (None, coder_url)
    ]
    assert moved == []


async def test_an_alias_from_the_config_file_reaches_its_served_model(tmp_path: Path) -> None:
    helper_config = SimConfig(served_model_name=HELPER, enable_prompt_tokens_details=True)
    async with open_simulator(helper_config) as helper:
        config = tmp_path / "thunderproxy.toml"
        config.write_text(
            f'[[backends]]\nurl = "{helper.url}"\n\n[aliases]\nsmall = ["{HELPER}"]\n'
        )
        db = tmp_path / "audit.db"
        async with (
            running_proxy(db, config=str(config)) as proxy,
            httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
        ):
            r = await client.post("/v1/chat/completions", json=chat("small", "aliased"))
            assert r.status_code == 200, r.text
            assert r.json()["model"] == HELPER  # what the backend answered, unchanged
            listed = {card["id"] for card in (await client.get("/v1/models")).json()["data"]}
            assert listed == {HELPER, "small"}
    rows = query(db, "select model, backend, status from steps")
    assert rows == [{"model": "small", "backend": helper.url, "status": 200}]
