"""Transports: the HTTP one against a real simulator on loopback, and the in-process one,
which must give the same answers to the same conversation."""

from __future__ import annotations

import json

import httpx
import trio

from thunderproxy.backends.asgi import EngineBackend
from thunderproxy.bench.agents.transport import HttpTransport, InProcessTransport, SSEResult
from thunderproxy.bench.workloads.prompts import Conversation, Vocabulary, system_prompt
from thunderproxy.bench.workloads.workload import StepSpec
from thunderproxy.sim import Engine, SimConfig, open_simulator

CONFIG = SimConfig(
    time_scale=0.01,
    enable_prompt_tokens_details=True,
    kv_capacity_tokens=64_000,
    max_model_len=16_384,
)
TARGETS = (1_900, 2_600, 3_100)


def test_sse_results_collect_text_usage_and_errors() -> None:
    sse = SSEResult()
    assert sse.feed(json.dumps({"choices": [{"delta": {"role": "assistant", "content": "ka"}}]}))
    assert not sse.feed(json.dumps({"choices": [{"delta": {}}]}))
    usage = {
        "prompt_tokens": 9,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert not sse.feed(json.dumps({"choices": [], "usage": usage}))
    assert not sse.feed("[DONE]")
    assert sse.usage_tokens() == (9, 2, 4)
    assert "".join(sse.texts) == "ka"
    assert sse.error is None
    failed = SSEResult()
    failed.feed(json.dumps({"error": {"message": "EngineCore encountered an issue"}}))
    assert failed.error == "EngineCore encountered an issue"


async def converse(transport: HttpTransport | InProcessTransport) -> list[tuple[str, int, int]]:
    vocabulary = Vocabulary()
    conversation = Conversation("agent-7", vocabulary, system=system_prompt(vocabulary, 1_000))
    out = []
    for step, target in enumerate(TARGETS, start=1):
        conversation.prepare(StepSpec(prompt_tokens=target, output_tokens=25))
        result = await transport.call("agent-7", step, conversation, 25)
        assert result.ok, result.error
        assert result.prompt_tokens == conversation.prompt_tokens == target
        assert result.completion_tokens == 25 == len(result.ids)
        assert result.first_token_at is not None
        out.append((result.text, result.prompt_tokens, result.cached_tokens or 0))
        conversation.answer(result.text, result.ids)
    return out


async def test_http_and_in_process_calls_give_the_same_answers_and_cache_hits() -> None:
    async with open_simulator(CONFIG) as sim, httpx.AsyncClient(timeout=30) as client:
        http = HttpTransport(client, base_for=lambda _p: sim.url, model=CONFIG.served_model_name)
        with trio.fail_after(30):
            over_http = await converse(http)
    engine = Engine(CONFIG)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        backend = EngineBackend(engine, nursery, name="sim")
        local = InProcessTransport(
            {"sim": backend}, gateway=None, place=lambda _p: "sim", model=CONFIG.served_model_name
        )
        with trio.fail_after(30):
            in_process = await converse(local)
        nursery.cancel_scope.cancel()
    assert over_http == in_process
    # Append-only history: each call hits (nearly) all of the previous prompt and answer.
    for (_, previous_prompt, _), (_, _, cached) in zip(over_http, over_http[1:], strict=False):
        assert cached >= previous_prompt + 25 - 16


async def test_http_errors_become_failed_calls() -> None:
    async with open_simulator(CONFIG) as sim, httpx.AsyncClient(timeout=30) as client:
        http = HttpTransport(client, base_for=lambda _p: sim.url + "/nowhere", model="m")
        vocabulary = Vocabulary()
        conversation = Conversation("p", vocabulary, system=None)
        conversation.prepare(StepSpec(prompt_tokens=100, output_tokens=3))
        result = await http.call("p", 1, conversation, 3)
    assert result.status == 404
    assert not result.ok
