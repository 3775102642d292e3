"""The SGLang personality and the `thunderproxy sim` command line."""

from __future__ import annotations

import httpx
import pytest
from click.testing import CliRunner

from thunderproxy.sim.cli import sim_command

from .helpers import parse_metrics

SGLANG = {"personality": "sglang"}


@pytest.mark.parametrize("sim", [SGLANG], indirect=True)
async def test_sglang_server_info_and_metrics(client: httpx.AsyncClient) -> None:
    info = (await client.get("/server_info")).json()
    assert info["max_total_num_tokens"] == 99 * 32
    assert info["page_size"] == 32
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 16
    assert (await client.get("/get_server_info")).json() == info
    body = {"prompt": list(range(300)), "max_tokens": 2}
    r = await client.post("/v1/completions", json=body)
    assert r.json()["usage"]["prompt_tokens_details"] is None  # no --enable-cache-report
    m = parse_metrics((await client.get("/metrics")).text)
    assert m["sglang:max_total_num_tokens"].value() == 99 * 32
    assert m["sglang:kv_evictable_tokens"].value() == 9 * 32
    assert m["sglang:token_usage"].value() == 0.0
    assert m["sglang:num_running_reqs"].samples[0][1]["engine_type"] == "unified"
    assert not any(name.startswith("vllm:") for name in m)


@pytest.mark.parametrize("sim", [{**SGLANG, "enable_cache_report": True}], indirect=True)
async def test_sglang_cache_report_flush_and_errors(client: httpx.AsyncClient) -> None:
    body = {"prompt": list(range(300)), "max_tokens": 2}
    await client.post("/v1/completions", json=body)
    r = await client.post("/v1/completions", json=body)
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 288}
    assert (await client.get("/health_generate")).status_code == 200
    flush = await client.post("/flush_cache")
    assert flush.status_code == 200
    assert flush.text.startswith("Cache flushed")
    r = await client.post("/v1/completions", json=body)
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    error = (await client.post("/v1/completions", json={"prompt": ""})).json()
    assert error["object"] == "error"


def test_help_lists_every_knob_with_its_env_var() -> None:
    result = CliRunner().invoke(sim_command, ["--help"], terminal_width=200)
    assert result.exit_code == 0
    for flag, env in [
        ("--port", "THUNDERPROXY_SIM_PORT"),
        ("--num-gpu-blocks", "THUNDERPROXY_SIM_NUM_GPU_BLOCKS"),
        ("--enable-prefix-caching / --no-enable-prefix-caching",
         "THUNDERPROXY_SIM_ENABLE_PREFIX_CACHING"),
        ("--time-scale", "THUNDERPROXY_SIM_TIME_SCALE"),
        ("--vocab", "THUNDERPROXY_SIM_VOCAB_SIZE"),
        ("--fail-rate", "THUNDERPROXY_SIM_FAIL_RATE"),
        ("--c-attn-ns", "THUNDERPROXY_SIM_C_ATTN_NS"),
    ]:  # fmt: skip
        assert flag in result.output
        assert env in result.output


def test_bad_values_are_reported_not_raised() -> None:
    runner = CliRunner()
    result = runner.invoke(sim_command, ["--time-scale", "0"])
    assert result.exit_code == 1
    assert "time_scale must be > 0" in result.output
    result = runner.invoke(sim_command, [], env={"THUNDERPROXY_SIM_FAIL_TYPES": "500,boom"})
    assert result.exit_code == 1
    assert "boom" in result.output
    result = runner.invoke(sim_command, ["--profile", "nope"])
    assert result.exit_code == 2
