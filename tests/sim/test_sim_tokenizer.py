"""The stand-in tokenizer: determinism, prefix stability, round trips."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from thunderproxy.sim.engine.tokenizer import END, START, TextGenerator, Tokenizer

TOK = Tokenizer()


def test_pieces_words_split_every_chars_per_token() -> None:
    assert TOK.pieces("Hello, wonderful world!\n\n") == [
        "Hell", "o", ",", " ", "wond", "erfu", "l", " ", "worl", "d", "!", "\n\n",
    ]  # fmt: skip
    assert Tokenizer(chars_per_token=2).pieces("abcde") == ["ab", "cd", "e"]


def test_ids_are_stable_and_specials_are_single_tokens() -> None:
    other = Tokenizer()
    assert other.encode("same text here") == TOK.encode("same text here")
    assert TOK.encode(f"{START}user\nhi{END}") == [
        TOK.start_id, TOK.piece_id("user"), TOK.piece_id("\n"), TOK.piece_id("hi"), TOK.eos_id,
    ]  # fmt: skip
    assert all(0 <= i < TOK.vocab_size for i in TOK.encode("x y z 123 ..."))


@given(st.text(max_size=60), st.text(max_size=60))
def test_prefix_stable_at_whitespace_boundaries(a: str, b: str) -> None:
    head = a.rstrip() + " "
    tail = b.lstrip() or "x"
    assert TOK.encode(head + tail)[: len(TOK.encode(head))] == TOK.encode(head)


def test_chat_template_counts_template_tokens() -> None:
    messages = [{"role": "user", "content": "hi"}]
    text = TOK.apply_chat_template(messages)
    assert text == f"{START}user\nhi{END}{START}assistant\n"
    assert len(TOK.encode(text)) == 10  # "assistant" is three pieces of <= 4 chars
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert TOK.apply_chat_template(parts) == text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_generated_text_retokenizes_exactly(seed: int) -> None:
    gen = TextGenerator(TOK, seed, "req-1")
    pairs = [gen.next_token() for _ in range(500)]
    text = "".join(p for _, p in pairs)
    assert TOK.encode(text) == [i for i, _ in pairs]
    assert not text[0].isspace()  # never merges with the template's trailing newline
    again = TextGenerator(TOK, seed, "req-1")
    assert [again.next_token() for _ in range(500)] == pairs


def test_detokenize_round_trip() -> None:
    # A fresh tokenizer: ids are hashes, and after thousands of random pieces (hypothesis)
    # a colliding id would decode to whichever piece was seen first.
    tok = Tokenizer()
    text = f"{START}user\nsome words, here{END}"
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.decode(tok.encode(text)) == "user\nsome words, here"


@given(
    st.lists(
        st.tuples(st.sampled_from(["user", "system", "assistant"]), st.text(max_size=40)),
        max_size=5,
    )
)
def test_encode_chat_equals_encoding_the_rendered_template(turns: list[tuple[str, str]]) -> None:
    messages = [{"role": role, "content": text} for role, text in turns]
    for _ in range(2):  # the second pass comes from the per-message memo
        assert TOK.encode_chat(messages) == TOK.encode(TOK.apply_chat_template(messages))
