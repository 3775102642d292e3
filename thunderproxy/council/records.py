"""A council job and its events as typed records, each with the JSON it is written as.

``Job`` is one ``council_jobs`` row, read back (``JobStore.get_job``): the question, the council
it was started with, where it stands, and what each stage saved. ``Job.result`` is the JSON
``POST …/message`` answers with.

The events are what a job tells its followers, one class per ``type`` of docs/COUNCIL.md's
"Events" table; ``data()`` is the event's JSON without ``type``, ``seq`` and ``job_id``, which
the store and the stream add (``store.Event``). A stored event is replayed as it was written,
so these classes are how events are made, never how they are read back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from .deliberation import MemberAnswer, MemberRanking, Standing

#: A member left out of a stage, as the stage's ``failed`` list and the job's metadata say it:
#: ``{"model": ..., "error": ...}``.
Failure = Mapping[str, str]


def _loads(value: str | None) -> Any:
    return None if value is None else json.loads(value)


def answers_json(answers: Sequence[MemberAnswer]) -> list[dict[str, Any]]:
    """Stage 1's results as saved and sent: ``[{model, response}]``."""
    return [asdict(a) for a in answers]


def rankings_json(rankings: Sequence[MemberRanking]) -> list[dict[str, Any]]:
    """Stage 2's results as saved and sent: ``[{model, ranking, parsed_ranking}]``."""
    return [{**asdict(r), "parsed_ranking": list(r.parsed_ranking)} for r in rankings]


def standings_json(standings: Sequence[Standing]) -> list[dict[str, Any]]:
    """The aggregate ranking as saved and sent: ``[{model, average_rank, ...}]``."""
    return [asdict(s) for s in standings]


@dataclass(frozen=True)
class Job:
    """One council job as its row holds it, and the number of its last recorded event."""

    id: str
    conversation_id: str
    question: str
    #: pending, stage1, stage2, stage3 (while it runs), complete or error.
    status: str
    completed_stage: int
    #: The council it was started with: a resumed job finishes with the same one.
    members: tuple[str, ...]
    chairman: str
    #: The model that titles the conversation; None when the job does not title it.
    title_model: str | None
    stage1: tuple[MemberAnswer, ...] | None
    stage2: tuple[MemberRanking, ...] | None
    #: The chairman's synthesis: ``model``, ``response``, and ``chairman_error`` when it is a
    #: member's answer instead (pipeline.stage3).
    stage3: Mapping[str, Any] | None
    #: ``failed_members`` after stage 1; ``label_to_model``, ``aggregate_rankings`` and
    #: ``failed_rankers`` after stage 2.
    metadata: Mapping[str, Any] | None
    error: str | None
    created_at: float
    updated_at: float
    finished_at: float | None
    #: Times it was resumed after a restart.
    resumes: int
    #: The configured client that asked (``[clients]``), whose calls its are.
    client: str | None
    last_seq: int

    @classmethod
    def from_row(cls, row: Mapping[str, Any], last_seq: int) -> Job:
        stage1 = _loads(row["stage1"])
        stage2 = _loads(row["stage2"])
        return cls(
            id=row["id"],
            conversation_id=row["conversation_id"],
            question=row["question"],
            status=row["status"],
            completed_stage=row["completed_stage"],
            members=tuple(_loads(row["members"])),
            chairman=row["chairman"],
            title_model=row["title_model"],
            stage1=None if stage1 is None else tuple(MemberAnswer(**a) for a in stage1),
            stage2=None
            if stage2 is None
            else tuple(
                MemberRanking(r["model"], r["ranking"], tuple(r["parsed_ranking"])) for r in stage2
            ),
            stage3=_loads(row["stage3"]),
            metadata=_loads(row["metadata"]),
            error=row["error"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            finished_at=row["finished_at"],
            resumes=row["resumes"],
            client=row["client"],
            last_seq=last_seq,
        )

    def standings(self) -> list[Standing]:
        """Stage 2's aggregate ranking, as saved in the metadata."""
        saved = (self.metadata or {}).get("aggregate_rankings", [])
        return [Standing(**s) for s in saved]

    def result(self) -> dict[str, Any]:
        """What ``POST …/message`` answers with once the job has ended."""
        return {
            "job_id": self.id,
            "status": self.status,
            "error": self.error,
            "stage1": None if self.stage1 is None else answers_json(self.stage1),
            "stage2": None if self.stage2 is None else rankings_json(self.stage2),
            "stage3": self.stage3,
            "metadata": self.metadata,
        }


# --- events --------------------------------------------------------------------------------------


class JobEvent(Protocol):
    """An event as a job makes it: its ``type`` and its ``data()``."""

    @property
    def type(self) -> str: ...

    def data(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Stage1Start:
    models: tuple[str, ...]
    type = "stage1_start"

    def data(self) -> dict[str, Any]:
        return {"models": list(self.models)}


@dataclass(frozen=True)
class TextChunk:
    """A member's streamed text since its last chunk: ``stage1_chunk``, ``stage2_chunk`` or
    ``stage3_chunk``."""

    type: str
    model: str
    text: str

    def data(self) -> dict[str, Any]:
        return {"model": self.model, "text": self.text}


@dataclass(frozen=True)
class Stage1Tool:
    """A tool call a member made while answering, and how it went."""

    model: str
    round: int
    name: str
    arguments: str
    result_chars: int
    ok: bool
    type = "stage1_tool"

    def data(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "round": self.round,
            "name": self.name,
            "arguments": self.arguments,
            "result_chars": self.result_chars,
            "ok": self.ok,
        }


@dataclass(frozen=True)
class Stage1Member:
    """A member's answer, or why it has none (``error`` set)."""

    model: str
    response: str | None = None
    error: str | None = None
    type = "stage1_member"

    def data(self) -> dict[str, Any]:
        if self.error is not None:
            return {"model": self.model, "ok": False, "error": self.error}
        return {"model": self.model, "ok": True, "response": self.response}


@dataclass(frozen=True)
class Stage1Complete:
    results: tuple[MemberAnswer, ...]
    failed: tuple[Failure, ...]
    type = "stage1_complete"

    def data(self) -> dict[str, Any]:
        return {"results": answers_json(self.results), "failed": [dict(f) for f in self.failed]}


@dataclass(frozen=True)
class Stage2Start:
    label_to_model: Mapping[str, str]
    type = "stage2_start"

    def data(self) -> dict[str, Any]:
        return {"label_to_model": dict(self.label_to_model)}


@dataclass(frozen=True)
class Stage2Member:
    """A member's ranking and the labels read from it, or why it has none (``error`` set)."""

    model: str
    ranking: str | None = None
    parsed_ranking: tuple[str, ...] = ()
    error: str | None = None
    type = "stage2_member"

    def data(self) -> dict[str, Any]:
        if self.error is not None:
            return {"model": self.model, "ok": False, "error": self.error}
        return {
            "model": self.model,
            "ok": True,
            "ranking": self.ranking,
            "parsed_ranking": list(self.parsed_ranking),
        }


@dataclass(frozen=True)
class Stage2Complete:
    rankings: tuple[MemberRanking, ...]
    label_to_model: Mapping[str, str]
    aggregate_rankings: tuple[Standing, ...]
    failed: tuple[Failure, ...]
    type = "stage2_complete"

    def data(self) -> dict[str, Any]:
        return {
            "rankings": rankings_json(self.rankings),
            "label_to_model": dict(self.label_to_model),
            "aggregate_rankings": standings_json(self.aggregate_rankings),
            "failed": [dict(f) for f in self.failed],
        }


@dataclass(frozen=True)
class Stage3Start:
    model: str
    type = "stage3_start"

    def data(self) -> dict[str, Any]:
        return {"model": self.model}


@dataclass(frozen=True)
class Stage3Complete:
    """The synthesis, as ``Job.stage3`` keeps it."""

    synthesis: Mapping[str, Any]
    type = "stage3_complete"

    def data(self) -> dict[str, Any]:
        return dict(self.synthesis)


@dataclass(frozen=True)
class TitleComplete:
    title: str
    type = "title_complete"

    def data(self) -> dict[str, Any]:
        return {"title": self.title}


@dataclass(frozen=True)
class Resumed:
    """The job was interrupted by a restart and goes on after ``completed_stage``."""

    completed_stage: int
    type = "resumed"

    def data(self) -> dict[str, Any]:
        return {"completed_stage": self.completed_stage}


@dataclass(frozen=True)
class Complete:
    """The last event of a job that answered."""

    type = "complete"

    def data(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class Failed:
    """The last event of a job that failed; ``recorded`` False when even it could not be
    written (its live followers see it all the same)."""

    message: str
    recorded: bool = True
    type = "error"

    def data(self) -> dict[str, Any]:
        if self.recorded:
            return {"message": self.message}
        return {"message": self.message, "recorded": False}
