"""Bench options: targets, settings of the bench's own proxy, simulator configuration."""

from __future__ import annotations

import pytest

from tests.bench.synthetic import thunderagent_rows
from thunderproxy.bench.config import (
    BenchConfig,
    parse_int_list,
    parse_settings,
    parse_sim_settings,
    parse_targets,
)
from thunderproxy.bench.workloads import workload
from thunderproxy.errors import ConfigError
from thunderproxy.sim import PROFILES


def test_targets_are_named_or_urls() -> None:
    assert parse_targets("direct, tr,http://127.0.0.1:9000/") == (
        "direct",
        "tr",
        "http://127.0.0.1:9000",
    )
    with pytest.raises(ConfigError, match="'fast' is not one of"):
        parse_targets("fast")
    with pytest.raises(ConfigError, match="at least one"):
        parse_targets(" , ")


def test_offloading_targets_are_own_targets_over_a_cpu_tier() -> None:
    assert parse_targets("offload,tr+offload,oracle+offload") == (
        "offload",
        "tr+offload",
        "oracle+offload",
    )
    for bad in ("offload+offload", "fast+offload", "tr+offloaded"):
        with pytest.raises(ConfigError, match="is not one of"):
            parse_targets(bad)
    w = workload.thunderagent(thunderagent_rows(programs=3, steps=3))
    config = BenchConfig(kv_tokens=50_000, virtual=True)
    assert config.sim_config(w, "offload", time_scale=1).kv_offloading_tokens == 200_000
    tr = config.sim_config(w, "tr+offload", time_scale=1)
    assert tr.kv_capacity_tokens == 50_000
    assert tr.kv_offloading_tokens == 200_000
    assert config.sim_config(w, "tr", time_scale=1).resolved_num_cpu_blocks() == 0
    sized = BenchConfig(kv_tokens=50_000, offload_tokens=1_000, virtual=True)
    assert sized.sim_config(w, "offload", time_scale=1).kv_offloading_tokens == 1_000
    assert config.settings("tr+offload").router == "tr"


def test_lists_and_settings_are_validated_before_anything_starts() -> None:
    assert parse_int_list("16,32", flag="--sweep") == (16, 32)
    with pytest.raises(ConfigError, match="--sweep"):
        parse_int_list("16,x", flag="--sweep")
    assert parse_settings(["pause_cooldown=2", "max-wait=60"]) == {
        "pause_cooldown": 2.0,
        "max_wait": 60.0,
    }
    with pytest.raises(ConfigError, match="NAME=VALUE"):
        parse_settings(["nonsense=1"])
    with pytest.raises(ConfigError, match="target-fill"):
        parse_settings(["target_fill=2"])


def test_simulator_knobs_are_typed_and_the_bench_owned_ones_refused() -> None:
    assert parse_sim_settings(["c_kv_ns=50", "jitter=0.1", "max-num-seqs=64"]) == {
        "c_kv_ns": 50.0,
        "jitter": 0.1,
        "max_num_seqs": 64,
    }
    with pytest.raises(ConfigError, match="the bench sets those"):
        parse_sim_settings(["kv_capacity_tokens=5"])
    with pytest.raises(ConfigError, match="--sim"):
        parse_sim_settings(["jitter=x"])
    w = workload.thunderagent(thunderagent_rows(programs=1, steps=1))
    sim = BenchConfig(sim_settings={"c_kv_ns": 50.0}).sim_config(w, "tr", time_scale=1.0)
    assert sim.timing.c_kv_ns == 50.0


def test_real_time_proxies_keep_their_cooldowns_in_simulated_seconds() -> None:
    config = BenchConfig(proxy_settings={"pause_cooldown": 2.0})
    settings = config.settings("tr", scale=0.1)
    assert settings.router == "tr"
    assert settings.policy.pause_cooldown_s == pytest.approx(0.2)
    assert settings.metrics_interval == pytest.approx(0.5)
    assert settings.restore is False
    assert config.settings("default").policy.pause_cooldown_s == 2.0


def test_the_oracle_holds_every_token_and_the_others_the_asked_capacity() -> None:
    w = workload.thunderagent(thunderagent_rows(programs=3, steps=3))
    config = BenchConfig(kv_tokens=50_000)
    assert config.kv_for(w, "tr") == 50_000
    assert config.kv_for(w, "oracle") >= w.no_eviction_tokens()
    assert BenchConfig().kv_for(w, "direct") == PROFILES["glm45-swe"].kv_capacity_tokens
    sim = config.sim_config(w, "direct", time_scale=0.5)
    assert sim.enable_prompt_tokens_details
    assert sim.time_scale == 0.5
    assert sim.max_model_len > w.max_context_tokens


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"targets": ("http://x:1",), "virtual": True}, "real time", id="url-virtual"),
        pytest.param({"backends": 2, "backend_ports": (8001,)}, "one port", id="ports"),
        pytest.param({"arrivals": "poisson"}, "--rate", id="poisson-rate"),
        pytest.param({"profile": "tpu"}, "--profile", id="profile"),
        pytest.param({"targets": ("offload",)}, "--virtual only", id="offload-real-time"),
        pytest.param({"shared_prefix_tokens": -5}, ">= 0", id="shared-prefix"),
        pytest.param({"carry_answer": 1.3}, "fraction", id="carry-answer"),
    ],
)
def test_inconsistent_options_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BenchConfig(**kwargs)  # type: ignore[arg-type]
