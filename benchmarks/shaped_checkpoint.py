"""A random-weight Hugging Face checkpoint with a real model's shape: config.json,
model.safetensors and a word-level tokenizer over its whole vocabulary.

For engine measurements where the real file cannot go: a lent GPU machine reaches no package
registry, and what travels to it is size-limited (the default model's GGUF is 98 MB). Speed
depends on the shape, not on the weights' values; exactness is checked elsewhere on
checkpoints built for it (peaked logits, no near-ties).

    python -m benchmarks.shaped_checkpoint smollm2-135m DIRECTORY
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

# Read from the default model's GGUF metadata (engine.named_models: smollm2-135m).
SHAPES = {
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


def save_shaped_checkpoint(directory: str | Path, shape: str, seed: int = 0) -> Path:
    """Write a random model of ``shape`` (a key of SHAPES) into ``directory``; return it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPES[shape])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, config.vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("directory")
    args = parser.parse_args()
    print(save_shaped_checkpoint(args.directory, args.shape))


if __name__ == "__main__":
    main()
