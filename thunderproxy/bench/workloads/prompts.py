"""Synthetic prompt text with exactly known token ids, pure.

The simulated vLLM tokenizes text with a stable stand-in tokenizer
(``sim/engine/tokenizer.py``): a run of letters splits every four characters and each piece maps
to a fixed id. Prompts here are built from a vocabulary of four-letter words written without
spaces, so ``n`` words are exactly ``n`` tokens whatever is around them, and the ids are known
without tokenizing. One :class:`Conversation` therefore yields both the chat messages an HTTP
client sends and the token ids the in-process transport submits, and they agree (tests check it
against the simulator's own chat template).

What is shared, and what is not:
- the system message is the same for every program of a workload (the shared prefix);
- everything else a program appends is drawn from its own seeded stream, so two programs share
  no block beyond the system message;
- a Mooncake block id always gives the same tokens, so equal ``hash_ids`` mean equal prefixes.
"""

from __future__ import annotations

import random
import string
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...sim.engine.tokenizer import END, START, Tokenizer
from .workload import StepSpec

#: Distinct words the text is drawn from: enough that 16-token blocks never collide by chance.
VOCABULARY = 4096
#: The fewest content tokens a new user message (a tool observation) has.
MIN_MESSAGE_TOKENS = 8
#: Mooncake blocks kept ready, most recently used last (block 0, the system prompt, stays hot).
BLOCK_CACHE = 4096


class Vocabulary:
    """Four-letter words and the ids the simulator's tokenizer gives them."""

    def __init__(self, tokenizer: Tokenizer | None = None, *, seed: int = 0) -> None:
        self.tokenizer = tokenizer or Tokenizer()
        # A seeded sample of the 26^4 four-letter words, drawn by index (building and
        # shuffling all 457k of them took seconds).
        picks = random.Random(f"vocabulary:{seed}").sample(range(26**4), VOCABULARY)
        self.words = [_word(i) for i in picks]
        self.ids = [self.tokenizer.piece_id(w) for w in self.words]
        tok = self.tokenizer
        # Chat template pieces, as the simulator's apply_chat_template writes them.
        self.open = {role: tok.encode(f"{START}{role}\n") for role in ("system", "user")}
        self.open["assistant"] = tok.encode(f"{START}assistant\n")
        self.end = tok.encode(END)

    def draw(self, rng: random.Random, n: int) -> tuple[str, list[int]]:
        """``n`` tokens of text and their ids."""
        picks = rng.choices(range(len(self.words)), k=n)
        words, ids = self.words, self.ids
        return "".join(words[i] for i in picks), [ids[i] for i in picks]

    def overhead(self, role: str) -> int:
        """Template tokens around a message's content."""
        return len(self.open[role]) + len(self.end)


def _word(index: int) -> str:
    letters = string.ascii_lowercase
    chars = []
    for _ in range(4):
        index, rest = divmod(index, 26)
        chars.append(letters[rest])
    return "".join(chars)


class BlockText:
    """Mooncake blocks: block id -> (text, ids) of ``block_tokens`` tokens, cached LRU."""

    def __init__(self, vocabulary: Vocabulary, block_tokens: int, *, seed: int = 0) -> None:
        self.vocabulary = vocabulary
        self.block_tokens = block_tokens
        self.seed = seed
        self._cache: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()

    def block(self, block_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(block_id)
        if hit is not None:
            self._cache.move_to_end(block_id)
            return hit
        rng = random.Random(f"block:{self.seed}:{block_id}")
        made = self.vocabulary.draw(rng, self.block_tokens)
        self._cache[block_id] = made
        if len(self._cache) > BLOCK_CACHE:
            self._cache.popitem(last=False)
        return made

    def prompt(self, blocks: Sequence[int], tokens: int) -> tuple[str, list[int]]:
        """The first ``tokens`` tokens of the concatenated blocks."""
        texts: list[str] = []
        ids: list[int] = []
        for block_id in blocks:
            if len(ids) >= tokens:
                break
            text, block_ids = self.block(block_id)
            take = min(len(block_ids), tokens - len(ids))
            texts.append(text[: 4 * take])
            ids.extend(block_ids[:take])
        if len(ids) < tokens:  # more tokens than blocks: pad from the last block's stream
            text, more = self.vocabulary.draw(random.Random(f"pad:{blocks}"), tokens - len(ids))
            texts.append(text)
            ids.extend(more)
        return "".join(texts), ids


@dataclass(frozen=True)
class Message:
    role: str
    content: str


class Conversation:
    """One program's prompt as it grows: chat messages and their token ids, kept in step.

    ``prepare(step)`` makes the prompt for a call; ``answer(text, ids)`` appends the model's
    reply. Append-only programs add one user message per call, sized so the prompt has the
    step's recorded length; block programs replace the prompt with the step's blocks.
    """

    def __init__(
        self,
        program_id: str,
        vocabulary: Vocabulary,
        *,
        system: tuple[str, list[int]] | None,
        blocks: BlockText | None = None,
        seed: int = 0,
    ) -> None:
        self.program_id = program_id
        self.vocabulary = vocabulary
        self.blocks = blocks
        self._rng = random.Random(f"conversation:{seed}:{program_id}")
        self.messages: list[Message] = []
        #: Token ids of every complete message so far (the generation prompt is added on top).
        self.ids: list[int] = []
        #: Characters of message content, which is what the proxy's context estimate counts.
        self.chars = 0
        #: Tokens at the head of the history whose KV the engine computed there: what the next
        #: call could find cached (set by ``answer``).
        self.reusable_tokens = 0
        if system is not None:
            self._append("system", *system)

    def _append(self, role: str, text: str, ids: Sequence[int]) -> None:
        v = self.vocabulary
        self.messages.append(Message(role, text))
        self.ids.extend(v.open[role])
        self.ids.extend(ids)
        self.ids.extend(v.end)
        self.chars += len(text)

    def prepare(self, step: StepSpec) -> None:
        v = self.vocabulary
        if step.blocks is not None:
            if self.blocks is None:
                raise ValueError("a block prompt needs a BlockText")
            self.messages, self.ids, self.chars = [], [], 0
            content = step.prompt_tokens - v.overhead("user") - len(v.open["assistant"])
            self._append("user", *self.blocks.prompt(step.blocks, max(1, content)))
            return
        wanted = step.prompt_tokens - len(self.ids) - v.overhead("user") - len(v.open["assistant"])
        # Never shrink (prompts are append-only); a recorded prompt shorter than what the
        # conversation already holds gets the smallest observation instead.
        self._append("user", *v.draw(self._rng, max(MIN_MESSAGE_TOKENS, wanted)))

    def answer(self, text: str, ids: Sequence[int], *, carried: int | None = None) -> None:
        """The model's reply becomes part of the history (append-only): all of it, or only its
        last ``carried`` tokens (what a reasoning model's client sends back without the
        thinking). The history then differs from what the model decoded from the answer's first
        token on, so the KV of the answer is not reused: the carried tokens are prefilled again
        at their new place, as a real engine would."""
        before = len(self.ids)
        if carried is not None and carried < len(ids):
            text, ids = self._tail(text, carried)
            self._append("assistant", text, ids)
            # The engine computed the prompt up to the generation prompt, then other tokens.
            self.reusable_tokens = before + len(self.vocabulary.open["assistant"])
            return
        self._append("assistant", text, ids)
        self.reusable_tokens = len(self.ids)

    def _tail(self, text: str, tokens: int) -> tuple[str, list[int]]:
        tokenizer = self.vocabulary.tokenizer
        every = tokenizer.pieces(text)
        pieces = every[len(every) - tokens :] if tokens > 0 else []
        # A message may not start with whitespace: the template's newline before it would
        # merge with it into one token, and the ids here would no longer be the engine's.
        while pieces and pieces[0].isspace():
            pieces.pop(0)
        tail = "".join(pieces)
        return tail, tokenizer.encode(tail)

    def prompt_ids(self) -> list[int]:
        """What the simulator's chat template tokenizes the messages to, generation prompt on."""
        return [*self.ids, *self.vocabulary.open["assistant"]]

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids) + len(self.vocabulary.open["assistant"])

    def openai_messages(self) -> list[dict[str, Any]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]


def system_prompt(vocabulary: Vocabulary, tokens: int, *, seed: int = 0) -> tuple[str, list[int]]:
    """The shared system message: ``tokens`` tokens in all, its template included."""
    content = max(1, tokens - vocabulary.overhead("system"))
    return vocabulary.draw(random.Random(f"system:{seed}"), content)
