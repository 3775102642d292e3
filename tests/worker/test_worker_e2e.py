"""Worker mode end to end: the proxy on loopback in front of the simulated vLLM, the autoscaler
stand-in on loopback signing requests and recording reports, real SQLite."""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import query, running_proxy, wait_for
from tests.e2e.test_prometheus_scrape import free_port
from tests.explore.conftest import run_canned
from tests.worker.autoscaler import Autoscaler, serve_autoscaler
from tests.worker.benchmarks import FIXED_THROUGHPUT
from tests.worker.tls import self_signed
from thunderproxy.runtime import RunningProxy
from thunderproxy.sim import SimConfig, Simulator, open_simulator
from thunderproxy.worker.state import Phase, WorkerState

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "list the files " * 8}]}
FIVE = {"X-Sim-Output-Tokens": "5"}
KV_TOKENS = 16_000
FIXED = "tests.worker.benchmarks:fixed"


@pytest.fixture
async def sim() -> AsyncIterator[Simulator]:
    config = SimConfig(kv_capacity_tokens=KV_TOKENS, time_scale=0.05)
    async with open_simulator(config) as simulator:
        yield simulator


@pytest.fixture
async def scaler() -> AsyncIterator[Autoscaler]:
    async with serve_autoscaler() as running:
        yield running


@asynccontextmanager
async def worker(
    tmp_path: Path, backends: str, scaler: Autoscaler, **overrides: Any
) -> AsyncIterator[tuple[RunningProxy, WorkerState, httpx.AsyncClient]]:
    settings: dict[str, Any] = {
        "backends": backends,
        "report_addr": scaler.url,
        "benchmark": FIXED,
        "benchmark_cache": str(tmp_path / "bench.json"),
        "datasette": False,
        **overrides,
    }
    async with (
        running_proxy(tmp_path / "audit.db", **settings) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=10) as client,
    ):
        assert proxy.worker is not None
        # The autoscaler signs each request for the worker it routes it to: this one.
        scaler.worker_url = proxy.url
        yield proxy, proxy.worker, client


async def until_ready(state: WorkerState) -> None:
    await wait_for(lambda: state.phase is not Phase.LOADING, timeout=20)
    if state.secured:
        await wait_for(lambda: state.public_key is not None)


def events(db: Path) -> list[dict[str, Any]]:
    return query(db, "select * from worker_events order by id")


async def test_signed_unsigned_invalid_and_replayed_requests(
    tmp_path: Path, sim: Simulator, scaler: Autoscaler
) -> None:
    async with worker(tmp_path, sim.url, scaler) as (_proxy, state, client):
        await until_ready(state)
        signed = scaler.wrap(CHAT, cost=5)
        ok = await client.post("/v1/chat/completions", json=signed, headers=FIVE)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 5  # the payload reached the backend

        replayed = await client.post("/v1/chat/completions", json=signed, headers=FIVE)
        assert replayed.status_code == 401
        assert "already served" in replayed.json()["error"]["message"]

        forged = scaler.wrap(CHAT, cost=5)
        forged["auth_data"]["cost"] = 1  # cheaper than what the autoscaler signed
        bad = await client.post("/v1/chat/completions", json=forged, headers=FIVE)
        assert bad.status_code == 401
        assert bad.json()["error"]["type"] == "authentication_error"
        assert "Invalid autoscaler signature" in bad.json()["error"]["message"]

        unsigned = await client.post("/v1/chat/completions", json=CHAT, headers=FIVE)
        assert unsigned.status_code == 401
        assert "--unsecured" in unsigned.json()["error"]["message"]

        models = await client.get("/v1/models?" + scaler.query({"limit": "10"}, cost=2))
        assert models.status_code == 200, models.text
        assert models.json()["data"][0]["id"] == MODEL
        assert (await client.get("/v1/models")).status_code == 401

        health = await client.get("/health")
        assert health.status_code == 200
        assert health.json()["worker"]["phase"] == "ready"
        assert health.json()["worker"]["signing_key"] == "loaded"

        # The ledger closes a request once the app returns, just after the client has it all.
        await wait_for(lambda: state.ledger.totals.served == 7.0)
        assert state.ledger.totals.rejected == 5.0 + 1.0 + 1.0 + 1.0  # replay, forged, unsigned
    kinds = [e["event"] for e in events(tmp_path / "audit.db")]
    for kind in ("pubkey_fetched", "benchmark", "replay", "signature_failed", "unsigned"):
        assert kind in kinds
    # The canned Datasette query answers the same, filtered by kind.
    replays = run_canned(tmp_path / "audit.db", "worker_events", event="replay")
    assert [(r["status"], r["workload"], r["reqnum"]) for r in replays] == [
        (401, 5.0, signed["auth_data"]["reqnum"])
    ]
    assert len(run_canned(tmp_path / "audit.db", "worker_events")) == len(kinds)
    assert run_canned(tmp_path / "audit.db", "worker_events", since="-1 minute", event="x") == []


async def test_a_request_replayed_after_a_restart_is_refused(
    tmp_path: Path, sim: Simulator, scaler: Autoscaler
) -> None:
    # The numbers already served lived in memory only: after a restart a replayed request was
    # served, and billed, again. Now they are read back from the audit db (worker_seen).
    # The worker comes back at its address, the one the requests were signed for.
    port = free_port()
    scaler.worker_url = f"http://127.0.0.1:{port}"
    signed = scaler.wrap(CHAT, cost=5)
    other = scaler.wrap(CHAT, cost=5)
    async with worker(tmp_path, sim.url, scaler, port=port) as (_proxy, state, client):
        await until_ready(state)
        for body in (signed, other):
            ok = await client.post("/v1/chat/completions", json=body, headers=FIVE)
            assert ok.status_code == 200, ok.text
    async with worker(tmp_path, sim.url, scaler, port=port) as (_proxy, state, client):
        await until_ready(state)
        for body in (signed, other):
            replayed = await client.post("/v1/chat/completions", json=body, headers=FIVE)
            assert replayed.status_code == 401, replayed.text
            assert "already served" in replayed.json()["error"]["message"]
        fresh = await client.post("/v1/chat/completions", json=scaler.wrap(CHAT), headers=FIVE)
        assert fresh.status_code == 200, fresh.text
    seen = query(tmp_path / "audit.db", "select reqnum, path from worker_seen order by id")
    numbers = [signed["auth_data"]["reqnum"], other["auth_data"]["reqnum"], scaler.reqnum]
    assert seen == [{"reqnum": n, "path": "/v1/chat/completions"} for n in numbers]
    replays = [e for e in events(tmp_path / "audit.db") if e["event"] == "replay"]
    assert len(replays) == 2


async def test_a_signature_opens_its_own_route_only_and_deep_bodies_are_400s(
    tmp_path: Path, sim: Simulator, scaler: Autoscaler
) -> None:
    # Before: a signature for /v1/embeddings opened a council conversation, and a body nested
    # 200,000 deep was a bare empty 500 before any signature was looked at.
    async with worker(tmp_path, sim.url, scaler) as (_proxy, state, client):
        await until_ready(state)
        elsewhere = scaler.wrap({}, endpoint="/v1/embeddings")
        refused = await client.post("/council/api/conversations", json=elsewhere)
        assert refused.status_code == 401, refused.text
        assert "names the route /v1/embeddings" in refused.json()["error"]["message"]
        own = scaler.wrap({}, url="/council/api/conversations")
        opened = await client.post("/council/api/conversations", json=own)
        assert opened.status_code == 200, opened.text
        # Signed for another worker (the next port on this host): before, it was served here.
        host, port = scaler.worker_url.rsplit(":", 1)
        theirs = scaler.wrap({}, url=f"{host}:{int(port) + 1}/council/api/conversations")
        refused = await client.post("/council/api/conversations", json=theirs)
        assert refused.status_code == 401, refused.text
        assert "names another worker" in refused.json()["error"]["message"]

        deep = b"[" * 200_000 + b"]" * 200_000
        answer = await client.post(
            "/v1/chat/completions", content=deep, headers={"content-type": "application/json"}
        )
        assert answer.status_code == 400, answer.text
        assert "levels deep" in answer.json()["error"]["message"]
    kinds = [e["event"] for e in events(tmp_path / "audit.db")]
    assert kinds.count("wrong_route") == 1
    assert kinds.count("wrong_worker") == 1
    seen = query(tmp_path / "audit.db", "select path from worker_seen")
    assert seen == [{"path": "/council/api/conversations"}]


async def test_unsecured_mode_accepts_plain_and_wrapped_bodies(
    tmp_path: Path, sim: Simulator, scaler: Autoscaler
) -> None:
    async with worker(tmp_path, sim.url, scaler, unsecured=True) as (_p, state, client):
        await until_ready(state)
        plain = await client.post("/v1/chat/completions", json=CHAT, headers=FIVE)
        assert plain.status_code == 200
        wrapped = scaler.wrap(CHAT, cost=7)
        wrapped["auth_data"]["signature"] = "unchecked"
        ok = await client.post("/v1/chat/completions", json=wrapped, headers=FIVE)
        assert ok.status_code == 200, ok.text
        assert (await client.get("/v1/models")).status_code == 200
        await wait_for(lambda: state.ledger.totals.served == 1.0 + 7.0 + 1.0)
        assert scaler.pubkey_fetches == 0


async def test_queue_rejection_by_workload_and_disconnect_counts_as_cancelled(
    tmp_path: Path, sim: Simulator, scaler: Autoscaler
) -> None:
    async with worker(tmp_path, sim.url, scaler, max_wait_time=2.0) as (_p, state, client):
        await until_ready(state)
        assert state.ledger.max_throughput == FIXED_THROUGHPUT
        long = scaler.wrap({**CHAT, "stream": True}, cost=5)
        async with client.stream(
            "POST", "/v1/chat/completions", json=long, headers={"X-Sim-Output-Tokens": "5000"}
        ) as streamed:
            assert streamed.status_code == 200
            chunks = streamed.aiter_bytes()  # held: a dropped iterator would close the stream
            await chunks.__anext__()
            # Pending 5 at 1/s: a 5 s wait, over the 2 s bound.
            refused = await client.post(
                "/v1/chat/completions", json=scaler.wrap(CHAT, cost=1), headers=FIVE
            )
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "3"
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert "--max-wait-time" in error["message"]
        # The client left mid-stream: its workload is cancelled, not served.
        await wait_for(lambda: state.ledger.totals.cancelled == 5.0)
        assert state.ledger.pending == 0.0
        assert state.ledger.totals.rejected == 1.0
        after = await client.post(
            "/v1/chat/completions", json=scaler.wrap(CHAT, cost=1), headers=FIVE
        )
        assert after.status_code == 200
        await wait_for(lambda: scaler.reports and scaler.reports[-1]["cur_load"] == 0)
    assert sum(r["rej_load"] for r in scaler.reports) == 1.0
    rows = events(tmp_path / "audit.db")
    full = [r for r in rows if r["event"] == "queue_full"]
    assert len(full) == 1
    assert full[0]["status"] == 429
    assert full[0]["workload"] == 1.0


async def test_no_parallel_serves_one_request_at_a_time(
    tmp_path: Path, sim: Simulator, scaler: Autoscaler
) -> None:
    async with worker(tmp_path, sim.url, scaler, parallel=False, max_wait_time=100.0) as (
        _p,
        state,
        client,
    ):
        await until_ready(state)
        second: list[int] = []

        async def send_second() -> None:
            body = scaler.wrap(CHAT, cost=1)
            second.append((await client.post("/v1/chat/completions", json=body, headers=FIVE))
                          .status_code)  # fmt: skip

        first = scaler.wrap({**CHAT, "stream": True}, cost=1)
        async with trio.open_nursery() as nursery:
            async with client.stream(
                "POST", "/v1/chat/completions", json=first,
                headers={"X-Sim-Output-Tokens": "5000"},
            ) as streamed:  # fmt: skip
                chunks = streamed.aiter_bytes()
                await chunks.__anext__()
                nursery.start_soon(send_second)
                await wait_for(lambda: state.turn.statistics().tasks_waiting == 1)
                assert second == []
                assert len(state.ledger.working) == 2
            await wait_for(lambda: second == [200])


async def test_reports_carry_exactly_the_workload_served(
    tmp_path: Path, sim: Simulator, scaler: Autoscaler
) -> None:
    costs = [2, 3.5, 4, 1, 6]
    async with worker(tmp_path, sim.url, scaler) as (_p, state, client):
        await until_ready(state)
        idxs = []
        for cost in costs:
            body = scaler.wrap(CHAT, cost=cost)
            idxs.append(body["auth_data"]["request_idx"])
            assert (await client.post("/v1/chat/completions", json=body, headers=FIVE)).is_success
            await trio.sleep(0.3)  # spread over several report windows
        await wait_for(lambda: scaler.served_total() == sum(costs), timeout=10)
        # Each ended request is handed back once, as a success.
        await wait_for(
            lambda: sorted(i for d in scaler.deletes for i in d["request_idxs"]) == sorted(idxs)
        )
        assert all(d["success"] for d in scaler.deletes)
    reports = scaler.reports
    assert len([r for r in reports if r["cur_perf"]]) >= 2  # more than one window
    assert sum(r["new_load"] for r in reports) == sum(costs)
    assert len([r for r in reports if r["loadtime"]]) == 1
    assert {r["max_perf"] for r in reports[1:]} == {FIXED_THROUGHPUT}
    last = reports[-1]
    assert last["url"] == _p.url
    assert last["thunderproxy"]["programs"]["kv_capacity_tokens"] == KV_TOKENS
    assert last["thunderproxy"]["kv_capacity_tokens"] == KV_TOKENS
    # The calls named no program and each re-sent one prompt, so each began a program of its
    # own (a repeat of a prompt already answered is a parallel sample); all now between calls.
    programs = last["thunderproxy"]["programs"]
    assert (programs["programs_running"], programs["programs_acting"]) == (0, len(costs))
    assert 0 < programs["kv_demand_tokens"] < KV_TOKENS
    assert programs["kv_demand_ratio"] == round(programs["kv_demand_tokens"] / KV_TOKENS, 4)
    # Reports are audited; the master token is not.
    sent = [e for e in events(tmp_path / "audit.db") if e["event"] == "report_sent"]
    assert sent
    assert json.loads(sent[-1]["data"])["cur_load"] == 0


async def test_signing_key_outage_refuses_signed_requests_until_the_key_comes(
    tmp_path: Path, sim: Simulator, scaler: Autoscaler
) -> None:
    scaler.pubkey_status = 500
    async with worker(tmp_path, sim.url, scaler) as (_p, state, client):
        await wait_for(lambda: state.phase is Phase.READY and state.key_error is not None)
        refused = await client.post(
            "/v1/chat/completions", json=scaler.wrap(CHAT, cost=2), headers=FIVE
        )
        assert refused.status_code == 503
        assert "signing key" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"] == "5"
        health = (await client.get("/health")).json()
        assert health["worker"]["signing_key"].startswith("missing: ")
        await wait_for(lambda: any("cannot verify" in r["error_msg"] for r in scaler.reports))
        scaler.pubkey_status = 200
        await wait_for(lambda: state.public_key is not None, timeout=10)
        ok = await client.post("/v1/chat/completions", json=scaler.wrap(CHAT, cost=2), headers=FIVE)
        assert ok.status_code == 200
        await wait_for(lambda: scaler.reports[-1]["error_msg"] == "")
    assert state.ledger.totals.rejected == 2.0


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_beacon_when_the_backend_never_answers(tmp_path: Path, scaler: Autoscaler) -> None:
    backend = f"http://127.0.0.1:{closed_port()}"
    async with worker(tmp_path, backend, scaler, worker_ready_timeout=0.5) as (_p, state, client):
        await wait_for(lambda: state.phase is Phase.ERRORED, timeout=10)
        health = await client.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "error"
        assert "did not answer /health within 0.5 s" in health.json()["worker"]["error"]
        await wait_for(lambda: any("did not answer" in r["error_msg"] for r in scaler.reports))
    assert "errored" in [e["event"] for e in events(tmp_path / "audit.db")]


async def test_beacon_when_the_benchmark_fails(
    tmp_path: Path, sim: Simulator, scaler: Autoscaler
) -> None:
    broken = "tests.worker.benchmarks:broken"
    async with worker(tmp_path, sim.url, scaler, benchmark=broken) as (_p, state, client):
        await wait_for(lambda: state.phase is Phase.ERRORED, timeout=10)
        health = (await client.get("/health")).json()
        assert "no benchmark for" in health["worker"]["error"]
        await wait_for(lambda: any("benchmark failed" in r["error_msg"] for r in scaler.reports))


async def test_builtin_benchmark_measures_once_and_the_cache_skips_it(
    tmp_path: Path, sim: Simulator, scaler: Autoscaler
) -> None:
    options = {"benchmark": "", "program_tokens": 4_000}
    async with worker(tmp_path, sim.url, scaler, **options) as (_p, state, _c):
        await until_ready(state)
        first = state.capacity
    assert first is not None
    assert not first.cached
    assert first.max_throughput > 0
    assert first.kv_capacity_tokens == KV_TOKENS
    assert first.programs == KV_TOKENS // 4_000
    cache = json.loads((tmp_path / "bench.json").read_text())
    assert list(cache) == [f"{sim.url} {MODEL} builtin"]
    async with worker(tmp_path, sim.url, scaler, **options) as (_p, state, _c):
        await until_ready(state)
        again = state.capacity
    assert again is not None
    assert again.cached
    assert again.max_throughput == first.max_throughput
    rows = [e for e in events(tmp_path / "audit.db") if e["event"] == "benchmark"]
    assert [json.loads(r["data"])["cached"] for r in rows] == [False, True]


async def test_tls_with_a_self_signed_certificate(tmp_path: Path, sim: Simulator) -> None:
    certfile, keyfile = self_signed(tmp_path)
    tls = ssl.create_default_context(cafile=str(certfile))
    async with (
        running_proxy(tmp_path / "audit.db", backends=sim.url, datasette=False,
                      certfile=str(certfile), keyfile=str(keyfile)) as proxy,
        httpx.AsyncClient(base_url=proxy.url, verify=tls, timeout=10) as client,
    ):  # fmt: skip
        assert proxy.url.startswith("https://127.0.0.1:")
        assert (await client.get("/health")).status_code == 200
        ok = await client.post("/v1/chat/completions", json=CHAT, headers=FIVE)
        assert ok.status_code == 200
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(base_url=proxy.url, timeout=5) as untrusting:
                await untrusting.get("/health")
