"""The proxy's own metrics in Prometheus' text format, rendered from one ``ProxyStatistics``.

Served at ``/metrics/prometheus``, and at ``/metrics`` to a client whose ``Accept`` prefers the
Prometheus formats (a Prometheus scraper does; browsers and curl get the JSON ``/metrics``).
A fresh registry per render, holding one collector over the snapshot: nothing global, so two
proxies in one process (tests, the bench) never see each other's metrics.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ... import __version__
from ...statistics import HistogramSnapshot, ProxyStatistics

PROMETHEUS_PATH = "/metrics/prometheus"
#: Text format 0.0.4: every Prometheus version reads it (it is in the scraper's Accept list).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "thunderproxy"

_PROMETHEUS_TYPES = frozenset({"application/openmetrics-text", "text/plain"})

#: Help text per histogram name; an unknown name still renders, with a generic help.
_HISTOGRAM_HELP = {
    "ttft": "Seconds from a call's arrival to its first generated token.",
    "prefill": "Seconds from sending a call upstream to its first generated token.",
    "decode": "Seconds from the first generated token to the end of the answer.",
    "queue_wait": "Seconds a call waited for its program to be admitted or resumed.",
}


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: ProxyStatistics) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        yield from _programs(s)
        yield from _backends(s)
        yield from _steps_and_audit(s)
        yield from _components(s)
        yield from _latencies(s)
        yield from _by_label(s)
        build = GaugeMetricFamily(
            f"{PREFIX}_build_info",
            "Always 1; the labels name the running version.",
            labels=["version", "python"],
        )
        build.add_metric([__version__, platform.python_version()], 1.0)
        yield build


def _programs(s: ProxyStatistics) -> Iterator[Metric]:
    programs = GaugeMetricFamily(
        f"{PREFIX}_programs", "Tracked programs, by state.", labels=["state"]
    )
    for state, n in sorted(s.programs_by_state.items()):
        programs.add_metric([state], n)
    yield programs


def _backends(s: ProxyStatistics) -> Iterator[Metric]:
    healthy = GaugeMetricFamily(
        f"{PREFIX}_backend_healthy", "1 if the backend is healthy.", labels=["backend"]
    )
    capacity = GaugeMetricFamily(
        f"{PREFIX}_backend_kv_capacity_tokens",
        "KV cache capacity of the backend, in tokens.",
        labels=["backend"],
    )
    used = GaugeMetricFamily(
        f"{PREFIX}_backend_kv_used_tokens",
        "KV cache tokens in use on the backend.",
        labels=["backend"],
    )
    in_flight = GaugeMetricFamily(
        f"{PREFIX}_backend_in_flight",
        "Calls sent to the backend and not yet finished.",
        labels=["backend"],
    )
    for backend in s.backends:
        healthy.add_metric([backend.url], 1.0 if backend.healthy else 0.0)
        in_flight.add_metric([backend.url], backend.in_flight)
        # Unknown is left out rather than shown as 0, which would read as "empty".
        if backend.kv_capacity_tokens is not None:
            capacity.add_metric([backend.url], backend.kv_capacity_tokens)
        if backend.kv_used_tokens is not None:
            used.add_metric([backend.url], backend.kv_used_tokens)
    yield from (healthy, capacity, used, in_flight)


def _steps_and_audit(s: ProxyStatistics) -> Iterator[Metric]:
    steps = CounterMetricFamily(
        f"{PREFIX}_steps", "Finished LLM calls, by HTTP status.", labels=["status"]
    )
    for status, n in sorted(s.steps_by_status.items()):
        steps.add_metric([status], n)
    yield steps
    yield CounterMetricFamily(f"{PREFIX}_pauses", "Programs paused.", value=s.pauses)
    yield CounterMetricFamily(f"{PREFIX}_resumes", "Programs resumed.", value=s.resumes)
    yield CounterMetricFamily(
        f"{PREFIX}_audit_rows_written",
        "Rows written to the audit db.",
        value=s.audit_rows_written,
    )
    yield CounterMetricFamily(
        f"{PREFIX}_audit_rows_dropped",
        "Audit rows lost: refused by a full queue or by SQLite (audit.dropped_by_cause).",
        value=s.audit_rows_dropped,
    )

    yield CounterMetricFamily(
        f"{PREFIX}_audit_busy_retries",
        "Audit batches tried again because another connection held the db's write lock.",
        value=s.audit_busy_retries,
    )
    yield CounterMetricFamily(
        f"{PREFIX}_audit_db_recreated",
        "Times the audit db file was found deleted or replaced and created again.",
        value=s.audit_db_recreated,
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_audit_degraded",
        "1 while a lost audit db file keeps the proxy degraded.",
        value=1.0 if s.audit_degraded else 0.0,
    )


def _components(s: ProxyStatistics) -> Iterator[Metric]:
    up = GaugeMetricFamily(
        f"{PREFIX}_component_up",
        "1 if the long-lived component is starting or running, 0 if it failed or waits to restart.",
        labels=["component"],
    )
    restarts = CounterMetricFamily(
        f"{PREFIX}_component_restarts",
        "Restarts of the long-lived component after a failure.",
        labels=["component"],
    )
    for name, n in sorted(s.components_up.items()):
        up.add_metric([name], n)
        restarts.add_metric([name], s.component_restarts.get(name, 0))
    yield up
    yield restarts


def _latencies(s: ProxyStatistics) -> Iterator[Metric]:
    for name, histogram in sorted(s.histograms.items()):
        help_text = _HISTOGRAM_HELP.get(name, f"Seconds of {name}.")
        yield HistogramMetricFamily(
            f"{PREFIX}_{name}_seconds",
            help_text,
            buckets=_buckets(histogram),
            sum_value=histogram.sum,
        )


def _by_label(s: ProxyStatistics) -> Iterator[Metric]:
    """Refusals, calls, tokens and call latency, each by the labels that tell them apart."""
    yield _counters(
        "refusals",
        "Calls the proxy refused before any backend saw them (unknown model, admission "
        "limits, not ready, no healthy backend, bad request), by reason and HTTP status.",
        ["reason", "status"],
        s.refusals.items(),
    )

    yield _counters(
        "calls",
        "Finished LLM calls, by model (as the client named it), backend and HTTP status; "
        "backend 'none': the client left while the call waited.",
        ["model", "backend", "status"],
        s.calls.items(),
    )

    yield _counters(
        "tokens",
        "Tokens the backends reported, by model, backend and kind (prompt, completion; "
        "cached: the part of the prompt served from the prefix cache).",
        ["model", "backend", "kind"],
        s.tokens.items(),
    )

    call_seconds = HistogramMetricFamily(
        f"{PREFIX}_call_seconds",
        "Seconds from a call's arrival to its end, every call that reached a backend "
        "(streamed or not, whatever its status), by model and backend.",
        labels=["model", "backend"],
    )
    for (model, url), histogram in sorted(s.call_seconds.items()):
        call_seconds.add_metric([model, url], _buckets(histogram), histogram.sum)
    yield call_seconds


def _counters(
    name: str, help_text: str, labels: list[str], counts: Iterable[tuple[tuple[str, ...], float]]
) -> CounterMetricFamily:
    """One counter family, a sample per (label values, count) of ``counts``, sorted."""
    family = CounterMetricFamily(f"{PREFIX}_{name}", help_text, labels=labels)
    for values, n in sorted(counts):
        family.add_metric(list(values), n)
    return family


def _buckets(histogram: HistogramSnapshot) -> list[tuple[str, float]]:
    return [
        ("+Inf" if bound == float("inf") else repr(float(bound)), n)
        for bound, n in histogram.cumulative()
    ]


def render(snapshot: ProxyStatistics) -> bytes:
    """The snapshot in Prometheus' text format 0.0.4 (serve it with ``CONTENT_TYPE``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshot))
    # CPU seconds, resident memory, open files, start time: read from /proc at each scrape
    # (nothing where there is no /proc).
    ProcessCollector(registry=registry)
    return generate_latest(registry)


def _media_ranges(accept: str) -> Iterator[tuple[str, float]]:
    for item in accept.split(","):
        media, *params = (part.strip() for part in item.split(";"))
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
                if not 0.0 <= q <= 1.0:  # NaN, infinity and weights outside HTTP's range
                    q = 0.0
        if media:
            yield media.lower(), q


def wants_prometheus(accept_header: str | None, path: str) -> bool:
    """Whether this request for the metrics should get the Prometheus text rather than JSON:
    always at ``/metrics/prometheus``; at ``/metrics`` when ``Accept`` names a Prometheus format
    (``application/openmetrics-text`` or ``text/plain``) with a weight above zero and at least
    that of ``application/json``. Wildcards alone keep JSON, the endpoint's original form."""
    path = path.rstrip("/") or "/"
    if path == PROMETHEUS_PATH:
        return True
    if path != "/metrics" or not accept_header:
        return False
    prometheus = json = 0.0
    for media, q in _media_ranges(accept_header):
        if media in _PROMETHEUS_TYPES:
            prometheus = max(prometheus, q)
        elif media == "application/json":
            json = max(json, q)
    return prometheus > 0 and prometheus >= json
