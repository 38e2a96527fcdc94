"""The built-in `tiny` model: Llama-shaped with GQA, a byte-level tokenizer, RANDOM weights.

Built in memory from a fixed seed, no download. Its output is meaningless text; it exists so
that the serving system can be started, tested and benchmarked anywhere.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig, RopeConfig
from engine.model import LlamaModel
from engine.tokenizer import ByteTokenizer

TINY_NAME = "tiny"
TINY_NOTE = "model 'tiny' has random weights: its output is meaningless by design"
TINY_SEED = 1234

TINY_CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=320,
    hidden_size=256,
    intermediate_size=512,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope=RopeConfig(theta=10000.0),
    tie_word_embeddings=False,
    bos_token_id=ByteTokenizer.BOS,
    eos_token_ids=(ByteTokenizer.EOS,),
)


def build_tiny_model(dtype: torch.dtype, device: torch.device, max_positions: int) -> LlamaModel:
    """The tiny model with weights drawn from a fixed seed (same on every machine)."""
    generator = torch.Generator().manual_seed(TINY_SEED)
    model = LlamaModel(TINY_CONFIG, max_positions)
    for name, param in sorted(model.named_parameters()):
        if "norm" in name:
            values = torch.ones(param.shape)
        else:
            values = torch.randn(param.shape, generator=generator) * 0.05
            if name == "embed_weight":
                values = values * 20  # unit-scale embeddings, as trained models have
        param.data = values
    model = model.to(device=device, dtype=dtype)
    model.rotary.float()
    return model.eval()


def tiny_tokenizer() -> ByteTokenizer:
    return ByteTokenizer(vocab_size=TINY_CONFIG.vocab_size)
