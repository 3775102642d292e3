"""The proxy's own statistics, as Prometheus is shown them: what it counted since it started
(``Counters``, fed every audit record: steps, refusals, pauses and resumes, calls and tokens,
latency histograms) and ``ProxyStatistics``, those counts frozen together with the figures of
one ``snapshot.Snapshot`` (the state at that moment) for ``http/readouts/prometheus.py`` to
render.

The core owns the counting; the renderer only ever sees a ``ProxyStatistics``, so rendering
never touches live state and needs no locks.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from .audit.records import RejectionRecord, StepRecord, TransitionRecord
from .programs import ProgramStatus

if TYPE_CHECKING:
    from .snapshot import Snapshot

#: Upper bounds (seconds) of the latency buckets: from a cached prefill (milliseconds) to a wait
#: behind a paused program (minutes). Fixed, so histograms from different runs add up.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)

#: The latencies of one step, as the ``steps`` table splits them.
HISTOGRAM_NAMES: tuple[str, ...] = ("ttft", "prefill", "decode", "queue_wait")

#: Distinct ``model`` label values kept; calls of any further name count under ``OTHER``. A
#: backend whose models are not known yet serves any name a client makes up, and each name
#: would be a new series in every scraper.
MAX_MODELS = 64
OTHER = "_other"
#: The ``backend`` label of a call that reached none (its client left while it waited).
NO_BACKEND = "none"
#: Kinds of tokens counted per model and backend, as the usage reports them.
TOKEN_KINDS = ("prompt", "completion", "cached")

#: (model, backend): a call's labels.
CallKey = tuple[str, str]


@dataclass(frozen=True)
class HistogramSnapshot:
    """Observations per bucket: ``counts[i]`` fell in ``(bounds[i-1], bounds[i]]``; the last
    count is past the last bound (Prometheus' ``+Inf``). Not cumulative."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it), ending with (+inf, count)."""
        running = 0
        out = []
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


class Histograms:
    """Latency histograms with fixed buckets, one per name. ``observe`` is O(log buckets)."""

    def __init__(
        self,
        names: Iterable[str] = HISTOGRAM_NAMES,
        bounds: tuple[float, ...] = LATENCY_BUCKETS,
    ) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError("histogram bounds must be a non-empty, strictly increasing tuple")
        self.bounds = bounds
        self._counts = {name: [0] * (len(bounds) + 1) for name in names}
        self._sums = dict.fromkeys(self._counts, 0.0)
        #: Values refused (negative, NaN or infinite): a clock bug upstream, never a latency.
        self.rejected = 0

    def observe(self, name: str, value: float) -> None:
        counts = self._counts.get(name)
        if counts is None:
            raise KeyError(
                f"no histogram named {name!r}; known: {', '.join(self._counts)} "
                "(pass extra names to Histograms(names=...))"
            )
        if not math.isfinite(value) or value < 0:
            self.rejected += 1
            return
        counts[bisect.bisect_left(self.bounds, value)] += 1
        self._sums[name] += value

    def snapshot(self) -> Mapping[str, HistogramSnapshot]:
        return MappingProxyType(
            {
                name: HistogramSnapshot(self.bounds, tuple(counts), self._sums[name])
                for name, counts in self._counts.items()
            }
        )


@dataclass(frozen=True)
class BackendStatistics:
    """One backend's figures for Prometheus, from its ``BackendSnapshot`` (None: not known,
    e.g. no metrics)."""

    url: str
    healthy: bool
    kv_capacity_tokens: int | None = None
    kv_used_tokens: int | None = None
    #: Calls sent to it and not yet finished.
    in_flight: int = 0


def _frozen(mapping: Mapping[str, int] | None) -> Mapping[str, int]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class ProxyStatistics:
    """Everything Prometheus is shown at one moment: a ``Snapshot``'s figures flattened to
    labels and numbers, and the counts since start (``Counters.view``)."""

    #: Programs per state ("reasoning", "acting", "paused", ...).
    programs_by_state: Mapping[str, int] = field(default_factory=lambda: _frozen(None))
    backends: tuple[BackendStatistics, ...] = ()
    #: Finished steps per HTTP status ("200", "499", "502", ...).
    steps_by_status: Mapping[str, int] = field(default_factory=lambda: _frozen(None))
    pauses: int = 0
    resumes: int = 0
    audit_rows_written: int = 0
    audit_rows_dropped: int = 0
    #: Audit batches tried again after SQLite's write lock stayed held past the busy timeout.
    audit_busy_retries: int = 0
    #: Audit db files found deleted or replaced and created again; 1 while that degrades.
    audit_db_recreated: int = 0
    audit_degraded: bool = False
    #: The supervised components: 1 if up (starting or running), and restarts so far.
    components_up: Mapping[str, int] = field(default_factory=lambda: _frozen(None))
    component_restarts: Mapping[str, int] = field(default_factory=lambda: _frozen(None))
    histograms: Mapping[str, HistogramSnapshot] = field(
        default_factory=lambda: Histograms().snapshot()
    )
    #: Calls refused before any backend saw them, by (reason, HTTP status).
    refusals: Mapping[tuple[str, str], int] = field(default_factory=dict)
    #: Finished calls by (model, backend, HTTP status).
    calls: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    #: Reported tokens by (model, backend, kind): kind one of ``TOKEN_KINDS``.
    tokens: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    #: Arrival to end of every call that reached a backend, streamed or not, by (model, backend).
    call_seconds: Mapping[CallKey, HistogramSnapshot] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Callers pass plain dicts; keep read-only copies so the snapshot cannot change later.
        object.__setattr__(self, "programs_by_state", _frozen(self.programs_by_state))
        object.__setattr__(self, "steps_by_status", _frozen(self.steps_by_status))
        object.__setattr__(self, "components_up", _frozen(self.components_up))
        object.__setattr__(self, "component_restarts", _frozen(self.component_restarts))
        object.__setattr__(self, "histograms", MappingProxyType(dict(self.histograms)))
        for name in ("refusals", "calls", "tokens", "call_seconds"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))


def from_snapshot(
    snapshot: Snapshot,
    *,
    steps_by_status: Mapping[str, int] | None = None,
    pauses: int = 0,
    resumes: int = 0,
    histograms: Mapping[str, HistogramSnapshot] | None = None,
    refusals: Mapping[tuple[str, str], int] | None = None,
    calls: Mapping[tuple[str, str, str], int] | None = None,
    tokens: Mapping[tuple[str, str, str], int] | None = None,
    call_seconds: Mapping[CallKey, HistogramSnapshot] | None = None,
) -> ProxyStatistics:
    """The Prometheus view of the proxy's one snapshot, plus the counters the snapshot does not
    carry (the core counts steps, pauses and resumes as they happen). KV tokens in use are the
    backend's reported fraction of its capacity; unknown when either is."""
    backends = []
    for backend in snapshot.backends:
        engine = backend.engine
        capacity = backend.capacity_tokens
        used = None
        if engine is not None and engine.kv_usage is not None and capacity is not None:
            used = round(engine.kv_usage * capacity)
        backends.append(
            BackendStatistics(
                url=backend.url,
                healthy=backend.healthy,
                kv_capacity_tokens=capacity,
                kv_used_tokens=used,
                in_flight=backend.in_flight,
            )
        )
    return ProxyStatistics(
        programs_by_state={status.value: n for status, n in snapshot.by_status.items()},
        backends=tuple(backends),
        steps_by_status=steps_by_status or {},
        pauses=pauses,
        resumes=resumes,
        audit_rows_written=snapshot.audit.written,
        audit_rows_dropped=snapshot.audit.dropped,
        audit_busy_retries=snapshot.audit.busy_retries,
        audit_db_recreated=snapshot.audit.db_recreated,
        audit_degraded=snapshot.audit.degraded is not None,
        components_up={c.name: int(c.up) for c in snapshot.components},
        component_restarts={c.name: c.restarts for c in snapshot.components},
        histograms=histograms if histograms is not None else Histograms().snapshot(),
        refusals=refusals or {},
        calls=calls or {},
        tokens=tokens or {},
        call_seconds=call_seconds or {},
    )


class Counters:
    """What Prometheus counts, learnt in one place: every audit record passes through
    ``observe`` (``AuditLog.observers``), so steps, refusals, pauses and resumes are counted
    exactly as they are recorded, whichever part of the proxy recorded them. Each record costs
    a few dict updates; the label sets are bounded (reasons are error classes, backends the
    pool's nodes, models at most ``MAX_MODELS`` names), never program ids."""

    def __init__(self) -> None:
        self.steps_by_status: dict[str, int] = {}
        self.pauses = 0
        self.resumes = 0
        self.histograms = Histograms()
        self.refusals: dict[tuple[str, str], int] = {}
        self.calls: dict[tuple[str, str, str], int] = {}
        self.tokens: dict[tuple[str, str, str], int] = {}
        self.call_seconds: dict[CallKey, Histograms] = {}
        self._models: set[str] = set()

    def observe(self, record: object) -> None:
        if isinstance(record, StepRecord):
            self._step(record)
        elif isinstance(record, RejectionRecord):
            key = (record.reason, str(record.status))
            self.refusals[key] = self.refusals.get(key, 0) + 1
        elif isinstance(record, TransitionRecord):
            moved = record.transition
            if moved.to_status is ProgramStatus.PAUSED:
                self.pauses += 1
            elif moved.from_status is ProgramStatus.PAUSED and moved.to_status in (
                ProgramStatus.REASONING,
                ProgramStatus.ACTING,
            ):
                self.resumes += 1

    def _model(self, model: str | None) -> str:
        name = model or ""
        if name in self._models:
            return name
        if len(self._models) >= MAX_MODELS:
            return OTHER
        self._models.add(name)
        return name

    def _step(self, step: StepRecord) -> None:
        status = str(step.status)
        self.steps_by_status[status] = self.steps_by_status.get(status, 0) + 1
        model = self._model(step.model)
        backend = step.backend or NO_BACKEND
        key = (model, backend, status)
        self.calls[key] = self.calls.get(key, 0) + 1
        counts = (step.prompt_tokens, step.completion_tokens, step.cached_tokens)
        for kind, n in zip(TOKEN_KINDS, counts, strict=True):
            if n is not None and n > 0:  # a counter never goes down
                tokens = (model, backend, kind)
                self.tokens[tokens] = self.tokens.get(tokens, 0) + n
        if step.sent_at is None:
            return  # never sent: it has no latencies, only its count
        per_call = self.call_seconds.get((model, backend))
        if per_call is None:
            per_call = self.call_seconds[(model, backend)] = Histograms(names=("call",))
        per_call.observe("call", step.finished_at - step.arrived_at)
        self.histograms.observe("queue_wait", step.queue_s)
        first = step.first_token_at
        if first is None or step.status >= 400:
            return  # a failed call's timings measure the failure, not the model
        self.histograms.observe("ttft", first - step.arrived_at)
        self.histograms.observe("prefill", first - step.sent_at)
        self.histograms.observe("decode", step.finished_at - first)

    def view(self, snapshot: Snapshot) -> ProxyStatistics:
        """The Prometheus view of ``snapshot`` with these counters."""
        return from_snapshot(
            snapshot,
            steps_by_status=self.steps_by_status,
            pauses=self.pauses,
            resumes=self.resumes,
            histograms=self.histograms.snapshot(),
            refusals=self.refusals,
            calls=self.calls,
            tokens=self.tokens,
            call_seconds={key: h.snapshot()["call"] for key, h in self.call_seconds.items()},
        )
