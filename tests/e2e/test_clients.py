"""Unmodified clients against a real proxy (``runtime.run`` on loopback) in front of the
simulator: the official Anthropic and OpenAI SDKs and LiteLLM, streamed and not, with tools.
Each call must be scheduled and audited with its usage (the ``steps`` rows), and agents that
name no program must each be recognised as one program per task, none merged.

The SDKs' synchronous clients run in a worker thread so the proxy and simulator keep the trio
loop; LiteLLM's async client runs on its own asyncio loop in a thread.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import anthropic
import httpx
import openai
import pytest
import trio

from thunderproxy.config import load_settings
from thunderproxy.errors import ConfigError
from thunderproxy.runtime import RunningProxy
from thunderproxy.sim import SimConfig, Simulator, open_simulator

from ..conftest import query, running_proxy
from ..sim.helpers import SMALL
from ..sim.test_sim_http import MODEL
from ..sim.test_sim_tools import ALWAYS, SHELL

T = TypeVar("T")
SYSTEM = "You are a coding agent. Use the bash tool to finish the task."
TASKS = ["Find the failing test.", "Count the Python files.", "Rename the module."]
TURNS = 3
CHAT_TOOLS: Any = [{"type": "function", "function": {"name": "bash", "parameters": SHELL}}]
MESSAGES_TOOLS: Any = [{"name": "bash", "description": "Run a command", "input_schema": SHELL}]
RESPONSES_TOOLS: Any = [{"type": "function", "name": "bash", "parameters": SHELL, "strict": False}]


@dataclass
class Setup:
    sim: Simulator
    proxy: RunningProxy
    db: Path

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.proxy.url + "/v1", api_key="unused", max_retries=0)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.proxy.url, api_key="unused", max_retries=0)


@asynccontextmanager
async def proxy_on_sim(tmp_path: Path, **overrides: Any) -> AsyncIterator[Setup]:
    """The simulator (a tool call every turn) behind a real proxy; the audit db is flushed when
    the block ends, so rows are read after it."""
    config = SimConfig(**{**SMALL, "time_scale": 0.01, **ALWAYS})  # type: ignore[arg-type]
    db = tmp_path / "audit.db"
    async with (
        open_simulator(config) as sim,
        running_proxy(db, backends=sim.url, **overrides) as proxy,
    ):
        yield Setup(sim, proxy, db)


async def in_thread(fn: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(fn)


def steps(db: Path) -> list[dict[str, Any]]:
    return query(db, "SELECT * FROM steps ORDER BY id")


def assert_audited(rows: list[dict[str, Any]], endpoint: str, *, calls: int) -> None:
    """``calls`` successful steps at ``endpoint``, each with its token counts."""
    mine = [r for r in rows if r["endpoint"] == endpoint]
    assert len(mine) == calls, mine
    for row in mine:
        assert row["status"] == 200, row
        assert (row["prompt_tokens"] or 0) > 0, row
        assert (row["completion_tokens"] or 0) > 0, row
        if row["stream"]:
            assert row["first_token_at"] is not None, row


# --- each client, each protocol ----------------------------------------------------------------


async def test_anthropic_sdk_messages_with_tools(tmp_path: Path) -> None:
    # One model served sends every other name to it: 'none' keeps the gateway's 404 to check.
    async with proxy_on_sim(tmp_path, default_model="none") as setup:
        with setup.anthropic() as client:
            message = [{"role": "user", "content": "List the files."}]

            def plain() -> Any:
                return client.messages.create(
                    model=MODEL, max_tokens=128, system=SYSTEM, messages=message,
                    tools=MESSAGES_TOOLS, extra_headers={"X-Program-Id": "anthropic-plain"},
                )  # fmt: skip

            def streamed() -> Any:
                with client.messages.stream(
                    model=MODEL, max_tokens=128, system=SYSTEM, messages=message,
                    tools=MESSAGES_TOOLS, extra_headers={"X-Program-Id": "anthropic-stream"},
                ) as stream:  # fmt: skip
                    return stream.get_final_message()

            def counted() -> Any:
                return client.messages.count_tokens(model=MODEL, messages=message)

            def unknown_model() -> Any:
                return client.messages.create(model="no-such-model", max_tokens=8, messages=message)

            first = await in_thread(plain)
            assert any(block.type == "tool_use" for block in first.content)
            assert first.usage.output_tokens > 0
            second = await in_thread(streamed)
            assert any(block.type == "tool_use" for block in second.content)
            counted_tokens = await in_thread(counted)
            assert counted_tokens.input_tokens > 0
            # The gateway's own refusal, in Anthropic's error shape the SDK reads.
            with pytest.raises(anthropic.NotFoundError) as refused:
                await in_thread(unknown_model)
            assert refused.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
            assert "no-such-model" in refused.value.message
    rows = steps(setup.db)
    assert_audited(rows, "/v1/messages", calls=2)
    assert {r["program_id"] for r in rows} == {"anthropic-plain", "anthropic-stream"}
    assert [r["stream"] for r in rows] == [0, 1]
    rejected = query(setup.db, "SELECT path, status FROM rejections")
    assert rejected == [{"path": "/v1/messages", "status": 404}]


async def test_openai_sdk_chat_completions_and_responses(tmp_path: Path) -> None:
    async with proxy_on_sim(tmp_path) as setup:
        with setup.openai() as client:
            chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Go."}]

            def chat_plain() -> Any:
                return client.chat.completions.create(
                    model=MODEL,
                    messages=chat,
                    tools=CHAT_TOOLS,
                    max_tokens=128,  # type: ignore[arg-type]
                )

            def chat_streamed() -> Any:
                with client.chat.completions.stream(
                    model=MODEL,
                    messages=chat,
                    tools=CHAT_TOOLS,
                    max_tokens=128,  # type: ignore[arg-type]
                ) as stream:
                    for _ in stream:
                        pass
                    return stream.get_final_completion()

            def completion_plain() -> Any:
                return client.completions.create(model=MODEL, prompt="def main():", max_tokens=8)

            def completion_streamed() -> list[Any]:
                return list(
                    client.completions.create(
                        model=MODEL, prompt="def main():", max_tokens=8, stream=True
                    )
                )

            def responses_plain() -> Any:
                return client.responses.create(
                    model=MODEL, instructions=SYSTEM, input="Go.", tools=RESPONSES_TOOLS
                )

            def responses_streamed() -> Any:
                with client.responses.stream(
                    model=MODEL, instructions=SYSTEM, input="Go.", tools=RESPONSES_TOOLS
                ) as stream:
                    for _ in stream:
                        pass
                    return stream.get_final_response()

            plain = await in_thread(chat_plain)
            assert plain.choices[0].message.tool_calls
            streamed = await in_thread(chat_streamed)
            assert streamed.choices[0].message.tool_calls
            # The client did not ask for the usage chunk: the proxy asked for it, and hid it.
            assert streamed.usage is None
            assert (await in_thread(completion_plain)).usage.completion_tokens > 0
            assert "".join(c.choices[0].text for c in await in_thread(completion_streamed))
            answered = await in_thread(responses_plain)
            assert any(item.type == "function_call" for item in answered.output)
            final = await in_thread(responses_streamed)
            assert final.usage is not None
            assert final.usage.output_tokens > 0
    rows = steps(setup.db)
    assert_audited(rows, "/v1/chat/completions", calls=2)
    assert_audited(rows, "/v1/completions", calls=2)
    assert_audited(rows, "/v1/responses", calls=2)
    for endpoint in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        assert [r["stream"] for r in rows if r["endpoint"] == endpoint] == [0, 1]


#: LiteLLM, and ``mcp``: LiteLLM (1.106) imports it whenever a call passes tools, yet does not
#: depend on it.
LITELLM_PACKAGES = ("litellm", "mcp")


def litellm_module(cache: Path) -> ModuleType:
    """LiteLLM, installed with pip into a folder of its own when the environment lacks it
    (it is large, so it is not a test dependency). Skips, saying why, if it cannot install."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
    # A streamed answer's tokens are counted with the model's tokenizer, which LiteLLM would try
    # to download for a llama name; offline it falls back at once instead of timing out.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        importlib.import_module("mcp")
        return importlib.import_module("litellm")
    except ImportError:
        pass
    target = cache / "litellm-site"
    if not (target / "litellm").exists():
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target)]
            + list(LITELLM_PACKAGES),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            why = done.stderr[-500:]
            pytest.skip(f"litellm is not installed and pip could not install it: {why}")
    sys.path.append(str(target))  # after the environment's own packages, which win
    return importlib.import_module("litellm")


# Slow: unless LiteLLM is installed, it pip-installs it (and its dependencies) into the test's
# temporary folder first, minutes and a network the default suite does without (`pytest -m slow`).
@pytest.mark.slow
async def test_litellm_completion_and_acompletion(tmp_path: Path) -> None:
    litellm = await in_thread(lambda: litellm_module(tmp_path))
    # LiteLLM keeps its connections open: the proxy need not wait long for them at the end.
    async with proxy_on_sim(tmp_path, shutdown_grace=1.0) as setup:
        common: dict[str, Any] = {
            # "openai/" makes LiteLLM speak the OpenAI API to api_base, as to any vLLM.
            "model": "openai/" + MODEL,
            "api_base": setup.proxy.url + "/v1",
            "api_key": "unused",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Go."}],
            "tools": CHAT_TOOLS,
            "max_tokens": 128,
            "num_retries": 0,
        }

        def sync_call() -> Any:
            return litellm.completion(**common, extra_body={"program_id": "litellm-sync"})

        async def streamed() -> list[Any]:
            chunks = await litellm.acompletion(
                **common, stream=True, extra_body={"program_id": "litellm-async"}
            )
            return [chunk async for chunk in chunks]

        answer = await in_thread(sync_call)
        assert answer.choices[0].message.tool_calls
        assert answer.usage.completion_tokens > 0

        def run_streamed() -> list[Any]:
            # asyncio's own loop: the proxy's Datasette mount installs trio-asyncio's policy.
            with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
                return runner.run(streamed())

        chunks = await in_thread(run_streamed)
        assert chunks
    rows = steps(setup.db)
    assert_audited(rows, "/v1/chat/completions", calls=2)
    assert [(r["program_id"], r["stream"]) for r in rows] == [
        ("litellm-sync", 0),
        ("litellm-async", 1),
    ]


# --- agents that name no program ----------------------------------------------------------------


def programs_of(db: Path, endpoint: str) -> dict[str, list[int]]:
    """Each program's step numbers at ``endpoint``, in the order they ran."""
    found: dict[str, list[int]] = {}
    for row in query(
        db, "SELECT program_id, step FROM steps WHERE endpoint = ? ORDER BY id", endpoint
    ):
        found.setdefault(row["program_id"], []).append(row["step"])
    return found


def assert_one_program_per_task(
    db: Path, endpoint: str, later: frozenset[str] = frozenset({"prefix"})
) -> None:
    """One program per task, and every step says how it was tied to it: its first call
    ``new``, each later one by one of ``later`` with the messages that matched."""
    programs = programs_of(db, endpoint)
    # Merged tasks would make one program of more steps; a task split would make more programs.
    assert len(programs) == len(TASKS), programs
    assert all(numbers == list(range(1, TURNS + 1)) for numbers in programs.values()), programs
    sources = query(
        db, "SELECT program_id, source FROM transitions WHERE source IS NOT NULL ORDER BY id"
    )
    assert {r["program_id"]: r["source"] for r in sources} == dict.fromkeys(programs, "new")
    assert all(r["status"] == 200 for r in query(db, "SELECT status FROM steps"))
    for row in query(db, "SELECT step, source, matched_messages FROM steps WHERE endpoint = ?",
                     endpoint):  # fmt: skip
        if row["step"] == 1:
            assert (row["source"], row["matched_messages"]) == ("new", None), row
        else:
            assert row["source"] in later, row
            assert row["matched_messages"] >= 2, row


async def test_chat_agents_without_program_ids_are_one_program_per_task(tmp_path: Path) -> None:
    async with proxy_on_sim(tmp_path) as setup:
        histories: list[list[Any]] = [
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
            for task in TASKS
        ]
        with setup.openai() as client:
            for turn in range(TURNS):
                for messages in histories:
                    stream = turn % 2 == 1

                    def call(messages: list[Any] = messages, stream: bool = stream) -> Any:
                        if not stream:
                            return client.chat.completions.create(
                                model=MODEL, messages=messages, tools=CHAT_TOOLS, max_tokens=128
                            )
                        with client.chat.completions.stream(
                            model=MODEL, messages=messages, tools=CHAT_TOOLS, max_tokens=128
                        ) as events:
                            for _ in events:
                                pass
                            return events.get_final_completion()

                    message = (await in_thread(call)).choices[0].message
                    calls = message.tool_calls or []
                    messages.append(message.model_dump(exclude_none=True))
                    messages += [
                        {"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in calls
                    ]
        async with httpx.AsyncClient(base_url=setup.proxy.url) as http:
            listed = (await http.get("/programs")).json()
        assert sorted(p["source"] for p in listed.values()) == ["new"] * len(TASKS)
    assert_one_program_per_task(setup.db, "/v1/chat/completions")


async def test_agents_that_drop_replies_without_a_tool_call_stay_one_program(
    tmp_path: Path,
) -> None:
    """mini-swe-agent's way (LiteLLM underneath): a reply without a tool call is dropped from
    the history and a user message saying so is appended, so the next prompt continues the
    previous *prompt*. Here every second reply is treated so, whatever it held."""
    async with proxy_on_sim(tmp_path) as setup:
        histories: list[list[Any]] = [
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
            for task in TASKS
        ]
        with setup.openai() as client:
            for turn in range(TURNS):
                for messages in histories:

                    def call(messages: list[Any] = messages) -> Any:
                        return client.chat.completions.create(
                            model=MODEL, messages=messages, tools=CHAT_TOOLS, max_tokens=128
                        )

                    message = (await in_thread(call)).choices[0].message
                    if turn % 2 == 0:
                        messages.append(
                            {"role": "user", "content": "Tool call error: exactly one action."}
                        )
                        continue
                    messages.append(message.model_dump(exclude_none=True))
                    messages += [
                        {"role": "tool", "tool_call_id": c.id, "content": "ok"}
                        for c in message.tool_calls or []
                    ]
    assert_one_program_per_task(
        setup.db, "/v1/chat/completions", later=frozenset({"prompt_prefix", "prefix"})
    )
    dropped = query(setup.db, "SELECT count(*) AS n FROM steps WHERE source = 'prompt_prefix'")
    assert dropped == [{"n": len(TASKS)}]


async def test_messages_agents_without_program_ids_are_one_program_per_task(
    tmp_path: Path,
) -> None:
    async with proxy_on_sim(tmp_path) as setup:
        histories: list[list[Any]] = [[{"role": "user", "content": task}] for task in TASKS]
        with setup.anthropic() as client:
            for turn in range(TURNS):
                for messages in histories:
                    stream = turn % 2 == 0

                    def call(messages: list[Any] = messages, stream: bool = stream) -> Any:
                        kwargs: Any = {
                            "model": MODEL,
                            "max_tokens": 128,
                            "system": SYSTEM,
                            "messages": messages,
                            "tools": MESSAGES_TOOLS,
                        }
                        if not stream:
                            return client.messages.create(**kwargs)
                        with client.messages.stream(**kwargs) as events:
                            return events.get_final_message()

                    final = await in_thread(call)
                    messages.append({"role": "assistant", "content": final.content})
                    uses = [b for b in final.content if b.type == "tool_use"]
                    results = [
                        {"type": "tool_result", "tool_use_id": b.id, "content": "ok"} for b in uses
                    ]
                    messages.append({"role": "user", "content": results or "go on"})
    assert_one_program_per_task(setup.db, "/v1/messages")


async def test_responses_agents_without_program_ids_are_one_program_per_task(
    tmp_path: Path,
) -> None:
    async with proxy_on_sim(tmp_path) as setup:
        inputs: list[list[Any]] = [[{"role": "user", "content": task}] for task in TASKS]
        with setup.openai() as client:
            for turn in range(TURNS):
                for items in inputs:
                    stream = turn % 2 == 1

                    def call(items: list[Any] = items, stream: bool = stream) -> Any:
                        kwargs: Any = {
                            "model": MODEL,
                            "instructions": SYSTEM,
                            "input": items,
                            "tools": RESPONSES_TOOLS,
                            "store": False,
                        }
                        if not stream:
                            return client.responses.create(**kwargs)
                        with client.responses.stream(**kwargs) as events:
                            for _ in events:
                                pass
                            return events.get_final_response()

                    final = await in_thread(call)
                    # Stateless clients send the whole history back each turn.
                    items += [item.model_dump(exclude_none=True) for item in final.output]
                    items += [
                        {"type": "function_call_output", "call_id": item.call_id, "output": "ok"}
                        for item in final.output
                        if item.type == "function_call"
                    ]
    assert_one_program_per_task(setup.db, "/v1/responses")


async def test_responses_chained_by_previous_response_id(tmp_path: Path) -> None:
    async with proxy_on_sim(tmp_path) as setup:
        with setup.openai() as client:
            previous: list[str | None] = [None] * len(TASKS)
            for _turn in range(TURNS):
                for index, task in enumerate(TASKS):

                    def call(task: str = task, after: str | None = previous[index]) -> Any:
                        if after is None:
                            return client.responses.create(model=MODEL, input=task)
                        return client.responses.create(
                            model=MODEL, input="go on", previous_response_id=after
                        )

                    previous[index] = (await in_thread(call)).id
    programs = programs_of(setup.db, "/v1/responses")
    assert len(programs) == len(TASKS), programs
    sources = query(setup.db, "SELECT source FROM transitions WHERE source IS NOT NULL")
    assert [r["source"] for r in sources] == ["new"] * len(TASKS)


async def test_errors_keep_each_protocol_shape(tmp_path: Path) -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    db = tmp_path / "audit.db"
    async with running_proxy(db, backends=dead, metrics_interval=60, ready_timeout=0.5) as proxy:
        messages = [{"role": "user", "content": "hi"}]
        with anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0) as client:

            def invalid() -> Any:
                return client.messages.create(model=MODEL, max_tokens=0, messages=messages)  # type: ignore[arg-type]

            def no_backend() -> Any:
                return client.messages.create(model=MODEL, max_tokens=8, messages=messages)  # type: ignore[arg-type]

            with pytest.raises(anthropic.BadRequestError) as bad:
                await in_thread(invalid)
            assert bad.value.body["type"] == "error"  # type: ignore[index]
            assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
            assert "max_tokens" in bad.value.message
            with pytest.raises(anthropic.InternalServerError) as down:
                await in_thread(no_backend)
            assert down.value.status_code == 503
            assert down.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
            assert dead in down.value.message
        with openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0) as oai:
            with pytest.raises(openai.InternalServerError) as openai_down:
                await in_thread(lambda: oai.responses.create(model=MODEL, input="hi"))
            assert openai_down.value.body["type"] == "service_unavailable"  # type: ignore[index]
    refused = query(db, "SELECT path, status FROM rejections ORDER BY id")
    assert refused == [
        {"path": "/v1/messages", "status": 400},
        {"path": "/v1/messages", "status": 503},
        {"path": "/v1/responses", "status": 503},
    ]


async def test_recognition_sources_can_be_switched_off(tmp_path: Path) -> None:
    # Only explicit ids: unnamed calls share the one "default" program, as before recognition.
    async with (
        proxy_on_sim(tmp_path, recognition="explicit") as setup,
        httpx.AsyncClient(base_url=setup.proxy.url, timeout=10) as client,
    ):
        for task in TASKS:
            body = {"model": MODEL, "messages": [{"role": "user", "content": task}]}
            answer = await client.post(
                "/v1/chat/completions", json=body, headers={"X-Session-ID": "ignored"}
            )
            assert answer.status_code == 200
        named = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        answer = await client.post("/v1/chat/completions", json={**named, "program_id": "mine"})
        assert answer.status_code == 200
        programs = (await client.get("/programs")).json()
    assert {pid: p["source"] for pid, p in programs.items()} == {
        "default": "default",
        "mine": "explicit",
    }


def test_an_unknown_recognition_source_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown sources sessions; known: explicit"):
        load_settings({"recognition": "explicit,sessions"})
