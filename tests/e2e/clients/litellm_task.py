"""One task as an application loops over LiteLLM's completion() (argv: base URL, model, task,
turns): each turn resends the history with the answer and a tool output for each tool call."""

import json
import sys

import litellm

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


def main() -> None:
    base_url, model, task, turns = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    messages: list[dict] = [
        {"role": "system", "content": "You are a software engineer. Use the bash tool."},
        {"role": "user", "content": task},
    ]
    for _ in range(turns):
        answer = litellm.completion(
            model="openai/" + model,
            api_base=base_url,
            api_key="unused",
            messages=messages,
            tools=[BASH],
            max_tokens=96,
            num_retries=0,
        )
        message = answer.choices[0].message
        messages.append(json.loads(message.model_dump_json(exclude_none=True)))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "ok"})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "Go on."})
    print("done", turns)


if __name__ == "__main__":
    main()
