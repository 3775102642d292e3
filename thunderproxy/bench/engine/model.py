"""The tiny model the CPU engine serves, written as files (pure but for the writing).

The tokenizer's vocabulary is the bench's own prompt words (``workloads.prompts.Vocabulary``),
the simulator's chat-template pieces and its special tokens, and it splits text with the
simulator's tokenizer pattern: one bench word is one engine token, so prompts have on the
engine exactly the lengths the simulator counts. Any other piece is ``<unk>``, still one
token. The decoder joins pieces without spaces, so an answer made of vocabulary words
retokenizes to the ids that were generated and the next prompt extends the last one exactly.

The weights are random (vLLM's ``--load-format dummy``); the model only has to have a real
architecture so that the engine's scheduler, KV cache and kernels do real work.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...sim.engine.tokenizer import END, START
from ..workloads.prompts import Vocabulary

UNK = "<unk>"
#: What the simulator's chat template writes around messages, as its pattern splits it.
TEMPLATE_PIECES = ("syst", "em", "user", "assi", "stan", "t", "tool", "\n", " ")
#: The simulator tokenizer's pattern without the special tokens (the tokenizer matches those
#: first, as added tokens).
SPLIT_PATTERN = r"\w{1,4}|[^\w\s]|\s+"
CHAT_TEMPLATE = (
    "{% for message in messages %}" + START + "{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['text'] is defined %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    + END
    + "{% endfor %}{% if add_generation_prompt %}"
    + START
    + "assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2-style decoder, small enough that one CPU core runs it at agent scale."""

    layers: int = 4
    hidden: int = 256
    intermediate: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, bf16."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


@dataclass(frozen=True)
class EngineModel:
    """Where the files are and what the bench needs to know of the vocabulary."""

    model_dir: Path
    tokenizer_dir: Path
    #: Ids of the bench's words: the only ids an answer may be sampled from.
    word_ids: tuple[int, ...]


def vocab_pieces(vocabulary: Vocabulary) -> list[str]:
    """Every piece, in id order: the specials, the template's pieces, then the words."""
    pieces = [UNK, START, END, *TEMPLATE_PIECES]
    seen = set(pieces)
    for word in vocabulary.words:
        if word not in seen:
            seen.add(word)
            pieces.append(word)
    return pieces


def tokenizer_json(pieces: Sequence[str]) -> dict[str, Any]:
    """A ``tokenizers`` WordLevel tokenizer, in the file format ``tokenizer.json`` has."""
    specials = [
        {
            "id": pieces.index(token),
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for token in (UNK, START, END)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": specials,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"Regex": SPLIT_PATTERN},
            "behavior": "Isolated",
            "invert": False,
        },
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {
            "type": "WordLevel",
            "vocab": {p: i for i, p in enumerate(pieces)},
            "unk_token": UNK,
        },  # fmt: skip
    }


def model_config(
    shape: ModelShape, *, vocab_size: int, max_model_len: int, eos_id: int
) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "num_hidden_layers": shape.layers,
        "max_position_embeddings": max_model_len,
        "max_window_layers": shape.layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def write_model(
    folder: Path, vocabulary: Vocabulary, *, max_model_len: int, shape: ModelShape = ModelShape()
) -> EngineModel:
    """Write the model config and the tokenizer into two folders under ``folder``. The
    tokenizer's folder has no ``config.json``: with one, transformers would build the
    architecture's own tokenizer class instead of reading ``tokenizer.json``."""
    pieces = vocab_pieces(vocabulary)
    model_dir, tokenizer_dir = folder / "model", folder / "tokenizer"
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    eos_id = pieces.index(END)
    config = model_config(shape, vocab_size=len(pieces), max_model_len=max_model_len, eos_id=eos_id)
    _write(model_dir / "config.json", config)
    _write(model_dir / "generation_config.json", {"eos_token_id": eos_id})
    _write(tokenizer_dir / "tokenizer.json", tokenizer_json(pieces))
    _write(
        tokenizer_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": UNK,
            "eos_token": END,
            "pad_token": UNK,
            "model_max_length": max_model_len,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write(tokenizer_dir / "special_tokens_map.json", {"unk_token": UNK, "eos_token": END})
    words = set(vocabulary.words)
    word_ids = tuple(i for i, p in enumerate(pieces) if p in words)
    return EngineModel(model_dir, tokenizer_dir, word_ids)


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
