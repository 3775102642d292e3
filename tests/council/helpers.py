"""Shared pieces of the council's end-to-end tests: a simulator serving three model names,
a proxy in front of it with a council of them, and an SSE reader."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.conftest import running_proxy
from thunderproxy.council.pipeline import RANKING, SYNTHESIS, TITLE, program_id
from thunderproxy.runtime import RunningProxy
from thunderproxy.sim import SimConfig, Simulator, open_simulator

MODELS = ("alpha-8b", "bravo-8b", "charlie-8b")


def sim_config(**changes: Any) -> SimConfig:
    values: dict[str, Any] = {
        "served_model_name": MODELS[0],
        "extra_served_model_names": ",".join(MODELS[1:]),
        "time_scale": 0.05,
        "output_len_dist": "fixed:40",
        "enable_prompt_tokens_details": True,
        **changes,
    }
    return SimConfig(**values)


@asynccontextmanager
async def council_proxy(
    db: Path, *, models: tuple[str, ...] = MODELS, sim: SimConfig | None = None, **overrides: Any
) -> AsyncIterator[tuple[RunningProxy, Simulator]]:
    async with open_simulator(sim or sim_config()) as simulator:
        settings = {
            "backends": simulator.url,
            "council_models": ",".join(models),
            "council_chairman": MODELS[0],
            "council_member_timeout": 30.0,
            "metrics_interval": 3600.0,
            "datasette": False,
            **overrides,
        }
        async with running_proxy(db, **settings) as proxy:
            yield proxy, simulator


class EventReader:
    """Reads one SSE body in parts (``id`` checked against ``seq``)."""

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.aiter_lines()
        self._id: int | None = None

    async def read(self, stop_after: int | None = None) -> list[dict[str, Any]]:
        """Events up to the end of the stream, or the next ``stop_after`` of them."""
        events: list[dict[str, Any]] = []
        async for line in self._lines:
            if line.startswith("id: "):
                self._id = int(line[4:])
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["seq"] == self._id
                events.append(event)
                if stop_after is not None and len(events) >= stop_after:
                    break
        return events


async def read_sse(response: httpx.Response) -> list[dict[str, Any]]:
    return await EventReader(response).read()


async def new_conversation(client: httpx.AsyncClient) -> str:
    response = await client.post("/council/api/conversations")
    assert response.status_code == 200
    conversation_id: str = response.json()["id"]
    return conversation_id


async def ask_streaming(
    client: httpx.AsyncClient, conversation_id: str, question: str
) -> list[dict[str, Any]]:
    url = f"/council/api/conversations/{conversation_id}/message/stream"
    with trio.fail_after(60):
        async with client.stream("POST", url, json={"content": question}) as response:
            assert response.status_code == 200, await response.aread()
            return await read_sse(response)


def types(events: list[dict[str, Any]]) -> list[str]:
    """Event types with chunks collapsed: the shape of a stream, whatever the timing."""
    out: list[str] = []
    for event in events:
        kind = event["type"]
        if kind.endswith("_chunk") and out and out[-1] == kind:
            continue
        out.append(kind)
    return out


def council_programs(
    job: str, members: Sequence[str], chairman: str, title: str | None = None
) -> set[str]:
    """The programs one job of a council runs: each member's answer and ranking, the
    chairman's synthesis and (on a conversation's first question) the title."""
    programs = {program_id(job, m) for m in members}
    programs |= {program_id(job, m, RANKING) for m in members}
    programs.add(program_id(job, chairman, SYNTHESIS))
    if title is not None:
        programs.add(program_id(job, title, TITLE))
    return programs
