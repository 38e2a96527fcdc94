"""A GGUF file (llama.cpp's format): metadata, model config and tensors dequantised to fp32
(the header read by engine.gguf_header, the dequantisation by the `gguf` library).

llama.cpp names tensors its own way (``blk.3.attn_q.weight``) and, for the llama and mistral
architectures, stores Q and K rows permuted for its interleaved rotary layout; ``hf_tensors``
yields them under Hugging Face names in Hugging Face's row order, so the checkpoint loader
treats a GGUF like any other checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import ModelConfig
from engine.errors import CheckpointError, UnsupportedModelError
from engine.gguf_header import GGUFFormatError, read_header
from engine.kernels import quantized_cpu
from engine.kernels.quantized_cpu import KINDS, QuantizedWeight

# GGUF architecture → the Hugging Face architecture the engine implements for it.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# llama.cpp's converter permutes Q/K rows for these (HF's rotate-half → its interleaved rope).
_PERMUTED_QK = {"llama", "mistral"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class GGUFFile:
    """An opened GGUF file. Construction reads the header and metadata (the tensor data stays
    memory-mapped); raises CheckpointError for a missing, truncated or malformed file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"GGUF file {self.path} does not exist")
        try:
            header = read_header(self.path)
        except GGUFFormatError as err:
            raise CheckpointError(
                f"{self.path} is not a readable GGUF file (truncated or corrupt): {err}"
            ) from None
        self.metadata: dict[str, Any] = header.metadata
        self._tensors = header.tensors

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} in {self.path.name} is not supported "
                f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
            )
        return arch

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def model_config(self) -> ModelConfig:
        """The model's shape from the metadata, as a config.json would state it."""
        arch = self.architecture
        meta = self.metadata

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise CheckpointError(f"{self.path.name} lacks metadata key {arch}.{name}")
            return value

        if "rope_freqs.weight" in self._tensors:
            raise UnsupportedModelError(
                f"{self.path.name} has per-frequency rope factors (rope_freqs.weight, Llama 3.1 "
                "rope scaling as llama.cpp stores it); only plain, linear and config-stated "
                "rope scaling are supported for GGUF files"
            )
        heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        hf: dict[str, Any] = {
            "architectures": [GGUF_ARCHITECTURES[arch]],
            "vocab_size": int(
                meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
            ),
            "hidden_size": hidden,
            "intermediate_size": int(key("feed_forward_length")),
            "num_hidden_layers": int(key("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(key("attention.head_count_kv", heads)),
            "head_dim": int(key("attention.key_length", hidden // heads)),
            "max_position_embeddings": int(key("context_length")),
            "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(key("rope.freq_base", 10000.0)),
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "mlp_bias": "blk.0.ffn_down.bias" in self._tensors,
        }
        scaling = meta.get(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            hf["rope_scaling"] = {
                "rope_type": scaling,
                "factor": float(key("rope.scaling.factor")),
            }
        if arch == "mistral" and meta.get("mistral.attention.sliding_window"):
            hf["sliding_window"] = int(meta["mistral.attention.sliding_window"])
        rope_dims = meta.get(f"{arch}.rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != hf["head_dim"]:
            raise UnsupportedModelError(
                f"{self.path.name} applies rope to {rope_dims} of {hf['head_dim']} head "
                "dimensions; partial rotary embeddings are not supported"
            )
        return ModelConfig.from_hf_dict(hf)

    def hf_tensors(self, config: ModelConfig) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
        """(Hugging Face name, getter of the fp32 tensor in HF layout) for every tensor."""
        for name in self._tensors:
            yield _hf_name(name), lambda name=name: self._hf_tensor(name, config)

    def _hf_tensor(self, name: str, config: ModelConfig) -> torch.Tensor:
        tensor = self.dequantized(name)
        if self.architecture in _PERMUTED_QK:
            if name.startswith("blk.") and ".attn_q." in name:
                return _unpermute_rows(tensor, config.num_heads)
            if name.startswith("blk.") and ".attn_k." in name:
                return _unpermute_rows(tensor, config.num_kv_heads)
        return tensor

    def quantized(self, name: str, config: ModelConfig) -> QuantizedWeight | None:
        """One 2-D tensor as its blocks, rows in Hugging Face order (Q/K unpermuted), for the
        block types the quantised GEMM takes (engine.kernels.quantized_cpu.KINDS); None for
        any other type."""
        weight = self._blocks(name)
        if weight is None:
            return None
        blocks = weight.blocks
        if self.architecture in _PERMUTED_QK and name.startswith("blk."):
            if ".attn_q." in name:
                blocks = _unpermute_rows(blocks, config.num_heads)
            elif ".attn_k." in name:
                blocks = _unpermute_rows(blocks, config.num_kv_heads)
        return QuantizedWeight(weight.kind, blocks.contiguous(), weight.in_features)

    def _blocks(self, name: str) -> QuantizedWeight | None:
        """A 2-D tensor of a block type in KINDS as its blocks, rows as stored; else None."""
        from gguf import GGMLQuantizationType

        tensor = self._tensors[name]
        kind = GGMLQuantizationType(tensor.ggml_type).name
        if kind not in KINDS or len(tensor.dims) != 2:
            return None
        # a copy: the memory map is read-only, and the blocks outlive this reader
        blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, order="C"))
        return QuantizedWeight(kind, blocks.reshape(tensor.dims[1], -1), tensor.dims[0])

    def dequantized(self, name: str) -> torch.Tensor:
        """One tensor as fp32, in torch's (rows, columns) order: the block types the C kernels
        take through them (the same values, on every thread: gguf's numpy dequantiser took
        2.5 s of the default model's 5 s load), any other through the gguf library."""
        from gguf import GGMLQuantizationType, quants

        weight = self._blocks(name)
        values = None if weight is None else quantized_cpu.dequantize(weight)
        if values is not None:
            return values
        tensor = self._tensors[name]
        kind = GGMLQuantizationType(tensor.ggml_type)
        try:
            values = quants.dequantize(tensor.data, kind)
        except NotImplementedError:
            raise UnsupportedModelError(
                f"tensor {name} of {self.path.name} is stored as {kind.name}, which the gguf "
                "library cannot dequantise"
            ) from None
        shape = tuple(reversed(tensor.dims))
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        if not values.flags.writeable:  # a view of the read-only memory map (F32 tensors)
            values = values.copy()
        return torch.from_numpy(values)


def _hf_name(name: str) -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = _BLOCK_TENSOR.match(name)
    if match is None or match.group(2) not in _BLOCK_TENSORS:
        raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_TENSORS[part]}.{kind}"


def _unpermute_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation: within each head, its rows went from rotate-half order
    (first halves, then second halves) to interleaved pairs."""
    rows = tensor.shape[0]
    rest = tensor.shape[1:]
    return (
        tensor.reshape(num_heads, rows // num_heads // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(rows, *rest)
        .contiguous()
    )
