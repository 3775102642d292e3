"""The council's deliberation, as pure functions: prompts, histories, anonymized labels,
ranking parsing and aggregation. The stages that call models are in ``pipeline.py``.

Stage 1: every member answers. Stage 2: every member ranks the others' answers, shown as
"Response A", "Response B", ... so no model can favour a name. Stage 3: the chairman
synthesises one answer from all of it.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

RANKING_HEADER = "FINAL RANKING:"

STAGE2_PROMPT = """\
You are evaluating different responses to the following question:

Question: {question}

Here are the responses from different models, anonymized:

{responses}

Your task:
1. First evaluate each response on its own: say what it does well and what it does poorly.
2. Then, at the very end, give your final ranking.

Your final ranking MUST use exactly this format:
- A line that says "FINAL RANKING:" (capitals, with the colon)
- Then the responses from best to worst as a numbered list
- Each line: number, period, space, then only the label (e.g. "1. Response A")
- No other text in the ranking section

Example of the whole answer:

Response A is detailed on X but misses Y...
Response B is accurate but shallow on Z...

FINAL RANKING:
1. Response B
2. Response A

Now give your evaluation and ranking:"""

STAGE3_PROMPT = """\
You are the Chairman of an LLM Council. Several models answered a question, then ranked each \
other's answers without knowing whose they were.

Original question: {question}

STAGE 1 - individual answers:

{answers}

STAGE 2 - peer rankings:

{rankings}

As Chairman, synthesise all of this into one answer that is as accurate and useful as it can \
be. Weigh the answers by their substance and the rankings' reasons, note where the council \
agreed or disagreed, and give the final answer in Markdown."""

TITLE_PROMPT = """\
Write a short title, 3 to 5 words, for a conversation that starts with this question. \
Answer with the title only, no quotes or punctuation around it.

Question: {question}"""

#: Most members a council can have: one letter each for the anonymized labels.
MAX_MEMBERS = len(string.ascii_uppercase)

_LABEL = re.compile(r"[Rr]esponse\s+([A-Z])\b")
# "1. Response C", "2) **Response A**", on their own lines or run together on one.
_NUMBERED = re.compile(r"(?<![\w.])\d+\s*[.)]\s*\W{0,3}[Rr]esponse\s+([A-Z])\b")


@dataclass(frozen=True)
class MemberAnswer:
    model: str
    response: str


@dataclass(frozen=True)
class MemberRanking:
    model: str
    ranking: str
    parsed_ranking: tuple[str, ...]


@dataclass(frozen=True)
class Standing:
    model: str
    average_rank: float
    rankings_count: int
    first_places: int


def anonymize(answers: Sequence[MemberAnswer]) -> tuple[dict[str, str], str]:
    """Labels in answer order, ``{"Response A": model, ...}``, and the text models are shown."""
    if len(answers) > MAX_MEMBERS:
        raise ValueError(f"at most {MAX_MEMBERS} answers can be labelled, got {len(answers)}")
    label_to_model: dict[str, str] = {}
    blocks = []
    for letter, answer in zip(string.ascii_uppercase, answers, strict=False):
        label = f"Response {letter}"
        label_to_model[label] = answer.model
        blocks.append(f"{label}:\n{answer.response}")
    return label_to_model, "\n\n".join(blocks)


def stage2_prompt(question: str, responses_text: str) -> str:
    return STAGE2_PROMPT.format(question=question, responses=responses_text)


def _unique(labels: Sequence[str], known: Sequence[str] | None) -> tuple[str, ...]:
    seen: list[str] = []
    for label in labels:
        if label not in seen and (known is None or label in known):
            seen.append(label)
    return tuple(seen)


def parse_ranking(text: str, known: Sequence[str] | None = None) -> tuple[str, ...]:
    """The labels of a ranking, best first.

    The section after the last ``FINAL RANKING:`` is read as a numbered list; without
    numbers, the labels it mentions in order. A text with no such section falls back to every
    "Response X" it mentions, first mention first. Repeats and labels not in ``known`` (when
    given) are dropped.
    """
    head, found, section = text.rpartition(RANKING_HEADER)
    if not found:
        upper = text.upper()
        at = upper.rfind(RANKING_HEADER.rstrip(":"))
        if at >= 0:
            section = text[at + len(RANKING_HEADER) - 1 :]
            found = RANKING_HEADER
    if found:
        numbered = [f"Response {m}" for m in _NUMBERED.findall(section)]
        if numbered:
            return _unique(numbered, known)
        mentioned = [f"Response {m}" for m in _LABEL.findall(section)]
        if mentioned:
            return _unique(mentioned, known)
    return _unique([f"Response {m}" for m in _LABEL.findall(text)], known)


def aggregate(
    rankings: Sequence[MemberRanking], label_to_model: Mapping[str, str]
) -> list[Standing]:
    """Each model's average position over the rankings that placed it (1 is best), how many
    placed it, and how many put it first; best average first, ties by more first places."""
    positions: dict[str, list[int]] = {}
    firsts: dict[str, int] = {}
    for ranking in rankings:
        for position, label in enumerate(ranking.parsed_ranking, start=1):
            model = label_to_model.get(label)
            if model is None:
                continue
            positions.setdefault(model, []).append(position)
            if position == 1:
                firsts[model] = firsts.get(model, 0) + 1
    standings = [
        Standing(model, round(sum(p) / len(p), 2), len(p), firsts.get(model, 0))
        for model, p in positions.items()
    ]
    standings.sort(key=lambda s: (s.average_rank, -s.first_places, s.model))
    return standings


def stage3_prompt(
    question: str,
    answers: Sequence[MemberAnswer],
    rankings: Sequence[MemberRanking],
) -> str:
    answers_text = "\n\n".join(f"Model: {a.model}\nAnswer: {a.response}" for a in answers)
    rankings_text = "\n\n".join(f"Model: {r.model}\nRanking: {r.ranking}" for r in rankings)
    return STAGE3_PROMPT.format(
        question=question, answers=answers_text, rankings=rankings_text or "(none)"
    )


def title_prompt(question: str) -> str:
    return TITLE_PROMPT.format(question=question)


def clean_title(text: str, *, limit: int = 60) -> str:
    """A model's title as one short line: first line, no quotes or trailing punctuation."""
    line = next((ln for ln in text.strip().splitlines() if ln.strip()), "").strip()
    line = line.removeprefix("Title:").strip().strip("\"'*#` ").rstrip(".:;!")
    if len(line) > limit:
        line = line[: limit - 1].rstrip() + "…"
    return line or "New conversation"


@dataclass(frozen=True)
class Turn:
    """One earlier exchange of a conversation: the question and what the council said."""

    question: str
    answers: Mapping[str, str]
    final: str | None


def turns_from_messages(messages: Sequence[Mapping[str, Any]]) -> list[Turn]:
    """Earlier turns from stored messages: a user message followed by its assistant message
    (with its stage results). A question without a usable answer is skipped."""
    turns = []
    for question, answer in zip(messages, messages[1:], strict=False):
        if question.get("role") != "user" or answer.get("role") != "assistant":
            continue
        stage1 = answer.get("stage1") or []
        answers = {r["model"]: r["response"] for r in stage1 if r.get("response")}
        stage3 = answer.get("stage3") or {}
        final = stage3.get("response") if isinstance(stage3, dict) else None
        if answers or final:
            turns.append(Turn(str(question.get("content", "")), answers, final))
    return turns


def stage1_history(turns: Sequence[Turn], model: str, question: str) -> list[dict[str, Any]]:
    """A member's messages: each earlier question with its own earlier answer (the council's
    final answer where it gave none), then the new question."""
    messages: list[dict[str, Any]] = []
    for turn in turns:
        answer = turn.answers.get(model) or turn.final
        if answer is None:
            continue
        messages.append({"role": "user", "content": turn.question})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": question})
    return messages


def stage3_history(turns: Sequence[Turn], prompt: str) -> list[dict[str, Any]]:
    """The chairman's messages: earlier questions with the council's final answers, then the
    synthesis prompt."""
    messages: list[dict[str, Any]] = []
    for turn in turns:
        if turn.final is None:
            continue
        messages.append({"role": "user", "content": turn.question})
        messages.append({"role": "assistant", "content": turn.final})
    messages.append({"role": "user", "content": prompt})
    return messages
