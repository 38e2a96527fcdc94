"""Tiny random Hugging Face checkpoints, written with transformers' save_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _base_kwargs() -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        # Large init so logits are peaked: greedy decoding then has no near-ties that a
        # last-bit difference could flip.
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )


def make_config(kind: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    kwargs = {**_base_kwargs(), **overrides}
    if kind == "llama":
        return LlamaConfig(**kwargs)
    if kind == "llama3":
        kwargs.setdefault(
            "rope_scaling",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        kwargs.setdefault("rope_theta", 500000.0)
        return LlamaConfig(**kwargs)
    if kind == "llama_linear":
        kwargs.setdefault("rope_scaling", {"rope_type": "linear", "factor": 2.0})
        return LlamaConfig(**kwargs)
    if kind == "qwen2":
        kwargs.setdefault("tie_word_embeddings", True)
        return Qwen2Config(**kwargs)
    if kind == "mistral":
        kwargs.setdefault("sliding_window", None)
        return MistralConfig(**kwargs)
    raise ValueError(kind)


def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over 256 ids: 'w0'..'w252' plus specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, VOCAB):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )


def save_tokenizer_with_transformers(directory: Path) -> None:
    """The same word-level tokenizer, saved as transformers 5 saves one: the chat template
    in chat_template.jinja, none in tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def make_checkpoint(
    directory: Path, kind: str, seed: int = 0, max_shard_size: str | None = None, **overrides
):
    """Save a random-initialised model of ``kind`` into ``directory``; return the HF model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = make_config(kind, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    write_tokenizer(directory)
    return model
