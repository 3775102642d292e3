"""One mini-swe-agent task against an OpenAI-compatible base URL (argv: base URL, model, task,
step limit). Its agent loop and LiteLLM model are the real ones; only the environment is ours:
it answers every command with "ok" instead of running it, since the model is simulated."""

import sys
from typing import Any

from minisweagent.agents.default import DefaultAgent
from minisweagent.models.litellm_model import LitellmModel


class AnswerEveryCommand:
    config: Any = None

    def execute(self, action: dict[str, Any], cwd: str = "", **kwargs: Any) -> dict[str, Any]:
        return {"output": "ok", "returncode": 0, "exception_info": ""}

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {}

    def serialize(self) -> dict[str, Any]:
        return {}


def main() -> None:
    base_url, model, task, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    llm = LitellmModel(
        model_name="openai/" + model,
        model_kwargs={"api_base": base_url, "api_key": "unused", "max_tokens": 96},
        cost_tracking="ignore_errors",
    )
    agent = DefaultAgent(
        llm,
        AnswerEveryCommand(),
        system_template="You are a software engineer. Use the bash tool for every step.",
        instance_template="Task: {{task}}",
        step_limit=steps,
        max_consecutive_format_errors=0,
    )
    result = agent.run(task)
    print(result.get("exit_status"), agent.n_calls)


if __name__ == "__main__":
    main()
