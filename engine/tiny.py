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


def hf_config_dict() -> dict:
    """The tiny model's config in Hugging Face's config.json form (LlamaForCausalLM)."""
    c = TINY_CONFIG
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope.theta,
        "hidden_act": "silu",
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_ids[0],
        "torch_dtype": "float32",
    }


def save_tiny_checkpoint(directory) -> None:
    """Write the tiny model as a Hugging Face checkpoint (config.json + model.safetensors,
    unfused tensor names) so that transformers can load the very same weights as a baseline."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: t.detach().contiguous().clone() for k, t in tiny_hf_tensors().items()},
        str(directory / "model.safetensors"),
    )
    (directory / "config.json").write_text(json.dumps(hf_config_dict(), indent=2))


def tiny_hf_tensors() -> dict[str, torch.Tensor]:
    """The tiny model's weights (fp32, CPU) under Hugging Face's unfused names."""
    model = build_tiny_model(
        torch.float32, torch.device("cpu"), TINY_CONFIG.max_position_embeddings
    )
    c = TINY_CONFIG
    tensors = {
        "model.embed_tokens.weight": model.embed_weight,
        "model.norm.weight": model.norm_weight,
    }
    if model.lm_head_weight is not None:
        tensors["lm_head.weight"] = model.lm_head_weight
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        q, k, v = layer.qkv_weight.split([c.q_size, c.kv_size, c.kv_size])
        gate, up = layer.gate_up_weight.split([c.intermediate_size, c.intermediate_size])
        tensors.update(
            {
                prefix + "self_attn.q_proj.weight": q,
                prefix + "self_attn.k_proj.weight": k,
                prefix + "self_attn.v_proj.weight": v,
                prefix + "self_attn.o_proj.weight": layer.o_weight,
                prefix + "mlp.gate_proj.weight": gate,
                prefix + "mlp.up_proj.weight": up,
                prefix + "mlp.down_proj.weight": layer.down_weight,
                prefix + "input_layernorm.weight": layer.input_norm_weight,
                prefix + "post_attention_layernorm.weight": layer.post_attention_norm_weight,
            }
        )
    return tensors
