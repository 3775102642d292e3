"""A small streaming agent loop for end-to-end tests: each step sends the whole conversation
so far, reads the streamed answer, appends it and a tool observation, and waits for the tool."""

from __future__ import annotations

import json

import httpx
import trio


async def stream_answer(client: httpx.AsyncClient, body: dict[str, object]) -> str:
    """One streamed chat call through ``client``; the answer's text."""
    reply = []
    headers = {"X-Sim-Output-Tokens": "32"}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    reply.append(choice["delta"].get("content") or "")
    return "".join(reply)


async def agent(
    client: httpx.AsyncClient,
    program_id: str,
    *,
    model: str,
    system: str,
    task: str,
    observation: str,
    steps: int,
    tool_s: float,
) -> None:
    """``steps`` calls of one program, then its release."""
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"task {program_id}: {task}"},
    ]
    for step in range(steps):
        body = {
            "model": model,
            "messages": messages,
            "program_id": program_id,
            "max_tokens": 64,
            "stream": True,
        }
        messages.append({"role": "assistant", "content": await stream_answer(client, body)})
        messages.append({"role": "user", "content": f"observation {step}: {observation}"})
        await trio.sleep(tool_s)  # the tool runs
    await client.post("/programs/release", json={"program_id": program_id})
