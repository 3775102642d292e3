"""The three stages of a council job, calling models through a ``ChatClient`` and reporting
every step through ``emit`` as an event of ``records.py`` (which the runner makes durable
before it returns).

Members run in parallel; one that fails or runs out of time is left out and reported, and
the job fails only when no member answered stage 1.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import trio

from . import deliberation
from .deliberation import MemberAnswer, MemberRanking, Turn
from .errors import JobFailed, MemberFailed
from .llm import ChatClient, ChatRequest, TextDelta, ToolCall, closing
from .records import (
    JobEvent,
    Stage1Member,
    Stage1Start,
    Stage1Tool,
    Stage2Member,
    Stage2Start,
    Stage3Start,
    TextChunk,
)
from .tools import Toolbox, answer_with_tools

#: Streamed text is saved and sent in pieces at most this far apart (trio seconds): one event
#: per token would cost a commit each for no visible gain.
CHUNK_INTERVAL_S = 0.05


class Emit(Protocol):
    async def __call__(self, event: JobEvent) -> None: ...


@dataclass(frozen=True)
class CouncilConfig:
    """Who sits on the council and how long each may take."""

    members: tuple[str, ...]
    chairman: str
    title_model: str
    member_timeout_s: float = 300.0
    tool_rounds: int = 5
    max_tokens: int | None = None


#: The contexts a model's calls build in one job, each a program of its own: its answer
#: (stage 1, whose tool rounds extend it), its ranking (stage 2), the chairman's synthesis
#: (stage 3) and the title. A ranking's prompt does not extend the member's answer, nor the
#: synthesis either: counted as one program, each stage's call came back to a program whose
#: cached answer it would never read, and tr held it to keep that cache (councils at 12K
#: tokens took 1.2x default's time).
ANSWER, RANKING, SYNTHESIS, TITLE = "answer", "ranking", "synthesis", "title"

#: How long releasing a stage's program may take (the scheduler's, in process; the proxy's
#: ``/programs/release`` behind a URL).
RELEASE_GRACE_S = 5.0


def program_id(job_id: str, model: str, context: str = ANSWER) -> str:
    """The program of ``model``'s calls for one ``context`` of a job (``ANSWER`` ...)."""
    base = f"council:{job_id}:{model}"
    return base if context == ANSWER else f"{base}:{context}"


async def in_context(client: ChatClient, program: str, work: Callable[[], Awaitable[str]]) -> str:
    """``work``'s answer; then ``program`` is released, whatever ended it: the context is
    complete, and nothing of the job reads it again, so the scheduler keeps no room for it."""
    try:
        return await work()
    finally:
        with trio.move_on_after(RELEASE_GRACE_S) as scope:
            scope.shield = True
            await client.release(program)


class Chunker:
    """Collects a member's streamed text and emits it at most every ``CHUNK_INTERVAL_S``, as
    events of ``type`` (``stage1_chunk``, ...)."""

    def __init__(self, emit: Emit, type: str, model: str) -> None:
        self.emit = emit
        self.type = type
        self.model = model
        self.pending: list[str] = []
        self.last = -1e18

    async def add(self, text: str) -> None:
        self.pending.append(text)
        if trio.current_time() - self.last >= CHUNK_INTERVAL_S:
            await self.flush()

    async def flush(self) -> None:
        if self.pending:
            text = "".join(self.pending)
            self.pending.clear()
            self.last = trio.current_time()
            await self.emit(TextChunk(self.type, self.model, text))


async def _member(
    name: str,
    timeout_s: float,
    work: Callable[[], Awaitable[str]],
) -> tuple[str | None, str | None]:
    """(answer, None) or (None, why it failed)."""
    try:
        with trio.move_on_after(timeout_s) as scope:
            return await work(), None
    except MemberFailed as exc:
        return None, exc.message
    assert scope.cancelled_caught
    return None, f"{name} did not finish within {timeout_s:g} s (see --council-member-timeout)."


async def stage1(
    client: ChatClient,
    config: CouncilConfig,
    job_id: str,
    question: str,
    turns: Sequence[Turn],
    emit: Emit,
    toolbox: Toolbox | None,
) -> tuple[list[MemberAnswer], list[dict[str, str]]]:
    await emit(Stage1Start(config.members))
    answers: dict[str, str] = {}
    failed: dict[str, str] = {}

    async def one(model: str) -> None:
        chunks = Chunker(emit, "stage1_chunk", model)

        async def on_tool(round_: int, call: ToolCall, result: str) -> None:
            await chunks.flush()
            ok = not result.startswith("Error:")
            await emit(Stage1Tool(model, round_, call.name, call.arguments, len(result), ok))

        async def reply() -> str:
            return await answer_with_tools(
                client,
                model=model,
                messages=deliberation.stage1_history(turns, model, question),
                program_id=program_id(job_id, model),
                toolbox=toolbox,
                on_text=chunks.add,
                on_tool=on_tool,
                max_rounds=config.tool_rounds,
                max_tokens=config.max_tokens,
            )

        async def work() -> str:
            return await in_context(client, program_id(job_id, model), reply)

        answer, error = await _member(model, config.member_timeout_s, work)
        await chunks.flush()
        if answer is not None and answer.strip():
            answers[model] = answer
            await emit(Stage1Member(model, response=answer))
        else:
            failed[model] = error or f"{model} answered with no text."
            await emit(Stage1Member(model, error=failed[model]))

    async with trio.open_nursery() as nursery:
        for model in config.members:
            nursery.start_soon(one, model)
    results = [MemberAnswer(m, answers[m]) for m in config.members if m in answers]
    failures = [{"model": m, "error": failed[m]} for m in config.members if m in failed]
    if not results:
        raise JobFailed(
            "No council member answered: "
            + "; ".join(f"{f['model']}: {f['error']}" for f in failures)
            + ". Check --council-models against the models the backends serve."
        )
    return results, failures


async def stream_text(
    client: ChatClient,
    *,
    model: str,
    messages: list[dict[str, Any]],
    program: str,
    chunks: Chunker | None,
    max_tokens: int | None,
) -> str:
    parts = []
    stream = client.stream_chat(
        ChatRequest(model=model, messages=messages, program_id=program, max_tokens=max_tokens)
    )
    async with closing(stream) as events:
        async for event in events:
            if isinstance(event, TextDelta):
                parts.append(event.text)
                if chunks is not None:
                    await chunks.add(event.text)
    if chunks is not None:
        await chunks.flush()
    return "".join(parts)


async def stage2(
    client: ChatClient,
    config: CouncilConfig,
    job_id: str,
    question: str,
    answers: Sequence[MemberAnswer],
    emit: Emit,
) -> tuple[list[MemberRanking], dict[str, str], list[dict[str, str]]]:
    label_to_model, responses_text = deliberation.anonymize(answers)
    await emit(Stage2Start(label_to_model))
    prompt = deliberation.stage2_prompt(question, responses_text)
    rankings: dict[str, MemberRanking] = {}
    failed: dict[str, str] = {}
    rankers = [a.model for a in answers]

    async def one(model: str) -> None:
        chunks = Chunker(emit, "stage2_chunk", model)

        program = program_id(job_id, model, RANKING)

        async def work() -> str:
            return await in_context(client, program, partial(
                stream_text,
                client,
                model=model,
                messages=[{"role": "user", "content": prompt}],
                program=program,
                chunks=chunks,
                max_tokens=config.max_tokens,
            ))  # fmt: skip

        text, error = await _member(model, config.member_timeout_s, work)
        if text is None:
            failed[model] = error or "no ranking"
            await emit(Stage2Member(model, error=failed[model]))
            return
        parsed = deliberation.parse_ranking(text, known=list(label_to_model))
        rankings[model] = MemberRanking(model, text, parsed)
        await emit(Stage2Member(model, ranking=text, parsed_ranking=parsed))

    async with trio.open_nursery() as nursery:
        for model in rankers:
            nursery.start_soon(one, model)
    ordered = [rankings[m] for m in rankers if m in rankings]
    failures = [{"model": m, "error": failed[m]} for m in rankers if m in failed]
    return ordered, label_to_model, failures


async def stage3(
    client: ChatClient,
    config: CouncilConfig,
    job_id: str,
    question: str,
    turns: Sequence[Turn],
    answers: Sequence[MemberAnswer],
    rankings: Sequence[MemberRanking],
    standings: Sequence[deliberation.Standing],
    emit: Emit,
) -> dict[str, Any]:
    """The chairman's synthesis. A chairman that fails leaves the council's top-ranked answer
    as the result, marked so, rather than losing the whole deliberation."""
    model = config.chairman
    await emit(Stage3Start(model))
    prompt = deliberation.stage3_prompt(question, answers, rankings)
    chunks = Chunker(emit, "stage3_chunk", model)

    program = program_id(job_id, model, SYNTHESIS)

    async def work() -> str:
        return await in_context(client, program, partial(
            stream_text,
            client,
            model=model,
            messages=deliberation.stage3_history(turns, prompt),
            program=program,
            chunks=chunks,
            max_tokens=config.max_tokens,
        ))  # fmt: skip

    text, error = await _member(model, config.member_timeout_s, work)
    if text is not None and text.strip():
        return {"model": model, "response": text}
    best = standings[0].model if standings else answers[0].model
    fallback = next(a.response for a in answers if a.model == best)
    return {
        "model": best,
        "response": fallback,
        "chairman_error": error or f"{model} answered with no text.",
    }


async def title(
    client: ChatClient, config: CouncilConfig, job_id: str, question: str
) -> str | None:
    """A short conversation title; best effort (None when the title model fails)."""

    program = program_id(job_id, config.title_model, TITLE)

    async def work() -> str:
        return await in_context(client, program, partial(
            stream_text,
            client,
            model=config.title_model,
            messages=[{"role": "user", "content": deliberation.title_prompt(question)}],
            program=program,
            chunks=None,
            max_tokens=24,
        ))  # fmt: skip

    text, _ = await _member(config.title_model, config.member_timeout_s, work)
    return deliberation.clean_title(text) if text else None
