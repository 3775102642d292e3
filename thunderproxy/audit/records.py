"""Rows of the audit log. Times inside records are trio clock readings; the writer turns them
into Unix seconds with the run's WallClock, so producers never touch the wall clock."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol

from ..errors import ThunderproxyError, describe, reason
from ..steps import StepUsage, Transition

ToUnix = Callable[[float], float]


class AuditRecord(Protocol):
    table: ClassVar[str]

    def row(self, to_unix: ToUnix) -> dict[str, Any]: ...


def _stamped(record: Any, to_unix: ToUnix) -> dict[str, Any]:
    """The record's fields as a row, its ``at`` time made Unix seconds."""
    row = asdict(record)
    row["at"] = to_unix(record.at)
    return row


def _unix(to_unix: ToUnix, value: float | None) -> float | None:
    return None if value is None else to_unix(value)


@dataclass(frozen=True)
class TransitionRecord:
    table: ClassVar[str] = "transitions"
    transition: Transition

    def row(self, to_unix: ToUnix) -> dict[str, Any]:
        t = self.transition
        return {
            "at": to_unix(t.at),
            "program_id": t.program_id,
            "from_status": None if t.from_status is None else t.from_status.value,
            "to_status": t.to_status.value,
            "reason": t.reason,
            "backend": t.backend,
            "step": t.step,
            "source": t.source,
        }


class LeaseLike(Protocol):
    """What a step row needs of the scheduler's lease (scheduling's StepLease)."""

    @property
    def request_id(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def arrived_at(self) -> float: ...
    @property
    def sent_at(self) -> float: ...
    @property
    def tool_s(self) -> float | None: ...


class DecisionLike(Protocol):
    """What a decision row needs of a scheduling decision (scheduling.tr.Decision)."""

    @property
    def action(self) -> str: ...
    @property
    def program_id(self) -> str: ...
    @property
    def rule(self) -> str: ...
    @property
    def backend(self) -> str | None: ...
    @property
    def target_backend(self) -> str | None: ...
    @property
    def capacity_tokens(self) -> int | None: ...
    @property
    def used_tokens(self) -> int | None: ...
    @property
    def program_tokens(self) -> int | None: ...
    @property
    def idle_s(self) -> float | None: ...
    @property
    def waited_s(self) -> float | None: ...
    @property
    def queue_position(self) -> int | None: ...
    @property
    def detail(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class StepRecord:
    """One proxied LLM call, whatever its outcome."""

    table: ClassVar[str] = "steps"
    request_id: str
    program_id: str
    step: int
    backend: str | None
    endpoint: str
    model: str | None
    stream: bool
    arrived_at: float
    sent_at: float | None
    first_token_at: float | None
    finished_at: float
    tool_s: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    status: int
    error: str | None = None
    #: How the call was tied to its program (recognition's Source value), and for a prompt
    #: continuation how many messages matched; None where the caller did not say.
    source: str | None = None
    matched_messages: int | None = None
    #: The model the call was sent to, where ``model`` (the one asked for) went elsewhere or
    #: not; None for a call that reached no backend.
    served_model: str | None = None
    #: The program's latency class (scheduling/classes.py) when the call went out, or when it
    #: ended unsent; None where the scheduler did not say.
    program_class: str | None = None
    #: The configured client that sent the call (``[clients]``); None without client keys.
    client: str | None = None

    @classmethod
    def from_outcome(
        cls,
        lease: LeaseLike,
        *,
        program_id: str,
        backend: str,
        endpoint: str,
        model: str | None,
        stream: bool,
        usage: StepUsage,
        status: int,
        first_token_at: float | None,
        finished_at: float,
        error: str | None,
        source: str | None = None,
        matched_messages: int | None = None,
        served_model: str | None = None,
        program_class: str | None = None,
        client: str | None = None,
    ) -> StepRecord:
        """The row of a call that reached a backend (``lease`` is its scheduler lease)."""
        return cls(
            request_id=lease.request_id,
            program_id=program_id,
            step=lease.step,
            backend=backend,
            endpoint=endpoint,
            model=model,
            stream=stream,
            arrived_at=lease.arrived_at,
            sent_at=lease.sent_at,
            first_token_at=first_token_at,
            finished_at=finished_at,
            tool_s=lease.tool_s,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            status=status,
            error=error,
            source=source,
            matched_messages=matched_messages,
            served_model=served_model,
            program_class=program_class,
            client=client,
        )

    @classmethod
    def never_sent(
        cls,
        *,
        program_id: str,
        step: int,
        endpoint: str,
        model: str | None,
        stream: bool,
        arrived_at: float,
        finished_at: float,
        status: int,
        error: str,
        source: str | None = None,
        matched_messages: int | None = None,
        program_class: str | None = None,
        client: str | None = None,
    ) -> StepRecord:
        """The row of a call that ended while it waited for its program to be resumed."""
        return cls(
            request_id=f"{program_id}-queued",
            program_id=program_id,
            step=step,
            backend=None,
            endpoint=endpoint,
            model=model,
            stream=stream,
            arrived_at=arrived_at,
            sent_at=None,
            first_token_at=None,
            finished_at=finished_at,
            tool_s=None,
            prompt_tokens=None,
            completion_tokens=None,
            cached_tokens=None,
            status=status,
            error=error,
            source=source,
            matched_messages=matched_messages,
            program_class=program_class,
            client=client,
        )

    @property
    def queue_s(self) -> float:
        return (self.sent_at if self.sent_at is not None else self.finished_at) - self.arrived_at

    def row(self, to_unix: ToUnix) -> dict[str, Any]:
        first, sent = self.first_token_at, self.sent_at
        return {
            "request_id": self.request_id,
            "program_id": self.program_id,
            "step": self.step,
            "backend": self.backend,
            "endpoint": self.endpoint,
            "model": self.model,
            "stream": int(self.stream),
            "arrived_at": to_unix(self.arrived_at),
            "sent_at": _unix(to_unix, sent),
            "first_token_at": _unix(to_unix, first),
            "finished_at": to_unix(self.finished_at),
            "queue_s": self.queue_s,
            "ttft_s": None if first is None else first - self.arrived_at,
            "prefill_s": None if first is None or sent is None else first - sent,
            "decode_s": None if first is None else self.finished_at - first,
            "total_s": self.finished_at - self.arrived_at,
            "tool_s": self.tool_s,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "status": self.status,
            "error": self.error,
            "source": self.source,
            "matched_messages": self.matched_messages,
            "served_model": self.served_model,
            "program_class": self.program_class,
            "client": self.client,
        }


@dataclass(frozen=True)
class BackendSample:
    """One metrics poll of one backend."""

    table: ClassVar[str] = "backend_samples"
    at: float
    backend: str
    healthy: bool
    capacity_tokens: int | None
    kv_usage: float | None
    running: int | None
    waiting: int | None
    prefix_queries_total: float | None
    prefix_hits_total: float | None
    preemptions_total: float | None
    programs: int
    active_tokens: int
    error: str | None = None
    #: The CPU KV tier and what its copies brought back to the GPU (migration 011).
    cpu_capacity_tokens: int | None = None
    offload_load_bytes_total: float | None = None
    offload_load_seconds_total: float | None = None

    def row(self, to_unix: ToUnix) -> dict[str, Any]:
        row = _stamped(self, to_unix)
        row["healthy"] = int(self.healthy)
        return row


@dataclass(frozen=True)
class DecisionRecord:
    """One scheduling decision with the inputs it was made on (the ``decisions`` table)."""

    table: ClassVar[str] = "decisions"
    at: float
    program_id: str
    action: str
    rule: str
    backend: str | None
    target_backend: str | None
    capacity_tokens: int | None
    used_tokens: int | None
    program_tokens: int | None
    idle_s: float | None
    waited_s: float | None
    queue_position: int | None
    detail: str | None

    @classmethod
    def from_decision(cls, decision: DecisionLike, at: float) -> DecisionRecord:
        return cls(
            at=at,
            program_id=decision.program_id,
            action=str(decision.action),
            rule=decision.rule,
            backend=decision.backend,
            target_backend=decision.target_backend,
            capacity_tokens=decision.capacity_tokens,
            used_tokens=decision.used_tokens,
            program_tokens=decision.program_tokens,
            idle_s=decision.idle_s,
            waited_s=decision.waited_s,
            queue_position=decision.queue_position,
            detail=json.dumps(decision.detail) if decision.detail else None,
        )

    def row(self, to_unix: ToUnix) -> dict[str, Any]:
        return _stamped(self, to_unix)


@dataclass(frozen=True)
class RejectionRecord:
    """A request refused before it reached a backend (the ``rejections`` table)."""

    table: ClassVar[str] = "rejections"
    at: float
    method: str
    path: str
    status: int
    error_type: str
    message: str
    program_id: str | None = None
    #: The refusing error's class (``errors.reason``), counted by the metrics, not stored.
    reason: str = "other"
    #: The configured client that sent it, once its key was checked; None otherwise.
    client: str | None = None

    @classmethod
    def refused(
        cls,
        error: ThunderproxyError,
        *,
        at: float,
        method: str,
        path: str,
        program_id: str | None,
        client: str | None,
    ) -> RejectionRecord:
        """The row of a request ``error`` refused: its status and type from the one table
        (errors.py), its message, and its class as the reason. Every refusal is told this way,
        the gateway's and both HTTP paths' alike."""
        status, error_type = describe(error)
        return cls(
            at=at,
            method=method,
            path=path,
            status=status,
            error_type=error_type,
            message=error.message,
            program_id=program_id,
            reason=reason(error),
            client=client,
        )

    def row(self, to_unix: ToUnix) -> dict[str, Any]:
        row = _stamped(self, to_unix)
        del row["reason"]
        return row
