"""The Prometheus exposition, read back with prometheus_client's own parser, and the histogram
accumulator behind it."""

from __future__ import annotations

import math
import platform
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from thunderproxy import __version__
from thunderproxy import snapshot as snapshot_module
from thunderproxy.audit.records import RejectionRecord, StepRecord
from thunderproxy.audit.writer import AuditStatistics
from thunderproxy.backends.metrics import EngineSnapshot
from thunderproxy.errors import ModelNotFound, NoBackendAvailable, NotReady, RateLimited, reason
from thunderproxy.http.readouts.prometheus import (
    CONTENT_TYPE,
    PROMETHEUS_PATH,
    render,
    wants_prometheus,
)
from thunderproxy.programs import ProgramStatus
from thunderproxy.programs.registry import BackendLoad
from thunderproxy.statistics import (
    LATENCY_BUCKETS,
    MAX_MODELS,
    OTHER,
    BackendStatistics,
    Counters,
    Histograms,
    ProxyStatistics,
    from_snapshot,
)


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def types(text: bytes) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text.decode())}


def snapshot(**overrides: Any) -> ProxyStatistics:
    histograms = Histograms()
    for value in (0.003, 0.2, 0.25, 7.0, 900.0):
        histograms.observe("ttft", value)
    histograms.observe("queue_wait", 12.0)
    fields: dict[str, Any] = {
        "programs_by_state": {"reasoning": 3, "acting": 5, "paused": 1},
        "backends": (
            BackendStatistics("http://gpu0:8000", True, 400_000, 123_456, 7),
            BackendStatistics('http://odd"name\\:1', False, None, None, 0),
        ),
        "steps_by_status": {"200": 40, "499": 2},
        "pauses": 4,
        "resumes": 3,
        "audit_rows_written": 500,
        "audit_rows_dropped": 1,
        "histograms": histograms.snapshot(),
    }
    return ProxyStatistics(**(fields | overrides))


def test_every_figure_reads_back_with_prometheus_clients_parser() -> None:
    got = samples(render(snapshot()))
    assert got[("thunderproxy_programs", (("state", "reasoning"),))] == 3
    assert got[("thunderproxy_programs", (("state", "paused"),))] == 1
    gpu0 = (("backend", "http://gpu0:8000"),)
    assert got[("thunderproxy_backend_healthy", gpu0)] == 1
    assert got[("thunderproxy_backend_kv_capacity_tokens", gpu0)] == 400_000
    assert got[("thunderproxy_backend_kv_used_tokens", gpu0)] == 123_456
    assert got[("thunderproxy_backend_in_flight", gpu0)] == 7
    odd = (("backend", 'http://odd"name\\:1'),)  # escaped on the way out, intact on the way in
    assert got[("thunderproxy_backend_healthy", odd)] == 0
    assert ("thunderproxy_backend_kv_capacity_tokens", odd) not in got  # unknown, not zero
    assert got[("thunderproxy_steps_total", (("status", "200"),))] == 40
    assert got[("thunderproxy_steps_total", (("status", "499"),))] == 2
    assert got[("thunderproxy_pauses_total", ())] == 4
    assert got[("thunderproxy_resumes_total", ())] == 3
    assert got[("thunderproxy_audit_rows_written_total", ())] == 500
    assert got[("thunderproxy_audit_rows_dropped_total", ())] == 1


def test_histograms_are_cumulative_with_sum_and_count() -> None:
    got = samples(render(snapshot()))

    def bucket(le: str) -> float:
        return got[("thunderproxy_ttft_seconds_bucket", (("le", le),))]

    assert bucket("0.005") == 1
    assert bucket("0.25") == 3  # 0.25 itself is "less or equal"
    assert bucket("10.0") == 4
    assert bucket("600.0") == 4
    assert bucket("+Inf") == 5
    assert got[("thunderproxy_ttft_seconds_count", ())] == 5
    assert math.isclose(got[("thunderproxy_ttft_seconds_sum", ())], 0.003 + 0.2 + 0.25 + 7 + 900)
    assert got[("thunderproxy_queue_wait_seconds_count", ())] == 1
    assert got[("thunderproxy_decode_seconds_count", ())] == 0


def test_metric_types() -> None:
    got = types(render(snapshot()))
    assert got["thunderproxy_programs"] == "gauge"
    assert got["thunderproxy_steps"] == "counter"
    assert got["thunderproxy_ttft_seconds"] == "histogram"
    assert got["thunderproxy_prefill_seconds"] == "histogram"


def test_an_empty_snapshot_renders() -> None:
    got = samples(render(ProxyStatistics()))
    assert got[("thunderproxy_pauses_total", ())] == 0
    assert got[("thunderproxy_ttft_seconds_count", ())] == 0


def test_renders_are_independent() -> None:
    """No global registry: one proxy's figures never leak into another's."""
    a = render(snapshot(pauses=1))
    b = render(snapshot(pauses=2))
    assert samples(a)[("thunderproxy_pauses_total", ())] == 1
    assert samples(b)[("thunderproxy_pauses_total", ())] == 2
    assert b"thunderproxy" not in generate_latest(REGISTRY)


def test_the_snapshot_cannot_change_after_it_is_taken() -> None:
    states = {"reasoning": 1}
    histograms = Histograms()
    s = ProxyStatistics(programs_by_state=states, histograms=histograms.snapshot())
    states["reasoning"] = 9
    histograms.observe("ttft", 1.0)
    assert s.programs_by_state["reasoning"] == 1
    assert s.histograms["ttft"].count == 0
    with pytest.raises(TypeError):
        s.programs_by_state["acting"] = 2  # type: ignore[index]


def test_histograms_refuse_impossible_values_and_unknown_names() -> None:
    h = Histograms()
    for bad in (-0.1, math.nan, math.inf):
        h.observe("ttft", bad)
    assert h.rejected == 3
    assert h.snapshot()["ttft"].count == 0
    with pytest.raises(KeyError, match="known: ttft"):
        h.observe("latency", 1.0)
    with pytest.raises(ValueError, match="increasing"):
        Histograms(bounds=(1.0, 0.5))


def test_bucket_edges() -> None:
    h = Histograms(names=["x"], bounds=(1.0, 2.0))
    for value in (0.0, 1.0, 1.5, 2.0, 2.1):
        h.observe("x", value)
    assert h.snapshot()["x"].counts == (2, 2, 1)
    assert h.snapshot()["x"].cumulative() == [(1.0, 2), (2.0, 4), (math.inf, 5)]
    assert tuple(sorted(LATENCY_BUCKETS)) == LATENCY_BUCKETS


PROMETHEUS_2 = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
PROMETHEUS_3 = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;"
    "escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)
BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


@pytest.mark.parametrize(
    ("accept", "path", "expected"),
    [
        pytest.param(PROMETHEUS_2, "/metrics", True, id="prometheus-2"),
        pytest.param(PROMETHEUS_3, "/metrics", True, id="prometheus-3"),
        pytest.param("text/plain", "/metrics", True, id="text-plain"),
        pytest.param(BROWSER, "/metrics", False, id="browser"),
        pytest.param("*/*", "/metrics", False, id="curl"),
        pytest.param(None, "/metrics", False, id="no-accept"),
        pytest.param("application/json", "/metrics", False, id="json"),
        pytest.param("application/json, text/plain;q=0.5", "/metrics", False, id="json-preferred"),
        pytest.param("text/plain;q=0", "/metrics", False, id="refused"),
        # Weights outside HTTP's 0..1 (NaN, infinity) count as 0.
        pytest.param("text/plain;q=1e999", "/metrics", False, id="infinite-weight"),
        pytest.param("application/json;q=nan, text/plain", "/metrics", True, id="nan-weight"),
        pytest.param(None, PROMETHEUS_PATH, True, id="documented-path"),
        pytest.param("application/json", PROMETHEUS_PATH + "/", True, id="path-beats-accept"),
        pytest.param(PROMETHEUS_3, "/health", False, id="other-path"),
    ],
)
def test_wants_prometheus(accept: str | None, path: str, expected: bool) -> None:
    assert wants_prometheus(accept, path) is expected


def test_content_type_is_the_text_format() -> None:
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")


def test_the_proxys_snapshot_becomes_the_prometheus_view() -> None:
    engine = EngineSnapshot(
        flavour="vllm",
        engines=1,
        capacity_tokens=200_000,
        block_size=16,
        num_gpu_blocks=12_500,
        kv_usage=0.25,
        running=3,
        waiting=0,
        prefix_queries_total=None,
        prefix_hits_total=None,
        preemptions_total=None,
    )

    def backend(url: str, engine: EngineSnapshot | None) -> snapshot_module.BackendSnapshot:
        return snapshot_module.BackendSnapshot(
            url=url,
            healthy=engine is not None,
            last_error=None,
            in_flight=2,
            models=None,
            engine=engine,
            load=BackendLoad(),
        )

    stats = snapshot_module.Snapshot(
        router="tr",
        programs=4,
        by_status={ProgramStatus.REASONING: 1, ProgramStatus.PAUSED: 3},
        backends=(backend("http://a", engine), backend("http://b", None)),
        served_models=("m",),
        audit=AuditStatistics(accepted=10, written=9, dropped=1, queued=0, batches=2),
    )
    view = from_snapshot(stats, steps_by_status={"200": 7}, pauses=3, resumes=1)
    got = samples(render(view))
    assert got[("thunderproxy_programs", (("state", "paused"),))] == 3
    assert got[("thunderproxy_backend_kv_used_tokens", (("backend", "http://a"),))] == 50_000
    assert ("thunderproxy_backend_kv_used_tokens", (("backend", "http://b"),)) not in got
    assert got[("thunderproxy_backend_healthy", (("backend", "http://b"),))] == 0
    assert got[("thunderproxy_audit_rows_dropped_total", ())] == 1
    assert got[("thunderproxy_steps_total", (("status", "200"),))] == 7
    assert got[("thunderproxy_pauses_total", ())] == 3


EMPTY = snapshot_module.Snapshot(
    router="default",
    programs=0,
    by_status={},
    backends=(),
    served_models=(),
    audit=AuditStatistics(accepted=0, written=0, dropped=0, queued=0, batches=0),
)


def _step(model: str, backend: str | None, status: int = 200, **fields: Any) -> StepRecord:
    values: dict[str, Any] = {
        "request_id": "r",
        "program_id": "p",
        "step": 1,
        "backend": backend,
        "endpoint": "/v1/chat/completions",
        "model": model,
        "stream": False,
        "arrived_at": 10.0,
        "sent_at": 10.5 if backend else None,
        "first_token_at": None,
        "finished_at": 13.0,
        "tool_s": None,
        "prompt_tokens": 100,
        "completion_tokens": 20,
        "cached_tokens": 64,
        "status": status,
    }
    return StepRecord(**(values | fields))


def test_counters_split_calls_tokens_and_refusals_by_bounded_labels() -> None:
    counters = Counters()
    gpu0 = "http://gpu0:8000"
    counters.observe(_step("a", gpu0))  # not streamed: no first token, still timed whole
    counters.observe(_step("a", gpu0, status=502, prompt_tokens=None, completion_tokens=None))
    counters.observe(_step("b", None, status=499))  # the client left while it waited
    for why, status in (("model_not_found", 404), ("rate_limited", 429), ("rate_limited", 429)):
        counters.observe(
            RejectionRecord(1.0, "POST", "/v1/chat/completions", status, "t", "m", reason=why)
        )
    got = samples(render(counters.view(EMPTY)))
    assert (
        got[("thunderproxy_refusals_total", (("reason", "rate_limited"), ("status", "429")))] == 2
    )
    assert (
        got[("thunderproxy_refusals_total", (("reason", "model_not_found"), ("status", "404")))]
        == 1
    )
    a0 = (("backend", gpu0), ("model", "a"))
    assert got[("thunderproxy_calls_total", (*a0, ("status", "200")))] == 1
    assert got[("thunderproxy_calls_total", (*a0, ("status", "502")))] == 1
    assert (
        got[("thunderproxy_calls_total", (("backend", "none"), ("model", "b"), ("status", "499")))]
        == 1
    )
    assert got[("thunderproxy_tokens_total", (*a0[:1], ("kind", "prompt"), a0[1]))] == 100
    assert got[("thunderproxy_tokens_total", (*a0[:1], ("kind", "completion"), a0[1]))] == 20
    assert got[("thunderproxy_tokens_total", (*a0[:1], ("kind", "cached"), a0[1]))] == 128
    # Both calls that reached a backend are timed, arrival to end; the one that never did is not.
    assert got[("thunderproxy_call_seconds_count", a0)] == 2
    assert got[("thunderproxy_call_seconds_sum", a0)] == 6.0
    assert ("thunderproxy_call_seconds_count", (("backend", "none"), ("model", "b"))) not in got
    assert (
        got[
            (
                "thunderproxy_build_info",
                (("python", platform.python_version()), ("version", __version__)),
            )
        ]
        == 1
    )


def test_model_names_past_the_bound_count_as_other() -> None:
    counters = Counters()
    for i in range(MAX_MODELS + 10):
        counters.observe(_step(f"made-up-{i}", "http://gpu0:8000"))
    models = {model for model, _, _ in counters.calls}
    assert len(models) == MAX_MODELS + 1
    assert counters.calls[(OTHER, "http://gpu0:8000", "200")] == 10


def test_a_refusal_reason_is_its_error_class() -> None:
    assert reason(ModelNotFound("x", ["a"])) == "model_not_found"
    assert reason(RateLimited("full", retry_after_s=1.0)) == "rate_limited"
    assert reason(NotReady("starting", retry_after_s=1.0)) == "not_ready"
    assert reason(NoBackendAvailable("none")) == "no_backend_available"
