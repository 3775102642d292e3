"""The overhead bench's pure parts: the backend's stamps and the hops they give, pairing each
target with its own round's direct cell, the figures over rounds, nginx's configuration."""

from __future__ import annotations

from pathlib import Path

import pytest

from thunderproxy.bench.relay import overhead
from thunderproxy.bench.relay.fastbackend import UNSTAMPED, chunk_payloads, stamps


def stamped_line(read_at: int, sent_at: int) -> str:
    token, _, _ = chunk_payloads(4)
    stamp = f'"chatcmpl-fast-{read_at}-{sent_at}"'.encode()
    return token.replace(UNSTAMPED, stamp, 1).decode().strip()


def test_the_hops_are_the_time_to_first_token_less_the_backends_own_wait() -> None:
    # Sent at 1.0 ms, read by the backend at 1.4 ms, first chunk sent at 21.4 ms, seen at 22.0 ms.
    line = stamped_line(1_400_000, 21_400_000)
    assert stamps(line) == (1_400_000, 21_400_000)
    assert overhead.hops_ms(1_000_000, 22_000_000, line) == pytest.approx(0.4 + 0.6)


def test_a_relay_that_rewrites_the_id_gives_no_hops() -> None:
    token, _, _ = chunk_payloads(4)
    assert overhead.hops_ms(0, 1, token.decode()) is None


def cell(path: str, round_: int, ttft_ms: float, hops_ms: float) -> overhead.Cell:
    out = overhead.Cell(path, 32, round_, requests=10, chunks=320, window_s=1.0)
    out.ttft_ms = [ttft_ms] * 10
    out.hops_ms = [hops_ms] * 10
    return out


def test_each_target_is_measured_against_the_direct_cell_of_its_own_round() -> None:
    cells = [
        cell("direct", 0, 20.0, 1.0),
        cell("nginx", 0, 21.0, 1.5),
        cell("direct", 1, 30.0, 2.0),
        cell("nginx", 1, 30.5, 2.1),
        cell("direct", 2, 25.0, 1.0),
        cell("nginx", 2, 28.0, 1.3),
    ]
    rows = overhead.report(cells)
    added = [row["added_ttft_p50_ms"] for row in rows if row["path"] == "nginx"]
    assert added == pytest.approx([1.0, 0.5, 3.0])
    (summary,) = overhead.over_rounds(rows)
    assert summary["path"] == "nginx"
    assert summary["rounds"] == 3
    assert summary["added_ttft_p50_ms"] == pytest.approx((1.0, 0.5, 3.0))
    assert summary["added_hops_p50_ms"] == pytest.approx((0.3, 0.1, 0.5))
    assert "+1.0 (+0.5..+3.0)" in overhead.rounds_table([summary])


def test_nginx_relays_to_the_backend_unbuffered_over_kept_alive_connections(
    tmp_path: Path,
) -> None:
    config = overhead.nginx_config("http://127.0.0.1:9001", 9002, tmp_path)
    assert "server 127.0.0.1:9001; keepalive" in config
    assert "listen 127.0.0.1:9002;" in config
    assert "proxy_buffering off;" in config
    assert "proxy_http_version 1.1;" in config
    # Every path nginx writes lies in the run's own directory.
    assert f"pid {tmp_path / 'nginx.pid'};" in config
    assert f"proxy_temp_path {tmp_path / 'nginx-proxy'};" in config
    assert "daemon off;" in config
    assert "master_process off;" in config


def test_nginx_is_a_target_that_says_how_to_install_it_when_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert overhead.parse_targets("nginx,default") == ("nginx", "default")
    monkeypatch.setattr(overhead, "nginx_command", lambda: None)
    reason = overhead.missing("nginx")
    assert reason is not None
    assert "apt-get install nginx" in reason
