"""Council-shaped answers, so a council runs end to end on the simulator.

The simulated model writes seeded nonsense words, which a council can stream and show but not
rank: its peer-review prompt wants a ``FINAL RANKING:`` list naming the responses it was shown.
This module recognises the council's three special prompts (ranking, chairman, title; their
wording is in ``thunderproxy/council/deliberation.py``) and scripts an answer in the expected shape;
every other request keeps the usual generated text. The engine writes the script at
the usual speed, token by token, then stops with EOS. The order a member ranks in is seeded by
the model name and the prompt, so members disagree, and runs repeat exactly.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from ..engine.tokenizer import Tokenizer, message_text

RANKING_MARKER = "FINAL RANKING:"
CHAIRMAN_MARKER = "You are the Chairman of an LLM Council"
TITLE_MARKER = "Write a short title"
_LABEL_LINE = re.compile(r"^(Response [A-Z]):$", re.MULTILINE)
_MODEL_LINE = re.compile(r"^Model: (.+)$", re.MULTILINE)
_QUESTION = re.compile(r"^(?:Original question|Question): (.+)$", re.MULTILINE)
_VERDICTS = (
    "is thorough and well organised, though it could be shorter",
    "is accurate but leaves out an important case",
    "reads clearly and gives a usable example",
    "is plausible, but one claim needs a source",
    "answers the question directly and stays on topic",
)


def _last_user_text(body: Mapping[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ""
    for message in reversed(messages):
        if isinstance(message, Mapping) and message.get("role") == "user":
            return message_text(message)
    return ""


def ranking_answer(prompt: str, model: str, seed: int) -> str:
    labels = list(dict.fromkeys(_LABEL_LINE.findall(prompt)))
    rng = random.Random(f"{seed}:{model}:{len(prompt)}:{prompt[-200:]}")
    lines = [f"{label} {rng.choice(_VERDICTS)}." for label in labels]
    order = labels[:]
    rng.shuffle(order)
    ranking = "\n".join(f"{n}. {label}" for n, label in enumerate(order, start=1))
    return "\n".join(lines) + f"\n\n{RANKING_MARKER}\n{ranking}"


def chairman_answer(prompt: str) -> str:
    models = list(dict.fromkeys(_MODEL_LINE.findall(prompt)))
    question = _QUESTION.search(prompt)
    asked = question.group(1).strip() if question else "the question"
    members = ", ".join(f"`{m}`" for m in models) or "the members"
    return (
        "## The council's answer\n\n"
        f"On *{asked}*, the council ({members}) mostly agreed.\n\n"
        "- **Agreed:** the answers share the main points.\n"
        "- **Disputed:** how much detail the question needs.\n\n"
        "In short, the best-ranked answer holds, with the other answers' caveats added."
    )


def title_answer(prompt: str) -> str:
    question = _QUESTION.search(prompt)
    words = (question.group(1) if question else "").split()[:4]
    return " ".join(w.strip("?.,!:;") for w in words).capitalize() or "Council question"


def scripted_answer(body: Mapping[str, Any], seed: int) -> str | None:
    """The answer to a council prompt, or None for any other request."""
    prompt = _last_user_text(body)
    model = str(body.get("model") or "")
    if prompt.startswith(CHAIRMAN_MARKER):
        return chairman_answer(prompt)
    if prompt.startswith(TITLE_MARKER):
        return title_answer(prompt)
    if RANKING_MARKER in prompt and _LABEL_LINE.search(prompt):
        return ranking_answer(prompt, model, seed)
    return None


def council_script(
    body: Mapping[str, Any], seed: int, tokenizer: Tokenizer
) -> list[tuple[int, str]] | None:
    """The (id, text) tokens the engine writes for a council prompt (then EOS), or None."""
    text = scripted_answer(body, seed)
    if text is None:
        return None
    return [(tokenizer.piece_id(p), p) for p in tokenizer.pieces(text)]
