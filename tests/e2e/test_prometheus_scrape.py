"""A real Prometheus (Debian's package) scrapes the proxy's /metrics, choosing the text format
by its own Accept header, and its HTTP API then answers a query for the programs-per-state
series. Installed with apt-get when missing; skipped, saying why, only if it cannot be."""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from thunderproxy import __version__
from thunderproxy.config.limits import LimitsSpec, ModelLimits
from thunderproxy.sim import SimConfig, open_simulator

from ..conftest import apt_install, running_proxy
from ..sim.test_sim_http import MODEL
from .test_clients import proxy_on_sim

#: The whole test, Prometheus' start and first scrapes included.
LIMIT_S = 60


def prometheus_binary(name: str = "prometheus") -> str:
    """``prometheus`` or ``promtool`` (both in Debian's ``prometheus`` package), installed
    with apt-get when missing; the test skips, saying why, only where that is impossible."""
    found = shutil.which(name)
    if found is None and apt_install("prometheus", timeout_s=600):
        found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed and apt-get could not install it (not root?)")
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
        with trio.fail_after(LIMIT_S):
            # The JSON route, negotiated by Accept.
            async with scraping(tmp_path, target, binary, metrics_path="/metrics") as api:
                found = await wait_for_series(api)
    by_state = {r["metric"]["state"]: float(r["value"][1]) for r in found}
    assert by_state["acting"] == 1.0, by_state
    assert by_state["reasoning"] == 0.0, by_state
    assert all(r["metric"]["job"] == "thunderproxy" for r in found)


async def wait_for_series(api: httpx.AsyncClient) -> list[dict[str, Any]]:
    """Ask Prometheus until its query API returns the programs-per-state series (it needs to be
    up and to have scraped once); the caller bounds the wait."""
    while True:
        try:
            answer = await api.get("/api/v1/query", params={"query": "thunderproxy_programs"})
        except httpx.TransportError:
            answer = None  # not listening yet
        if answer is not None and answer.status_code == 200:
            result: list[dict[str, Any]] = answer.json()["data"]["result"]
            if result:
                return result
        await trio.sleep(0.2)


async def answered_streamed_and_refused(client: httpx.AsyncClient) -> None:
    """Three calls through the proxy at ``client``: one answered whole, one streamed, one for
    a model no backend serves (404)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert streamed.status_code == 200
    missing = await client.post("/v1/chat/completions", json={**body, "model": "nope"})
    assert missing.status_code == 404


async def test_metrics_text_counts_steps_and_latencies(tmp_path: Path) -> None:
    async with (
        # 'none': the one model served does not take the unknown name, which is refused.
        proxy_on_sim(tmp_path, default_model="none") as setup,
        httpx.AsyncClient(base_url=setup.proxy.url, timeout=10) as client,
    ):
        await answered_streamed_and_refused(client)
        # Refused at the edge, before the gateway: counted all the same.
        broken = await client.post("/v1/chat/completions", content=b"{not json")
        assert broken.status_code == 400
        # The JSON stays the default, for browsers and curl.
        plain = await client.get("/metrics", headers={"accept": "*/*"})
        assert plain.headers["content-type"].startswith("application/json")
        text = (await client.get("/metrics/prometheus")).text
        backend = setup.sim.url
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
    assert 'thunderproxy_refusals_total{reason="model_not_found",status="404"} 1.0' in lines
    assert 'thunderproxy_refusals_total{reason="invalid_request",status="400"} 1.0' in lines
    # The non-streamed call is timed whole, as the streamed one is.
    assert f'thunderproxy_call_seconds_count{{backend="{backend}",model="{MODEL}"}} 2.0' in lines


@asynccontextmanager
async def scraping(
    tmp_path: Path, target: str, binary: str, *, metrics_path: str = "/metrics/prometheus"
) -> AsyncIterator[httpx.AsyncClient]:
    """A real Prometheus on loopback scraping ``target``'s ``metrics_path`` every second, its
    data in ``tmp_path``; a client on its HTTP API. Stopped when the block ends."""
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: thunderproxy\n"
        f"    metrics_path: {metrics_path}\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    web = f"127.0.0.1:{free_port()}"
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address={web}",
    ]
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
            async with httpx.AsyncClient(base_url=f"http://{web}", timeout=5) as api:
                yield api
        finally:
            process.terminate()


async def query_until(
    api: httpx.AsyncClient, promql: str, expected: dict[str, float] | None, label: str
) -> dict[str, float]:
    """``promql``'s result by ``label``, asked again until it equals ``expected`` (None: until
    it is not empty; Prometheus must be up and have scraped the final figures) or 15 s passed:
    the last answer."""
    got: dict[str, float] = {}
    with trio.move_on_after(15):
        while True:
            try:
                answer = await api.get("/api/v1/query", params={"query": promql})
            except httpx.TransportError:
                answer = None  # not listening yet
            if answer is not None and answer.status_code == 200:
                result = answer.json()["data"]["result"]
                got = {r["metric"].get(label, ""): float(r["value"][1]) for r in result}
                if got == expected or (expected is None and got):
                    break
            await trio.sleep(0.2)
    return got


async def test_prometheus_charts_refusals_tokens_by_model_and_build(tmp_path: Path) -> None:
    """Two models on two simulators, three protocols, and calls the proxy refuses itself; a
    real Prometheus scrapes the text endpoint and its query API returns what was sent."""
    binary = await trio.to_thread.run_sync(prometheus_binary)
    big, small = "model-a", "model-b"
    # A token limit no call below can reach, but one the huge max_tokens call can never fit.
    limits = LimitsSpec({small: ModelLimits(tpm=100_000)})
    completion: dict[str, float] = {big: 0.0, small: 0.0}
    with trio.fail_after(LIMIT_S):
        async with (
            open_simulator(SimConfig(served_model_name=big, time_scale=0.01)) as sim_a,
            open_simulator(SimConfig(served_model_name=small, time_scale=0.01)) as sim_b,
            running_proxy(
                tmp_path / "audit.db", backends=f"{sim_a.url},{sim_b.url}", limits=limits
            ) as proxy,
            httpx.AsyncClient(base_url=proxy.url, timeout=10) as client,
        ):
            hello = [{"role": "user", "content": "hello there"}]
            for model in (big, small):
                chat = await client.post(
                    "/v1/chat/completions", json={"model": model, "messages": hello}
                )
                assert chat.status_code == 200, chat.text
                completion[model] += chat.json()["usage"]["completion_tokens"]
            messages = await client.post(
                "/v1/messages", json={"model": big, "messages": hello, "max_tokens": 16}
            )
            assert messages.status_code == 200, messages.text
            completion[big] += messages.json()["usage"]["output_tokens"]
            responses = await client.post("/v1/responses", json={"model": small, "input": "hi"})
            assert responses.status_code == 200, responses.text
            completion[small] += responses.json()["usage"]["output_tokens"]
            # Refused by the proxy itself: an unknown model twice, a call over the limit once.
            for _ in range(2):
                unknown = await client.post(
                    "/v1/chat/completions", json={"model": "nope", "messages": hello}
                )
                assert unknown.status_code == 404
            limited = await client.post(
                "/v1/chat/completions",
                json={"model": small, "messages": hello, "max_tokens": 1_000_000},
            )
            assert limited.status_code == 429, limited.text

            target = proxy.url.removeprefix("http://")
            async with scraping(tmp_path, target, binary) as api:
                refusals = "sum by (reason) (thunderproxy_refusals_total)"
                expected = {"model_not_found": 2.0, "rate_limited": 1.0}
                assert await query_until(api, refusals, expected, "reason") == expected
                limited_by = 'sum by (status) (thunderproxy_refusals_total{reason="rate_limited"})'
                assert await query_until(api, limited_by, {"429": 1.0}, "status") == {"429": 1.0}
                tokens = 'sum by (model) (thunderproxy_tokens_total{kind="completion"})'
                assert await query_until(api, tokens, completion, "model") == completion
                calls = "sum by (model) (thunderproxy_call_seconds_count)"
                expected = {big: 2.0, small: 2.0}
                assert await query_until(api, calls, expected, "model") == expected
                build = "thunderproxy_build_info"
                got = await query_until(api, build, {__version__: 1.0}, "version")
                assert got == {__version__: 1.0}
                cpu = "process_cpu_seconds_total"
                assert (await query_until(api, cpu, None, "x")).get("", 0) > 0
    assert all(n > 0 for n in completion.values()), completion
