"""A real Prometheus (Debian's package) scrapes the proxy's /metrics, choosing the text format
by its own Accept header, and its HTTP API then answers a query for the programs-per-state
series. Installed with apt-get when missing; skipped, saying why, only if it cannot be."""

from __future__ import annotations

import shutil
import socket
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ..sim.test_sim_http import MODEL
from .test_clients import proxy_on_sim

#: The whole test, Prometheus' start and first scrapes included.
LIMIT_S = 60


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is not None:
        return found
    if shutil.which("apt-get") is None:
        pytest.skip("prometheus is not installed and there is no apt-get to install it with")
    done = subprocess.run(
        ["apt-get", "install", "-y", "-q", "prometheus"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    found = shutil.which("prometheus")
    if done.returncode != 0 or found is None:
        pytest.skip(
            f"prometheus is not installed and apt-get could not install it: {done.stderr[-500:]}"
        )
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def test_prometheus_scrapes_programs_by_state(tmp_path: Path) -> None:
    binary = await trio.to_thread.run_sync(prometheus_binary)
    async with proxy_on_sim(tmp_path) as setup:
        async with httpx.AsyncClient(base_url=setup.proxy.url, timeout=10) as client:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            answer = await client.post("/v1/chat/completions", json={**body, "program_id": "p1"})
            assert answer.status_code == 200
        target = setup.proxy.url.removeprefix("http://")
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n"
            "  - job_name: thunderproxy\n"
            "    metrics_path: /metrics\n"  # the JSON route, negotiated by Accept
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        web = f"127.0.0.1:{free_port()}"
        argv = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address={web}",
        ]
        with trio.fail_after(LIMIT_S):
            async with trio.open_nursery() as nursery:
                process: trio.Process = await nursery.start(
                    partial(
                        trio.run_process,
                        argv,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        check=False,
                    )
                )
                try:
                    found = await wait_for_series(f"http://{web}")
                finally:
                    process.terminate()
    by_state = {r["metric"]["state"]: float(r["value"][1]) for r in found}
    assert by_state["acting"] == 1.0, by_state
    assert by_state["reasoning"] == 0.0, by_state
    assert all(r["metric"]["job"] == "thunderproxy" for r in found)


async def wait_for_series(base: str) -> list[dict[str, Any]]:
    """Ask Prometheus until its query API returns the programs-per-state series (it needs to be
    up and to have scraped once); the caller bounds the wait."""
    async with httpx.AsyncClient(base_url=base, timeout=5) as client:
        while True:
            try:
                answer = await client.get(
                    "/api/v1/query", params={"query": "thunderproxy_programs"}
                )
            except httpx.TransportError:
                answer = None  # not listening yet
            if answer is not None and answer.status_code == 200:
                result: list[dict[str, Any]] = answer.json()["data"]["result"]
                if result:
                    return result
            await trio.sleep(0.2)


async def test_metrics_text_counts_steps_and_latencies(tmp_path: Path) -> None:
    async with (
        proxy_on_sim(tmp_path) as setup,
        httpx.AsyncClient(base_url=setup.proxy.url, timeout=10) as client,
    ):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.status_code == 200
        missing = await client.post("/v1/chat/completions", json={**body, "model": "nope"})
        assert missing.status_code == 404
        # The JSON stays the default, for browsers and curl.
        plain = await client.get("/metrics", headers={"accept": "*/*"})
        assert plain.headers["content-type"].startswith("application/json")
        text = (await client.get("/metrics/prometheus")).text
        negotiated = await client.get("/metrics", headers={"accept": "text/plain;version=0.0.4"})
        assert negotiated.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = text.splitlines()
    # Two steps answered; the refused model never became a step (it is a rejection).
    assert 'thunderproxy_steps_total{status="200"} 2.0' in lines
    assert not [line for line in lines if line.startswith('thunderproxy_steps_total{status="404"')]
    # Both steps waited (for nothing) and decoded; only the stream has a first token to time.
    assert "thunderproxy_queue_wait_seconds_count 2.0" in lines
    assert "thunderproxy_ttft_seconds_count 1.0" in lines
    assert "thunderproxy_decode_seconds_count 1.0" in lines
    assert 'thunderproxy_programs{state="acting"} 2.0' in lines
