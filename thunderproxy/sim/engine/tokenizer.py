"""A deterministic, prefix-stable stand-in for a real tokenizer, and the text the model "writes".

No tokenizer can be downloaded here, and the simulator only needs two properties of one:
the same text always gives the same ids, and text that is extended at a token boundary
keeps its earlier ids (so an agent that resends its history gets real prefix-cache hits).
Generated text is built from pieces that retokenize to exactly the ids that were emitted.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

START = "<|start|>"
END = "<|end|>"

_SYLLABLES = (
    "ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "zu", "an", "el",
    "tor", "ben", "dal", "qui", "sar", "om", "ix", "ul",
)  # fmt: skip
_PUNCT = (".", ",", ";", ":", "!", "?")
_MESSAGE_CACHE = 8192  # messages whose ids are memoised


class Tokenizer:
    """Words split every `chars_per_token` characters, punctuation and whitespace runs.

    Ids are a stable hash of the piece modulo `vocab_size - 2`; the last two ids are the
    chat template's `<|start|>` and `<|end|>` (which is also end-of-sequence).
    """

    def __init__(self, *, vocab_size: int = 128_256, chars_per_token: int = 4) -> None:
        if vocab_size < 16 or chars_per_token < 1:
            raise ValueError("vocab_size must be >= 16 and chars_per_token >= 1")
        self.vocab_size = vocab_size
        self.chars_per_token = chars_per_token
        self.start_id = vocab_size - 2
        self.eos_id = vocab_size - 1
        self._pattern = re.compile(rf"<\|start\|>|<\|end\|>|\w{{1,{chars_per_token}}}|[^\w\s]|\s+")
        self._ids: dict[str, int] = {START: self.start_id, END: self.eos_id}
        self._pieces: dict[int, str] = {self.start_id: START, self.eos_id: END}
        self._units: dict[str, list[tuple[int, str]]] = {}
        self._messages: dict[tuple[str, str], list[int]] = {}

    def unit_tokens(self, unit: str) -> list[tuple[int, str]]:
        """(id, piece) pairs of a generator unit, last first; memoised (units repeat a lot)."""
        cached = self._units.get(unit)
        if cached is None:
            cached = [(self.piece_id(p), p) for p in reversed(self.pieces(unit))]
            self._units[unit] = cached
        return cached

    def pieces(self, text: str) -> list[str]:
        return self._pattern.findall(text)

    def piece_id(self, piece: str) -> int:
        token_id = self._ids.get(piece)
        if token_id is None:
            digest = hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=8)
            token_id = int.from_bytes(digest.digest(), "little") % (self.vocab_size - 2)
            self._ids[piece] = token_id
            # First piece seen wins a colliding id; detokenize is best effort for collisions.
            self._pieces.setdefault(token_id, piece)
        return token_id

    def encode(self, text: str) -> list[int]:
        ids = self._ids
        lookup = self.piece_id
        return [ids[p] if p in ids else lookup(p) for p in self._pattern.findall(text)]

    def piece(self, token_id: int) -> str:
        known = self._pieces.get(token_id)
        if known is not None:
            return known
        # Ids never produced by this tokenizer still need some text; make one up stably.
        return " " + _word_from_int(token_id)

    def decode(self, token_ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        parts = []
        for token_id in token_ids:
            if skip_special_tokens and token_id in (self.start_id, self.eos_id):
                continue
            parts.append(self.piece(token_id))
        return "".join(parts)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """`encode(apply_chat_template(...))`, one message at a time.

        Message boundaries are special tokens, which always end a piece, so a message's
        ids do not depend on its neighbours. Agents resend their whole history every turn;
        memoising per message saves re-tokenizing it.
        """
        ids: list[int] = []
        cache = self._messages
        for message in messages:
            key = (str(message.get("role", "user")), message_text(message))
            cached = cache.get(key)
            if cached is None:
                cached = self.encode(f"{START}{key[0]}\n{key[1]}{END}")
                if len(cache) >= _MESSAGE_CACHE:
                    del cache[next(iter(cache))]  # oldest first: dicts keep insertion order
                cache[key] = cached
            ids.extend(cached)
        if add_generation_prompt:
            ids.extend(self.encode(f"{START}assistant\n"))
        return ids

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        out = []
        for message in messages:
            out.append(f"{START}{message.get('role', 'user')}\n{message_text(message)}{END}")
        if add_generation_prompt:
            out.append(f"{START}assistant\n")
        return "".join(out)


def message_text(message: Mapping[str, Any]) -> str:
    """The text of a chat message whose content is a string, a list of parts or null."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if isinstance(part, Mapping) and isinstance(part.get("text"), str):
            texts.append(part["text"])
    return "".join(texts)


def _word_from_int(value: int) -> str:
    syllables = []
    value = abs(value)
    while True:
        value, rest = divmod(value, len(_SYLLABLES))
        syllables.append(_SYLLABLES[rest])
        if value == 0:
            return "".join(syllables)


class TextGenerator:
    """The model's output: a seeded word stream whose text retokenizes to the emitted ids.

    Units alternate so that no two of them merge when retokenized: a word is followed by a
    space or punctuation, punctuation by a space or newline, whitespace by a word. The
    stream starts with a word, so it never merges with the template's trailing newline.
    """

    __slots__ = ("_tok", "_random", "_pending", "_after_word", "_after_punct")

    def __init__(self, tokenizer: Tokenizer, seed: int, request_key: str) -> None:
        self._tok = tokenizer
        self._random = random.Random(f"{seed}:{request_key}").random
        self._pending: list[tuple[int, str]] = []
        self._after_word = False
        self._after_punct = False

    def next_token(self) -> tuple[int, str]:
        if not self._pending:
            self._refill()
        return self._pending.pop()

    def _refill(self) -> None:
        r = self._random
        tok = self._tok
        if self._after_word:
            self._after_word = False
            if r() < 0.85:
                unit = " "
            else:
                unit = _PUNCT[int(r() * len(_PUNCT))]
                self._after_punct = True
        elif self._after_punct:
            self._after_punct = False
            unit = " " if r() < 0.8 else "\n"
        else:
            x = r()
            n = 1 if x < 0.4 else 2 if x < 0.8 else 3
            unit = "".join(_SYLLABLES[int(r() * len(_SYLLABLES))] for _ in range(n))
            self._after_word = True
        self._pending = tok.unit_tokens(unit)[:]
