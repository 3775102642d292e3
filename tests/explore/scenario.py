"""A scripted run of the real proxy whose audit db the explorer tests query.

The proxy runs with the tr router in front of the fake backend (tests/fakebackend.py), so steps,
transitions, backend samples and tr's own decisions are what the real code writes. Traffic:

    alpha    3 plain calls, 1, 2, 3 messages, TOOL_S of tool time between them; paused for
             PAUSE_S between calls 1 and 2 (see below)
    beta     2 streamed calls of BETA_WORDS words, BETA_DELAY_S apart
    gamma    ok, backend error 500, ok (the retry)
    delta    abandoned mid-stream (499), then ok (the retry)
    -- every program above is released; a quiet gap; then --
    epsilon  1 call whose first prompt alone is larger than the backend's KV capacity: tr
             queues it (queue: capacity_full) until MAX_WAIT_S forces it through

The fake backend reports so few tokens per call that tr's capacity model never needs to pause an
acting program, so alpha's pause and resume (transitions and decisions) are recorded through the
proxy's own AuditLog with the real record types, as tr's enforce/resume round writes them.
"""

from __future__ import annotations

import json
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.conftest import running_proxy, wait_for
from tests.fakebackend import FakeBackend, serve_fake_backend
from thunderproxy.audit import DecisionRecord
from thunderproxy.audit.records import TransitionRecord
from thunderproxy.programs import ProgramStatus, Transition

TOOL_S = 0.15
PAUSE_AFTER_S = 0.02
PAUSE_S = 0.25
# Margins wide enough for a busy CI core: beta's decode (9 gaps of 0.1 s) outweighs its
# time to first token by 0.8 s, and epsilon's forced wait outlasts any other whole step.
BETA_WORDS = 10
BETA_DELAY_S = 0.1
MAX_WAIT_S = 2.0
GAP_S = 0.4
#: The fake backend's KV capacity: 1000 blocks of 16 tokens.
CAPACITY = 16000
#: What the injected pause decision says tr saw.
PAUSE_USED = 15800
PAUSE_PROGRAM_TOKENS = 1200

PROGRAMS = ("alpha", "beta", "gamma", "delta", "epsilon")


@dataclass
class History:
    """The db the scenario left behind and what the test knows about it."""

    db: Path
    backend: str
    #: Unix time in the quiet gap between the first four programs and epsilon.
    gap_at: float = 0.0
    #: Unix times of alpha's injected pause and resume.
    paused_at: float = 0.0
    resumed_at: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)


def chat(program_id: str, messages: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "fake",
        "messages": [
            {"role": "user", "content": f"{program_id} turn {i}"} for i in range(messages)
        ],
        "program_id": program_id,
        **extra,
    }


async def _alpha(client: httpx.AsyncClient, proxy: Any, history: History) -> None:
    for n in (1, 2, 3):
        r = await client.post("/v1/chat/completions", json=chat("alpha", n))
        assert r.status_code == 200
        if n == 1:
            await _pause_and_resume(proxy, history)
        await trio.sleep(TOOL_S)


async def _pause_and_resume(proxy: Any, history: History) -> None:
    """What tr's enforce and resume rounds record for a program paused while acting."""
    audit = proxy.audit
    backend = history.backend
    now = trio.current_time()
    paused, resumed = now + PAUSE_AFTER_S, now + PAUSE_AFTER_S + PAUSE_S
    audit.record(
        DecisionRecord(
            at=paused,
            program_id="alpha",
            action="pause",
            rule="over_capacity",
            backend=backend,
            target_backend=None,
            capacity_tokens=CAPACITY,
            used_tokens=PAUSE_USED,
            program_tokens=PAUSE_PROGRAM_TOKENS,
            idle_s=PAUSE_AFTER_S,
            waited_s=None,
            queue_position=None,
            detail=json.dumps({"scenario": "injected"}),
        )
    )
    audit.record(
        TransitionRecord(
            Transition(
                "alpha",
                ProgramStatus.ACTING,
                ProgramStatus.PAUSED,
                "paused: over_capacity",
                backend,
                1,
                paused,
            )
        )
    )
    audit.record(
        DecisionRecord(
            at=resumed,
            program_id="alpha",
            action="resume",
            rule="fits",
            backend=backend,
            target_backend=backend,
            capacity_tokens=CAPACITY,
            used_tokens=1000,
            program_tokens=PAUSE_PROGRAM_TOKENS,
            idle_s=None,
            waited_s=PAUSE_S,
            queue_position=0,
            detail=None,
        )
    )
    audit.record(
        TransitionRecord(
            Transition(
                "alpha",
                ProgramStatus.PAUSED,
                ProgramStatus.ACTING,
                "resumed: fits",
                backend,
                1,
                resumed,
            )
        )
    )
    clock = proxy.services.clock
    history.paused_at, history.resumed_at = clock.unix(paused), clock.unix(resumed)
    # A paused program's next call waits for its resume; alpha's tool is done by then.
    await trio.sleep_until(resumed)


async def _beta(client: httpx.AsyncClient) -> None:
    headers = {"x-fake-delay": str(BETA_DELAY_S), "x-fake-words": str(BETA_WORDS)}
    for n in (1, 2):
        body = chat("beta", n, stream=True)
        r = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200
        await trio.sleep(TOOL_S)


async def _gamma(client: httpx.AsyncClient) -> None:
    for n, status in ((1, 200), (2, 500), (3, 200)):
        headers = {"x-fake-status": str(status)}
        r = await client.post("/v1/chat/completions", json=chat("gamma", n), headers=headers)
        assert r.status_code == status


async def _delta(client: httpx.AsyncClient, backend: FakeBackend, proxy: Any) -> None:
    headers = {"x-fake-delay": "0.1", "x-fake-words": "50"}
    body = chat("delta", 1, stream=True)
    async with (
        client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r,
        aclosing(r.aiter_raw()) as chunks,
    ):
        async for _ in chunks:
            break
    await wait_for(lambda: "delta-1" in backend.aborted)
    program = proxy.services.scheduler.registry.get("delta")
    await wait_for(lambda: program.in_flight == 0)
    r = await client.post("/v1/chat/completions", json=chat("delta", 2))
    assert r.status_code == 200


async def run_scenario(db: Path) -> History:
    async with trio.open_nursery() as nursery:
        fake = FakeBackend()
        await nursery.start(serve_fake_backend, fake)
        history = History(db=db, backend=fake.url)
        async with (
            running_proxy(
                db,
                backends=fake.url,
                router="tr",
                return_evidence=False,  # tr holds epsilon, though few programs came back
                max_wait=MAX_WAIT_S,
                max_wait_share=0.0,  # forced through at MAX_WAIT_S, whatever the program's age
                monitor_interval=0.05,
                metrics_interval=0.2,
                datasette=False,
            ) as proxy,
            httpx.AsyncClient(base_url=proxy.url, timeout=10) as client,
        ):
            with trio.fail_after(20):
                async with trio.open_nursery() as agents:
                    agents.start_soon(_alpha, client, proxy, history)
                    agents.start_soon(_beta, client)
                    agents.start_soon(_gamma, client)
                    agents.start_soon(_delta, client, fake, proxy)
                for program_id in PROGRAMS[:-1]:
                    r = await client.post("/programs/release", json={"program_id": program_id})
                    assert r.status_code == 200
                await trio.sleep(GAP_S / 2)
                history.gap_at = proxy.services.clock.unix(trio.current_time())
                await trio.sleep(GAP_S / 2)
                # 70,000 characters: about 17,500 tokens, more than the whole KV cache.
                big = {**chat("epsilon", 1), "messages": [{"role": "user", "content": "x" * 70000}]}
                r = await client.post("/v1/chat/completions", json=big)
                assert r.status_code == 200
                r = await client.post("/programs/release", json={"program_id": "epsilon"})
                assert r.status_code == 200
                # Two requests the proxy refuses itself: they leave only a rejections row.
                r = await client.post("/v1/chat/completions", content=b"{not json")
                assert r.status_code == 400
                await trio.sleep(0.01)
                r = await client.post("/programs/release", json={"program_id": "ghost"})
                assert r.status_code == 404
        nursery.cancel_scope.cancel()
    return history
