"""The runner over a real SQLite store and a scripted client: multi-turn history, one job per
conversation, keepalives on a quiet stream, and programs released when a job ends."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.council.fakes import ScriptedClient
from tests.council.helpers import council_programs
from thunderproxy.council.errors import JobRunning, MemberFailed, StoreUnavailable, TooManyJobs
from thunderproxy.council.llm import ChatRequest, StreamAssembler, TextDelta, ToolCall
from thunderproxy.council.pipeline import CouncilConfig
from thunderproxy.council.runner import CouncilRunner
from thunderproxy.council.store import JobStore

CONFIG = CouncilConfig(members=("m1", "m2"), chairman="m1", title_model="m2")


def answers(model: str, messages: list[dict[str, Any]], tools: Any) -> Any:
    prompt = messages[-1]["content"]
    if "FINAL RANKING" in prompt:
        return "FINAL RANKING: 1. Response B 2. Response A"
    if prompt.startswith("Write a short title"):
        return "A title"
    return f"{model} on {prompt[:20]}"


async def start_runner(
    nursery: trio.Nursery, tmp_path: Path, client: ScriptedClient
) -> CouncilRunner:
    store = await JobStore.open(str(tmp_path / "jobs.db"))
    runner = CouncilRunner(store, CONFIG)
    await nursery.start(runner.serve, client)
    return runner


async def test_a_second_question_carries_each_members_history(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    client = ScriptedClient(answers)
    runner = await start_runner(nursery, tmp_path, client)
    conversation = (await runner.store.create_conversation())["id"]
    with trio.fail_after(20):
        first = await runner.start(conversation, "First question")
        await runner.wait(first)
        client.calls.clear()
        second = await runner.start(conversation, "Second question")
        await runner.wait(second)
    stage1 = {c["model"]: c["messages"] for c in client.calls if "FINAL" not in str(c)}
    assert stage1["m2"][:3] == [
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "m2 on First question "},
        {"role": "user", "content": "Second question"},
    ]
    job = await runner.store.get_job(second)
    assert job is not None
    assert job.status == "complete"
    # Only the first question titles the conversation.
    assert job.title_model is None
    conversation_row = await runner.store.get_conversation(conversation)
    assert conversation_row is not None
    assert conversation_row["title"] == "A title"
    # Each context's program as it ended: answers, rankings, the synthesis; the first
    # question's title too.
    assert set(client.released) == council_programs(first, ("m1", "m2"), "m1", "m2") | (
        council_programs(second, ("m1", "m2"), "m1")
    )
    assert len(client.released) == len(set(client.released))


async def test_one_job_per_conversation_even_when_two_start_at_once(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    client = ScriptedClient(lambda m, msgs, t: None)  # members that never answer
    runner = await start_runner(nursery, tmp_path, client)
    conversation = (await runner.store.create_conversation())["id"]
    outcomes: list[str] = []

    async def start() -> None:
        try:
            outcomes.append(await runner.start(conversation, "q"))
        except JobRunning:
            outcomes.append("409")

    async with trio.open_nursery() as both:
        both.start_soon(start)
        both.start_soon(start)
    assert outcomes.count("409") == 1
    assert runner.running_job(conversation) == next(o for o in outcomes if o != "409")


async def test_running_jobs_are_capped_per_client_and_in_total(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Before: no cap, every job a client started ran to the end."""
    client = ScriptedClient(lambda m, msgs, t: None)  # members that never answer
    store = await JobStore.open(str(tmp_path / "jobs.db"))
    runner = CouncilRunner(store, CONFIG, max_jobs=3, max_jobs_per_client=2)
    await nursery.start(runner.serve, client)

    async def ask(address: str | None) -> str:
        conversation = (await store.create_conversation())["id"]
        return await runner.start(conversation, "q", client=address)

    await ask("10.0.0.1")
    await ask("10.0.0.1")
    with pytest.raises(TooManyJobs, match="--council-max-jobs-per-client"):
        await ask("10.0.0.1")
    await ask("10.0.0.2")
    with pytest.raises(TooManyJobs, match="--council-max-jobs allows"):
        await ask("10.0.0.3")
    with pytest.raises(TooManyJobs, match="--council-max-jobs allows"):
        await ask(None)
    assert len(runner.live) == 3
    # A refused start leaves nothing behind: no reservation, no job row.
    assert len(await store.list_conversations()) == 6


async def test_a_quiet_stream_gets_keepalives(nursery: trio.Nursery, tmp_path: Path) -> None:
    client = ScriptedClient(lambda m, msgs, t: None)
    runner = await start_runner(nursery, tmp_path, client)
    conversation = (await runner.store.create_conversation())["id"]
    job = await runner.start(conversation, "q")
    seen: list[Any] = []
    stream = runner.follow(job, 0, keepalive_s=0.05)
    with trio.fail_after(10):
        async for item in stream:
            seen.append(item)
            if item is None:
                break
    assert [e.type for e in seen[:-1]] == ["stage1_start"]
    assert seen[-1] is None
    await stream.aclose()


def test_tool_call_fragments_are_assembled_in_order() -> None:
    assembler = StreamAssembler()
    chunks: list[dict[str, Any]] = [
        {"choices": [{"delta": {"content": "Let me look."}}]},
        {"choices": [{"delta": {"tool_calls": [
            {"index": 0, "id": "call_a", "function": {"name": "fetch_url", "arguments": ""}}]}}]},
        {"choices": [{"delta": {"tool_calls": [
            {"index": 1, "id": "call_b", "function": {"name": "web_search", "arguments": '{"q'}},
            {"index": 0, "function": {"arguments": '{"url": "http://x'}}]}}]},
        {"choices": [{"delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": '"}'}},
            {"index": 1, "function": {"arguments": 'uery": "y"}'}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 7}},
    ]  # fmt: skip
    events = [e for chunk in chunks for e in assembler.feed(chunk)]
    assert events == [TextDelta("Let me look.")]
    finished = assembler.finished()
    assert finished.finish_reason == "tool_calls"
    assert finished.tool_calls == (
        ToolCall("call_a", "fetch_url", '{"url": "http://x"}'),
        ToolCall("call_b", "web_search", '{"query": "y"}'),
    )
    assert (finished.prompt_tokens, finished.completion_tokens) == (12, 7)


def test_a_member_request_streams_with_usage_and_sends_only_what_was_given() -> None:
    messages = [{"role": "user", "content": "q"}]
    plain = ChatRequest("m", messages, "council:j:m")
    assert plain.body() == {
        "model": "m",
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tools = [{"type": "function", "function": {"name": "fetch_url"}}]
    full = ChatRequest("m", messages, "p", tools=tools, tool_choice="auto", max_tokens=0)
    assert full.body() == plain.body() | {
        "tools": tools,
        "tool_choice": "auto",
        "max_tokens": 0,
    }
    # An empty tool list is sent as no tools at all.
    assert "tools" not in ChatRequest("m", messages, "p", tools=[]).body()


@pytest.mark.parametrize(
    "as_read", [lambda text: text, lambda text: text.encode()], ids=["http-text", "gateway-bytes"]
)
def test_a_stream_payload_is_fed_or_fails_the_member(as_read: Callable[[str], Any]) -> None:
    # Both clients hand over the payload of a data: line as they read it, text or bytes.
    assembler = StreamAssembler()
    chunk = '{"choices": [{"delta": {"content": "Hi"}, "finish_reason": "stop"}]}'
    assert assembler.feed_data("m", as_read(chunk)) == [TextDelta("Hi")]
    assert assembler.finished().finish_reason == "stop"
    with pytest.raises(MemberFailed, match="^Model 'm' failed mid-answer: overloaded$"):
        assembler.feed_data("m", as_read('{"error": {"message": "overloaded", "code": 503}}'))
    with pytest.raises(MemberFailed, match="^Model 'm' sent an unreadable stream chunk: b?'{no'$"):
        assembler.feed_data("m", as_read("{no"))


@pytest.mark.parametrize(
    ("models", "message"),
    [
        ("a,b,a", "names a model twice"),
        (",".join(f"m{i}" for i in range(27)), "at most 26 members"),
    ],
)
def test_a_council_that_cannot_work_is_refused_at_startup(models: str, message: str) -> None:
    from thunderproxy.config import load_settings
    from thunderproxy.council import council_config
    from thunderproxy.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        council_config(load_settings(council_models=models))


async def test_a_store_failure_inside_a_stage_is_named_plainly_in_the_error_event(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stage's members run in a nursery, which wraps what they raise: the client read
    # "ExceptionGroup(...StoreUnavailable...)" instead of the cause.
    runner = await start_runner(nursery, tmp_path, ScriptedClient(answers))
    real_append = runner.store.append

    async def append(job_id: str, seq: int, type: str, data: dict[str, Any]) -> Any:
        if type == "stage1_member":
            raise StoreUnavailable("The audit db is full (database or disk is full).")
        return await real_append(job_id, seq, type, data)

    monkeypatch.setattr(runner.store, "append", append)
    conversation = (await runner.store.create_conversation())["id"]
    with trio.fail_after(20):
        job = await runner.start(conversation, "A question")
        await runner.wait(job)
    (error,) = [e for e in await runner.store.events(job) if e.type == "error"]
    message = error.data["message"]
    assert "ExceptionGroup" not in message
    assert message == (
        "The council job stopped: it could not record its progress in the audit db. "
        "The audit db is full (database or disk is full)."
    )
