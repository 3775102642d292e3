"""One task run by the openai-agents SDK's own Runner against an OpenAI-compatible base URL
(argv: base URL, model, task, turn limit, api: chat or responses). Tool calls are answered by a
function tool that returns "ok"; the run ends at the turn limit or at the model's final text."""

import asyncio
import sys

from agents import (
    Agent,
    MaxTurnsExceeded,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI


@function_tool
def bash(command: str) -> str:
    """Run a shell command."""
    return "ok"


async def main() -> None:
    base_url, model, task, turns, api = sys.argv[1:6]
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    set_tracing_disabled(True)
    if api == "chat":
        llm = OpenAIChatCompletionsModel(model=model, openai_client=client)
    else:
        llm = OpenAIResponsesModel(model=model, openai_client=client)
    agent = Agent(name="engineer", instructions="Use the bash tool.", tools=[bash], model=llm)
    try:
        result = await Runner.run(agent, task, max_turns=int(turns))
        print("final", len(result.raw_responses))  # the calls it made
    except MaxTurnsExceeded:
        print("max turns", turns)


if __name__ == "__main__":
    asyncio.run(main())
