"""Small synthetic traces in the shapes of the real ones, so bench tests need no trace files."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any


def thunderagent_rows(
    programs: int = 4, steps: int = 4, *, seed: int = 0, output: tuple[int, int] = (20, 80)
) -> list[dict[str, Any]]:
    """ThunderAgent-like calls: prompts growing by a few hundred tokens, short tool gaps."""
    rng = random.Random(seed)
    rows = []
    for p in range(programs):
        prompt = 400 + 40 * p
        for s in range(1, steps + 1):
            decoded = rng.randint(*output)
            rows.append(
                {
                    "program_id": f"bs4/task-{p}",
                    "step": s,
                    "input_tokens": prompt,
                    "output_tokens": decoded,
                    "tool_call_arg_tokens_est": 10 if p % 2 == 0 else None,
                    "gap_after_s": None if s == steps else 0.5 + 0.1 * p,
                    "program_start_s": 0.0,
                }
            )
            prompt += decoded + 10 + rng.randint(100, 400)
    return rows


def write_thunderagent(
    path: Path, programs: int = 4, steps: int = 4, *, output: tuple[int, int] = (20, 80)
) -> Path:
    rows = thunderagent_rows(programs, steps, output=output)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def mooncake_rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Three requests: a two-turn session sharing three blocks, and a lone request sharing
    block 0 (the system prompt) with it."""
    requests = [
        {"timestamp": 0, "input_length": 1500, "output_length": 20, "hash_ids": [0, 1, 2]},
        {"timestamp": 1000, "input_length": 700, "output_length": 10, "hash_ids": [0, 7]},
        {"timestamp": 4000, "input_length": 2000, "output_length": 30, "hash_ids": [0, 1, 2, 3]},
    ]
    sessions = [
        {"idx": 0, "session_id": 0, "turn": 0},
        {"idx": 1, "session_id": 1, "turn": 0},
        {"idx": 2, "session_id": 0, "turn": 1},
    ]
    return requests, sessions
