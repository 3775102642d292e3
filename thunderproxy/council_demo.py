"""``thunderproxy demo --council``: a whole council on the embedded simulator.

One process holds a simulated vLLM answering to three model names, the proxy (router tr, the
audit db, Datasette) with a council of those three, and a client that asks one question over
the council's SSE API and prints each stage as it arrives. Then it keeps serving, so the page
at ``/council/`` and the job's rows in Datasette can be looked at.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from .runtime import open_demo
from .sim import SimConfig

MODELS = ("council-alpha", "council-bravo", "council-charlie")


@dataclass(frozen=True)
class CouncilDemoConfig:
    question: str = "Why is the sky blue, and why are sunsets red?"
    host: str = "127.0.0.1"
    port: int = 8300
    db: str = "thunderproxy-demo.db"
    time_scale: float = 0.1
    wait: bool = True


def _short(text: str, width: int = 96) -> str:
    return textwrap.shorten(" ".join(text.split()), width=width, placeholder=" …")


def describe(event: dict[str, Any]) -> list[str]:
    """The lines the demo prints for one council event (chunks print nothing). Pure."""
    kind = event["type"]
    if kind == "stage1_start":
        return ["", f"Stage 1: {len(event['models'])} members answer in parallel"]
    if kind == "stage1_member":
        if event["ok"]:
            return [f"  {event['model']}: {_short(event['response'])}"]
        return [f"  {event['model']}: FAILED: {event['error']}"]
    if kind == "stage2_start":
        labels = ", ".join(f"{k} = {v}" for k, v in event["label_to_model"].items())
        return ["", "Stage 2: each member ranks the anonymized answers", f"  ({labels})"]
    if kind == "stage2_member":
        if event["ok"]:
            return [f"  {event['model']} ranks: {' > '.join(event['parsed_ranking'])}"]
        return [f"  {event['model']}: FAILED: {event['error']}"]
    if kind == "stage2_complete":
        lines = ["  leaderboard (average position, votes, first places):"]
        for n, s in enumerate(event["aggregate_rankings"], start=1):
            lines.append(f"    {n}. {s['model']:<18} {s['average_rank']:.2f}  "
                         f"{s['rankings_count']}  {s['first_places']}")  # fmt: skip
        return lines
    if kind == "stage3_start":
        return ["", f"Stage 3: the chairman, {event['model']}, synthesises"]
    if kind == "stage3_complete":
        return ["  " + line for line in event["response"].splitlines()]
    if kind == "title_complete":
        return ["", f"Title: {event['title']}"]
    if kind == "resumed":
        return [f"(resumed after stage {event['completed_stage']})"]
    if kind == "error":
        return ["", f"The council failed: {event['message']}"]
    return []


async def ask(
    client: httpx.AsyncClient, question: str, echo: Callable[[str], None]
) -> tuple[str, list[dict[str, Any]]]:
    """Create a conversation, ask over SSE, print the stages; (conversation id, events)."""
    conversation = (await client.post("/council/api/conversations")).json()["id"]
    events: list[dict[str, Any]] = []
    url = f"/council/api/conversations/{conversation}/message/stream"
    async with client.stream("POST", url, json={"content": question}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the council refused the question: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                events.append(event)
                for text in describe(event):
                    echo(text)
    return conversation, events


async def run_council_demo(
    config: CouncilDemoConfig,
    *,
    echo: Callable[[str], None] = print,
    task_status: trio.TaskStatus[list[dict[str, Any]]] = trio.TASK_STATUS_IGNORED,
) -> list[dict[str, Any]]:
    sim_config = SimConfig(
        served_model_name=MODELS[0],
        extra_served_model_names=",".join(MODELS[1:]),
        time_scale=config.time_scale,
        output_len_dist="lognormal:120:0.3",
        enable_prompt_tokens_details=True,
    )
    values = {
        "host": config.host,
        "port": config.port,
        "db": config.db,
        "council_models": ",".join(MODELS),
        "council_chairman": MODELS[0],
    }
    async with open_demo(sim_config, values, wait=config.wait, echo=echo) as (proxy, _sim_url):
        echo(
            f"thunderproxy demo --council: {', '.join(MODELS)} on a simulated vLLM, "
            f"through the proxy at {proxy.url} (each member's calls one tr program)"
        )
        echo(f"Question: {config.question}")
        timeout = httpx.Timeout(None, connect=10.0)
        async with httpx.AsyncClient(base_url=proxy.url, timeout=timeout) as client:
            conversation, events = await ask(client, config.question, echo)
        base = proxy.url.rstrip("/")
        echo("")
        echo(f"{len(events)} events, each a row of council_events in {config.db}")
        echo(f"the page: {base}/council/#{conversation}")
        if proxy.services.settings.datasette:
            echo(f"the job in Datasette: {base}/datasette/audit/council_job_timeline"
                 f"?job_id={events[0]['job_id']}")  # fmt: skip
        task_status.started(events)
    return events
