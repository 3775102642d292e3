"""Worker mode's switches: the report address from a flag or the platform's REPORT_ADDR, and
the worker's identity and public address from what Vast.ai sets in the environment."""

from __future__ import annotations

import pytest

from thunderproxy.config import load_settings
from thunderproxy.errors import ConfigError
from thunderproxy.worker import worker_config

PLATFORM = {
    "REPORT_ADDR": "https://run.vast.ai, https://cloud.vast.ai/api/v0/",
    "MASTER_TOKEN": "secret-token",
    "CONTAINER_ID": "1234567",
    "PUBLIC_IPADDR": "203.0.113.9",
    "VAST_TCP_PORT_3000": "41234",
}


def test_off_without_a_report_address() -> None:
    assert worker_config(load_settings(), {}) is None


def test_read_from_the_platform_environment() -> None:
    config = worker_config(load_settings(port=3000, certfile="c.pem", keyfile="k.pem"), PLATFORM)
    assert config is not None
    assert config.report_addrs == ("https://run.vast.ai", "https://cloud.vast.ai/api/v0")
    assert config.worker_id == 1234567
    assert config.master_token == "secret-token"
    assert config.public_url == "https://203.0.113.9:41234"
    assert "secret-token" not in repr(config)


def test_the_flag_wins_and_an_unmapped_port_reports_the_listening_address() -> None:
    settings = load_settings(port=8300, report_addr="http://127.0.0.1:9/")
    config = worker_config(settings, PLATFORM)
    assert config is not None
    assert config.report_addrs == ("http://127.0.0.1:9",)
    assert config.public_url is None  # no VAST_TCP_PORT_8300


def test_tls_needs_both_files() -> None:
    with pytest.raises(ConfigError, match="--certfile and --keyfile go together"):
        load_settings(certfile="c.pem")


def test_signing_key_retries_back_off_to_a_minute() -> None:
    from thunderproxy.worker.service import key_backoff

    assert [key_backoff(n) for n in (1, 2, 3, 4, 6, 7, 50)] == [1, 2, 4, 8, 32, 60, 60]


def test_queue_wait_percentile_is_nearest_rank() -> None:
    from thunderproxy.worker.signals import percentile

    assert percentile([], 0.9) == 0.0
    assert percentile([5.0], 0.9) == 5.0
    assert percentile([float(n) for n in range(1, 11)], 0.9) == 9.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
