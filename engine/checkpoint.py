"""Opens a model by name: a Hugging Face checkpoint directory, or the built-in `tiny`."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.loader import load_model, read_model_config
from engine.model import LlamaModel
from engine.tiny import TINY_CONFIG, TINY_NAME, build_tiny_model, tiny_tokenizer
from engine.tokenizer import HFTokenizer, Tokenizer


def model_config_for(source: str | Path) -> ModelConfig:
    return TINY_CONFIG if str(source) == TINY_NAME else read_model_config(source)


def open_model(
    source: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    *,
    progress: bool = True,
) -> tuple[LlamaModel, Tokenizer]:
    if str(source) == TINY_NAME:
        return build_tiny_model(dtype, device, max_positions), tiny_tokenizer()
    config = read_model_config(source)
    tokenizer = HFTokenizer(source, eos_token_ids=config.eos_token_ids)
    return load_model(source, dtype, device, max_positions, progress=progress), tokenizer


def open_tokenizer(source: str | Path) -> Tokenizer:
    """Just the tokenizer (the router needs no weights)."""
    if str(source) == TINY_NAME:
        return tiny_tokenizer()
    return HFTokenizer(source, eos_token_ids=read_model_config(source).eos_token_ids)
