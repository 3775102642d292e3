"""The stages on a scripted client and trio's autojump clock: parallel members, timeouts,
failures left out, the chairman's fallback, and one program per member."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from tests.council.fakes import ScriptedClient
from thunderproxy.council import pipeline
from thunderproxy.council.deliberation import MemberAnswer, Standing
from thunderproxy.council.errors import JobFailed, MemberFailed
from thunderproxy.council.pipeline import CouncilConfig
from thunderproxy.council.records import JobEvent

CONFIG = CouncilConfig(
    members=("fast", "slow", "broken"), chairman="fast", title_model="fast", member_timeout_s=60
)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    async def __call__(self, event: JobEvent) -> None:
        self.events.append((event.type, event.data()))

    def of(self, type: str) -> list[dict[str, Any]]:
        return [data for kind, data in self.events if kind == type]


def script(model: str, messages: list[dict[str, Any]], tools: Any) -> Any:
    if model == "slow":
        return None  # never answers
    if model == "broken":
        return MemberFailed("Model 'broken' answered HTTP 500: boom")
    return f"{model} says hello"


async def test_stage1_leaves_out_members_that_fail_or_time_out(autojump_clock: Any) -> None:
    client = ScriptedClient(script)
    emit = Recorder()
    start = trio.current_time()
    answers, failed = await pipeline.stage1(client, CONFIG, "j1", "hi?", [], emit, None)
    assert trio.current_time() - start == pytest.approx(60)
    assert answers == [MemberAnswer("fast", "fast says hello ")]
    assert failed == [
        {
            "model": "slow",
            "error": "slow did not finish within 60 s (see --council-member-timeout).",
        },
        {"model": "broken", "error": "Model 'broken' answered HTTP 500: boom"},
    ]
    assert "".join(e["text"] for e in emit.of("stage1_chunk")) == "fast says hello "
    assert {c["program_id"] for c in client.calls} == {
        "council:j1:fast", "council:j1:slow", "council:j1:broken"
    }  # fmt: skip
    assert [e["model"] for e in emit.of("stage1_member")] == ["broken", "fast", "slow"]


async def test_stage1_fails_the_job_only_when_no_member_answered(autojump_clock: Any) -> None:
    config = CouncilConfig(members=("slow", "broken"), chairman="slow", title_model="slow")
    with pytest.raises(JobFailed, match="No council member answered: slow: .*broken: "):
        await pipeline.stage1(ScriptedClient(script), config, "j", "q", [], Recorder(), None)


async def test_stage2_asks_every_answering_member_and_parses_rankings(
    autojump_clock: Any,
) -> None:
    def rank(model: str, messages: list[dict[str, Any]], tools: Any) -> Any:
        assert "Response A:\nfirst" in messages[0]["content"]
        assert "m1" not in messages[0]["content"]
        return "Fine. FINAL RANKING: 1. Response B 2. Response A"

    answers = [MemberAnswer("m1", "first"), MemberAnswer("m2", "second")]
    emit = Recorder()
    client = ScriptedClient(rank)
    config = CouncilConfig(members=("m1", "m2"), chairman="m1", title_model="m1")
    rankings, label_to_model, failed = await pipeline.stage2(
        client, config, "j", "q", answers, emit
    )
    assert label_to_model == {"Response A": "m1", "Response B": "m2"}
    assert [r.parsed_ranking for r in rankings] == [("Response B", "Response A")] * 2
    assert failed == []
    assert emit.of("stage2_start") == [{"label_to_model": label_to_model}]


async def test_a_failing_chairman_leaves_the_top_ranked_answer(autojump_clock: Any) -> None:
    answers = [MemberAnswer("m1", "one"), MemberAnswer("m2", "two")]
    standings = [Standing("m2", 1.0, 2, 2), Standing("m1", 2.0, 2, 0)]
    config = CouncilConfig(members=("m1", "m2"), chairman="broken", title_model="m1")
    result = await pipeline.stage3(
        ScriptedClient(script), config, "j", "q", [], answers, [], standings, Recorder()
    )
    assert result == {
        "model": "m2",
        "response": "two",
        "chairman_error": "Model 'broken' answered HTTP 500: boom",
    }


async def test_chunks_are_sent_at_most_every_interval(autojump_clock: Any) -> None:
    emit = Recorder()
    chunks = pipeline.Chunker(emit, "stage3_chunk", "m")
    for piece in "abcdef":
        await chunks.add(piece)
        await trio.sleep(0.02)
    await chunks.flush()
    # 20 ms apart against a 50 ms interval: the first piece alone, then groups of three.
    assert [e["text"] for e in emit.of("stage3_chunk")] == ["a", "bcd", "ef"]
