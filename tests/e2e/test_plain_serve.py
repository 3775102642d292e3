"""A plain ``serve`` (no backends, no flags but where to listen and write) is a backend a coding
agent can use as it is: its embedded simulator takes a first call as long as Claude Code's,
reports the prefix cache's hits in Anthropic's shape so that they land in the audit log, and
the root answers the probes clients send at start without a rejection."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from thunderproxy import __version__

from ..conftest import query, running_proxy

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def long_system_prompt(words: int) -> str:
    # A four-letter word and a space are two tokens of the simulator's tokenizer.
    return " ".join(f"w{i % 997:03d}" for i in range(words))


def messages_call(system: str, question: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 8,
        "system": system,
        "messages": [{"role": "user", "content": question}],
    }


async def test_a_plain_serve_takes_a_40k_token_messages_call_and_records_its_cache_reads(
    tmp_path: Path,
) -> None:
    db = tmp_path / "audit.db"
    system = long_system_prompt(20_500)
    headers = {"x-claude-code-session-id": "one-session"}
    async with (
        running_proxy(db, shutdown_grace=1.0) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=60.0) as client,
    ):
        with trio.fail_after(120):
            first = await client.post(
                "/v1/messages", json=messages_call(system, "hello"), headers=headers
            )
            assert first.status_code == 200, first.text
            usage = first.json()["usage"]
            assert usage["input_tokens"] >= 40_000
            assert usage["cache_read_input_tokens"] == 0
            second = await client.post(
                "/v1/messages", json=messages_call(system, "and again"), headers=headers
            )
            assert second.status_code == 200, second.text
            assert first.json()["id"].startswith("msg_")
    read = second.json()["usage"]["cache_read_input_tokens"]
    assert read >= 40_000
    steps = query(db, "SELECT program_id, prompt_tokens, cached_tokens FROM steps ORDER BY id")
    assert len(steps) == 2, steps
    assert steps[0]["program_id"] == steps[1]["program_id"], steps
    assert steps[0]["prompt_tokens"] == usage["input_tokens"]
    assert steps[0]["cached_tokens"] == 0
    assert steps[1]["cached_tokens"] == read
    assert steps[1]["prompt_tokens"] == read + second.json()["usage"]["input_tokens"]


async def test_the_root_describes_the_proxy_and_records_no_rejection(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    async with (
        running_proxy(db, shutdown_grace=1.0, datasette=False) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=10.0) as client,
    ):
        head = await client.head("/")
        got = await client.get("/")
        other = await client.get("/nothing-here")
    assert head.status_code == 200
    assert head.headers["content-type"] == "application/json"
    assert got.status_code == 200
    about = got.json()
    assert (about["name"], about["version"]) == ("thunderproxy", __version__)
    assert about["openai_base_url"] == proxy.url + "/v1"
    assert about["anthropic_base_url"] == proxy.url
    # Any other unknown path is still refused and recorded, as before.
    assert other.status_code == 403
    rejected = query(db, "SELECT method, path FROM rejections")
    assert rejected == [{"method": "GET", "path": "/nothing-here"}], rejected


async def test_claude_codes_own_model_name_and_an_empty_tools_list_are_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Claude Code asks for its own model (``claude-opus-4-8``) with ``tools: []`` on its small
    calls: a plain serve sends it to the one model it serves, says so at startup and once for
    the name, and records both names on each step."""
    caplog.set_level(logging.INFO, "thunderproxy")
    db = tmp_path / "audit.db"
    body = {
        "model": "claude-opus-4-8",
        "max_tokens": 8,
        "tools": [],
        "messages": [{"role": "user", "content": "Name this conversation."}],
    }
    async with (
        running_proxy(db, shutdown_grace=1.0, datasette=False) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=60.0) as client,
    ):
        for stream in (False, True):
            answer = await client.post("/v1/messages", json={**body, "stream": stream})
            assert answer.status_code == 200, answer.text
        counted = await client.post(
            "/v1/messages/count_tokens", json={k: body[k] for k in ("model", "messages")}
        )
        assert counted.status_code == 200, counted.text
    steps = query(db, "SELECT model, served_model, status FROM steps ORDER BY id")
    assert steps == [{"model": "claude-opus-4-8", "served_model": MODEL, "status": 200}] * 2
    assert query(db, "SELECT path, status FROM rejections") == []
    lines = [r.getMessage() for r in caplog.records]
    started = [line for line in lines if "listening on" in line]
    assert len(started) == 1, lines
    assert started[0].endswith(
        f"; calls naming a model no backend serves go to {MODEL!r} (the only model served)"
    )
    routed = [line for line in lines if "is served by no backend" in line]
    assert len(routed) == 1, routed
    assert f"'claude-opus-4-8' is served by no backend; its calls go to {MODEL!r}" in routed[0]
