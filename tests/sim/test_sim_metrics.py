"""/metrics: vLLM's names, types, labels and units per compat level; SGLang's; thundersim's."""

from __future__ import annotations

import httpx
import pytest

from thunderproxy.sim.api.exposition import fmt
from thunderproxy.sim.engine.metrics import ITL_BUCKETS, TTFT_BUCKETS, buckets_1_2_5

from .helpers import parse_metrics

BASE = {"engine", "model_name"}
# vLLM's own metric names, as the current (0.12+) compat level must expose them.
REQUIRED: dict[str, tuple[str, set[str]]] = {
    "vllm:num_requests_running": ("gauge", BASE),
    "vllm:num_requests_waiting": ("gauge", BASE),
    "vllm:num_requests_waiting_by_reason": ("gauge", BASE | {"reason"}),
    "vllm:kv_cache_usage_perc": ("gauge", BASE),
    "vllm:engine_sleep_state": ("gauge", BASE | {"sleep_state"}),
    "vllm:prefix_cache_queries_total": ("counter", BASE),
    "vllm:prefix_cache_hits_total": ("counter", BASE),
    "vllm:num_preemptions_total": ("counter", BASE),
    "vllm:prompt_tokens_total": ("counter", BASE),
    "vllm:generation_tokens_total": ("counter", BASE),
    "vllm:prompt_tokens_cached_total": ("counter", BASE),
    "vllm:prompt_tokens_by_source_total": ("counter", BASE | {"source"}),
    "vllm:request_success_total": ("counter", BASE | {"finished_reason"}),
    "vllm:cache_config_info": ("gauge", set()),
    **{
        f"vllm:{name}": ("histogram", BASE | {"le"})
        for name in (
            "time_to_first_token_seconds", "inter_token_latency_seconds",
            "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
            "request_queue_time_seconds", "request_prefill_time_seconds",
            "request_decode_time_seconds", "request_inference_time_seconds",
            "request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
            "request_max_num_generation_tokens", "iteration_tokens_total",
            "request_num_preemptions", "request_prefill_kv_computed_tokens",
        )
    },
}  # fmt: skip


async def scrape(client: httpx.AsyncClient) -> dict[str, object]:
    r = await client.get("/metrics")
    assert r.status_code == 200
    return parse_metrics(r.text)  # type: ignore[return-value]


async def one_request(client: httpx.AsyncClient, n: int = 608, max_tokens: int = 4) -> None:
    body = {"prompt": list(range(500, 500 + n)), "max_tokens": max_tokens, "ignore_eos": True}
    assert (await client.post("/v1/completions", json=body)).status_code == 200


@pytest.mark.parametrize(
    ("value", "text"),
    [(3, "3.0"), (0.0, "0.0"), (55310021, "5.5310021e+07"),
     (1795332788.5375, "1.7953327885375e+09"), (1e6, "1e+06"), (123456.0, "123456.0"),
     (0.0001, "0.0001"), (float("inf"), "+Inf")],
)  # fmt: skip
def test_go_style_float_text(value: float, text: str) -> None:
    assert fmt(value) == text


async def test_names_types_labels_and_buckets_match_vllm(client: httpx.AsyncClient) -> None:
    r = await client.get("/metrics")
    assert r.headers["content-type"] == "text/plain; version=1.0.0; charset=utf-8"
    families = parse_metrics(r.text)
    for name, (kind, labels) in REQUIRED.items():
        family = families[name]
        assert family.type == kind, name
        for sample_name, sample_labels, _ in family.samples:
            if name == "vllm:cache_config_info":
                continue
            bucket = {"le"} if sample_name.endswith("_bucket") else set()
            assert set(sample_labels) == (labels - {"le"}) | bucket, (name, sample_labels)
            assert sample_labels["model_name"] == "meta-llama/Llama-3.1-8B-Instruct"
    ttft = families["vllm:time_to_first_token_seconds"]
    bounds = [lb["le"] for name, lb, _ in ttft.samples if name.endswith("_bucket")]
    assert bounds == [fmt(b) for b in TTFT_BUCKETS] + ["+Inf"]
    itl = families["vllm:inter_token_latency_seconds"]
    assert len([s for s in itl.samples if s[0].endswith("_bucket")]) == len(ITL_BUCKETS) + 1
    tokens = families["vllm:request_prompt_tokens"]
    assert [lb["le"] for n, lb, _ in tokens.samples if n.endswith("_bucket")][-2] == "2000.0"
    assert buckets_1_2_5(2048)[-1] == 2000
    # Every counter and histogram has its _created gauge family.
    for name, (kind, _) in REQUIRED.items():
        if kind in ("counter", "histogram"):
            # Counters drop _total; histograms keep their full name (iteration_tokens_total).
            base = name.removesuffix("_total") if kind == "counter" else name
            assert families[base + "_created"].type == "gauge"
    assert families["vllm:admission_rejections_total"].samples[0][1] == {
        "model_name": "meta-llama/Llama-3.1-8B-Instruct",
        "reason": "max_num_queued_reqs",
    }


async def test_cache_config_info_reports_capacity(client: httpx.AsyncClient) -> None:
    info = parse_metrics((await client.get("/metrics")).text)["vllm:cache_config_info"]
    [(_, labels, value)] = info.samples
    assert value == 1.0
    assert labels["block_size"] == "32"
    assert labels["num_gpu_blocks"] == "100"
    assert labels["kv_cache_size_tokens"] == "3200"
    assert labels["enable_prefix_caching"] == "True"
    assert labels["engine"] == "0"
    assert labels["num_gpu_blocks_override"] == "100"


async def test_counters_follow_requests(client: httpx.AsyncClient) -> None:
    await one_request(client)
    await one_request(client)
    m = parse_metrics((await client.get("/metrics")).text)
    assert m["vllm:prefix_cache_queries_total"].value("vllm:prefix_cache_queries_total") == 1216
    assert m["vllm:prefix_cache_hits_total"].value("vllm:prefix_cache_hits_total") == 576
    assert m["vllm:prompt_tokens_total"].value("vllm:prompt_tokens_total") == 1216
    assert m["vllm:prompt_tokens_cached_total"].value("vllm:prompt_tokens_cached_total") == 576
    by_source = m["vllm:prompt_tokens_by_source_total"]
    assert by_source.value("vllm:prompt_tokens_by_source_total", source="local_compute") == 640
    assert m["vllm:generation_tokens_total"].value("vllm:generation_tokens_total") == 8
    success = m["vllm:request_success_total"]
    assert success.value("vllm:request_success_total", finished_reason="length") == 2
    ttft = m["vllm:time_to_first_token_seconds"]
    assert ttft.value("vllm:time_to_first_token_seconds_count") == 2
    assert ttft.value("vllm:time_to_first_token_seconds_bucket", le="+Inf") == 2
    assert (
        m["vllm:inter_token_latency_seconds"].value("vllm:inter_token_latency_seconds_count") == 6
    )
    assert m["vllm:kv_cache_usage_perc"].value("vllm:kv_cache_usage_perc") == 0.0
    truth = m["thundersim:cached_free_blocks"].value("thundersim:cached_free_blocks")
    # 19 prompt blocks, plus the repeat's recomputed 19th block: like vLLM, a block filled
    # again under a hash that is already cached is kept as a duplicate.
    assert truth == 20


@pytest.mark.parametrize(
    ("sim", "present", "absent"),
    [
        pytest.param({"compat": "0.8"},
                     {"vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries_total",
                      "vllm:time_per_output_token_seconds"},
                     {"vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                      "vllm:inter_token_latency_seconds", "vllm:num_requests_waiting_by_reason"},
                     id="0.8"),
        pytest.param({"compat": "0.9"},
                     {"vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc",
                      "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"},
                     {"vllm:inter_token_latency_seconds"}, id="0.9"),
        pytest.param({"compat": "0.10"},
                     {"vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
                      "vllm:gpu_cache_usage_perc"},
                     {"vllm:request_time_per_output_token_seconds"}, id="0.10"),
        pytest.param({"compat": "0.11"},
                     {"vllm:time_per_output_token_seconds",
                      "vllm:request_time_per_output_token_seconds"},
                     {"vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries_total"},
                     id="0.11"),
    ],
    indirect=["sim"],
)  # fmt: skip
async def test_compat_levels_swap_names(
    client: httpx.AsyncClient, present: set[str], absent: set[str]
) -> None:
    r = await client.get("/metrics")
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    names = set(parse_metrics(r.text))
    assert present <= names
    assert not absent & names


@pytest.mark.parametrize("sim", [{"compat": "0.8"}], indirect=True)
async def test_compat_08_counts_prefix_cache_in_blocks(client: httpx.AsyncClient) -> None:
    await one_request(client)
    await one_request(client)
    m = parse_metrics((await client.get("/metrics")).text)
    hits = m["vllm:gpu_prefix_cache_hits_total"].value("vllm:gpu_prefix_cache_hits_total")
    assert hits == 576 / 32
    [(_, labels, _)] = m["vllm:cache_config_info"].samples
    assert "engine" not in labels


async def test_program_truth_from_request_ids(client: httpx.AsyncClient) -> None:
    for start, (program, step) in enumerate((("alpha", 1), ("alpha", 2), ("beta", 1))):
        body = {"prompt": list(range(1000 * start, 1000 * start + 200)), "max_tokens": 1}
        await client.post("/v1/completions", json=body,
                          headers={"X-Request-Id": f"{program}-{step}"})  # fmt: skip
    m = parse_metrics((await client.get("/metrics")).text)
    resident = m["thundersim:program_resident_blocks"]
    assert resident.value("thundersim:program_resident_blocks", program="alpha") == 12
    assert resident.value("thundersim:program_resident_blocks", program="beta") == 6
    # A prefix hit hands the blocks to the program that touched them last.
    body = {"prompt": list(range(200)), "max_tokens": 1}
    await client.post("/v1/completions", json=body, headers={"X-Request-Id": "beta-2"})
    m = parse_metrics((await client.get("/metrics")).text)
    resident = m["thundersim:program_resident_blocks"]
    assert resident.value("thundersim:program_resident_blocks", program="alpha") == 6
    assert resident.value("thundersim:program_resident_blocks", program="beta") == 12
