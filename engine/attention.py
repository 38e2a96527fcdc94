"""The model's two attention calls, each routed to the kernel for the device: Triton on CUDA,
the SDPA-based CPU path otherwise (``PDCLUSTER_FORCE_TRITON=1`` with the interpreter runs
the Triton kernels on CPU tensors, for tests)."""

from __future__ import annotations

import torch

from engine.attention_metadata import DecodeMetadata, PrefillMetadata
from engine.kernels import dispatch
from engine.kernels.cpu_attention import decode_attention_cpu, prefill_attention_cpu
from engine.kernels.decode_attention import decode_attention_triton
from engine.kernels.prefill_attention import prefill_attention_triton
from engine.kv_cache import LayerKV


def decode_attention(
    q: torch.Tensor, layer: LayerKV, meta: DecodeMetadata, softmax_scale: float
) -> torch.Tensor:
    """q [B, Hq, D] (one token per sequence) over its cached context → [B, Hq, D]."""
    if dispatch.use_triton(q) or meta.cpu is None:
        return decode_attention_triton(
            q,
            layer.k,
            layer.v,
            layer.k_scale,
            layer.v_scale,
            meta.block_tables,
            meta.context_lens,
            softmax_scale,
            max_context_len=meta.max_context_len,
        )
    return decode_attention_cpu(
        q, layer.k, layer.v, layer.k_scale, layer.v_scale, meta.cpu, softmax_scale
    )


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: LayerKV,
    meta: PrefillMetadata,
    softmax_scale: float,
) -> torch.Tensor:
    """New tokens q [T, Hq, D] (k, v [T, Hkv, D]) over cached prefix + themselves, causal."""
    if dispatch.use_triton(q) or meta.cpu is None:
        return prefill_attention_triton(
            q,
            k,
            v,
            meta.cu_seqlens,
            meta.prefix_lens,
            layer.k,
            layer.v,
            layer.k_scale,
            layer.v_scale,
            meta.block_tables,
            softmax_scale,
            meta.max_new_len,
        )
    return prefill_attention_cpu(
        q, k, v, layer.k, layer.v, layer.k_scale, layer.v_scale, meta.cpu, softmax_scale
    )
