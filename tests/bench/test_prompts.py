"""Synthetic prompts: the ids the in-process transport submits are exactly what the simulator
makes of the messages an HTTP client sends, and only the system prompt is shared."""

from __future__ import annotations

from thunderproxy import protocols
from thunderproxy.bench.workloads.prompts import (
    BlockText,
    Conversation,
    Vocabulary,
    system_prompt,
)
from thunderproxy.bench.workloads.workload import StepSpec
from thunderproxy.sim.engine.tokenizer import TextGenerator, Tokenizer


def simulator_ids(conversation: Conversation, tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(conversation.openai_messages()))


def model_answer(tokenizer: Tokenizer, n: int, key: str) -> tuple[str, list[int]]:
    generator = TextGenerator(tokenizer, 0, key)
    pieces = [generator.next_token() for _ in range(n)]
    return "".join(text for _, text in pieces), [token for token, _ in pieces]


def test_an_append_only_conversation_matches_the_simulator_tokenizer_call_after_call() -> None:
    vocabulary = Vocabulary()
    tokenizer = vocabulary.tokenizer
    conversation = Conversation("p", vocabulary, system=system_prompt(vocabulary, 1800))
    previous: list[int] = []
    for target in (2_000, 2_700, 3_900):
        conversation.prepare(StepSpec(prompt_tokens=target, output_tokens=40))
        ids = conversation.prompt_ids()
        assert ids == simulator_ids(conversation, tokenizer)
        assert len(ids) == conversation.prompt_tokens == target
        # Append-only: the last prompt and its answer are a prefix of this one.
        assert ids[: len(previous)] == previous
        body = {"messages": conversation.openai_messages()}
        # What the proxy estimates tokens from.
        assert conversation.chars == protocols.prepare(protocols.Protocol.CHAT, body).prompt_chars
        text, answer = model_answer(tokenizer, 40, str(target))
        conversation.answer(text, answer)
        previous = ids + answer


def test_a_recorded_prompt_shorter_than_the_history_gets_the_smallest_observation() -> None:
    vocabulary = Vocabulary()
    conversation = Conversation("p", vocabulary, system=None)
    conversation.prepare(StepSpec(prompt_tokens=500, output_tokens=5))
    conversation.answer("done", vocabulary.tokenizer.encode("done"))
    conversation.prepare(StepSpec(prompt_tokens=100, output_tokens=5))
    assert conversation.prompt_tokens > 500


def test_programs_share_the_system_prompt_and_nothing_else() -> None:
    vocabulary = Vocabulary()
    system = system_prompt(vocabulary, 1000)
    a = Conversation("a", vocabulary, system=system)
    b = Conversation("b", vocabulary, system=system)
    for c in (a, b):
        c.prepare(StepSpec(prompt_tokens=3000, output_tokens=1))
    ids_a, ids_b = a.prompt_ids(), b.prompt_ids()
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=True)) if x != y)
    assert 1000 <= shared < 1000 + 8  # the user message's template opens identically


def test_block_prompts_share_exactly_their_common_blocks() -> None:
    vocabulary = Vocabulary()
    blocks = BlockText(vocabulary, 512)
    tokenizer = vocabulary.tokenizer
    a = Conversation("a", vocabulary, system=None, blocks=blocks)
    b = Conversation("b", vocabulary, system=None, blocks=blocks)
    a.prepare(StepSpec(prompt_tokens=1400, output_tokens=1, blocks=(0, 1, 2)))
    b.prepare(StepSpec(prompt_tokens=1600, output_tokens=1, blocks=(0, 1, 5, 6)))
    ids_a, ids_b = a.prompt_ids(), b.prompt_ids()
    assert ids_a == simulator_ids(a, tokenizer)
    assert len(ids_a) == 1400
    assert ids_b == simulator_ids(b, tokenizer)
    assert len(ids_b) == 1600
    opening = len(vocabulary.open["user"])
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y)
    assert shared == opening + 2 * 512
    # The same block ids always give the same text, even after the cache forgot them.
    again = BlockText(vocabulary, 512).prompt((0, 1, 2), 1400 - 9)
    assert again == blocks.prompt((0, 1, 2), 1400 - 9)


def test_an_answer_carried_in_part_keeps_its_last_tokens_and_none_of_its_kv() -> None:
    vocabulary = Vocabulary()
    tokenizer = vocabulary.tokenizer
    conversation = Conversation("p", vocabulary, system=system_prompt(vocabulary, 500))
    conversation.prepare(StepSpec(prompt_tokens=1_000, output_tokens=60))
    asked = conversation.prompt_ids()
    text, answer = model_answer(tokenizer, 60, "thinking")
    conversation.answer(text, answer, carried=18)
    conversation.prepare(StepSpec(prompt_tokens=1_400, output_tokens=5))
    ids = conversation.prompt_ids()
    assert ids == simulator_ids(conversation, tokenizer)
    # The next prompt holds the last tokens of the answer (a leading space is left out: it
    # would merge with the template's newline), not its first ones.
    kept = tokenizer.encode(conversation.messages[-2].content)
    assert 17 <= len(kept) <= 18
    assert kept == answer[len(answer) - len(kept) :]
    # The history matches what the engine computed up to the generation prompt, and no further:
    # the KV of the decoded answer cannot be reused.
    assert ids[: len(asked)] == asked
    assert ids[len(asked) : len(asked) + 8] != answer[:8]
    assert conversation.reusable_tokens == len(asked)


def test_an_answer_carried_whole_or_not_at_all() -> None:
    vocabulary = Vocabulary()
    tokenizer = vocabulary.tokenizer
    whole = Conversation("p", vocabulary, system=None)
    none = Conversation("p", vocabulary, system=None)
    text, answer = model_answer(tokenizer, 30, "a")
    for conversation, carried in ((whole, None), (none, 0)):
        conversation.prepare(StepSpec(prompt_tokens=300, output_tokens=30))
        conversation.answer(text, answer, carried=carried)
        assert conversation.prompt_ids() == simulator_ids(conversation, tokenizer)
    assert whole.messages[-1].content == text
    assert whole.reusable_tokens == len(whole.ids)
    assert none.messages[-1].content == ""
    assert len(none.ids) == len(whole.ids) - len(answer)
