"""The model's GEMM weights paired with their GGUF blocks, for the quantised CPU GEMM
(engine.kernels.quantized_cpu): a GGUF model keeps its dense fp32 weights (prefill's
compute-bound GEMMs run on them) and, beside each, the blocks a decode step reads instead.

A pairing holds only where the blocks dequantise to exactly the dense weight, checked here
for every weight: a fused weight whose parts differ in block type, a type the kernel does not
take (the K-quants), or any mismatch leaves that weight dense.
"""

from __future__ import annotations

import logging

import torch

from engine.gguf_file import GGUFFile
from engine.kernels.quantized_cpu import QuantizedWeight, dequantize, stack_rows
from engine.model import LlamaModel

logger = logging.getLogger(__name__)


def gguf_gemm_blocks(
    gguf: GGUFFile, model: LlamaModel
) -> list[tuple[torch.Tensor, QuantizedWeight]]:
    """(dense weight, its blocks) for each of ``model.gemm_weights()`` that has them; the
    model must be the whole (not tensor-parallel) fp32 model of ``gguf``."""
    config = gguf.model_config()
    names = set(gguf.tensor_names)
    wanted: list[tuple[torch.Tensor, list[str]]] = []
    for i, layer in enumerate(model.layers):
        blk = f"blk.{i}."
        wanted += [
            (
                layer.qkv_weight,
                [blk + "attn_q.weight", blk + "attn_k.weight", blk + "attn_v.weight"],
            ),
            (layer.o_weight, [blk + "attn_output.weight"]),
            (layer.gate_up_weight, [blk + "ffn_gate.weight", blk + "ffn_up.weight"]),
            (layer.down_weight, [blk + "ffn_down.weight"]),
        ]
    if model.has_lm_head:
        head = "output.weight" if "output.weight" in names else "token_embd.weight"
        wanted.append((model._lm_head(), [head]))
    pairs, dense = [], []
    for weight, parts in wanted:
        blocks = _blocks(gguf, config, parts)
        if blocks is not None and _same_values(blocks, weight):
            pairs.append((weight, blocks))
        else:
            dense.append(parts[0])
    if dense:
        logger.info(
            "%d of %d GEMM weights stay dense (block types the quantised GEMM does not take): %s",
            len(dense), len(wanted), ", ".join(dense[:4]) + (" ..." if len(dense) > 4 else ""),
        )  # fmt: skip
    return pairs


def _blocks(gguf: GGUFFile, config, parts: list[str]) -> QuantizedWeight | None:
    if not all(name in gguf.tensor_names for name in parts):
        return None
    pieces = [gguf.quantized(name, config) for name in parts]
    if any(piece is None for piece in pieces):
        return None
    if len({(p.kind, p.in_features) for p in pieces}) != 1:
        return None  # e.g. V in Q6_K beside Q4_K Q and K
    return pieces[0] if len(pieces) == 1 else stack_rows(pieces)


def _same_values(blocks: QuantizedWeight, weight: torch.Tensor) -> bool:
    if weight.dtype != torch.float32 or weight.shape != (blocks.out_features, blocks.in_features):
        return False
    values = dequantize(blocks)
    if values is None:  # no C library: the kernel would not run either
        return False
    if torch.equal(values, weight):
        return True
    logger.warning(
        "GGUF blocks of shape %s do not dequantise to the loaded weight; it stays dense",
        tuple(weight.shape),
    )
    return False
