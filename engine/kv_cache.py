"""Paged KV cache storage: fixed-size blocks of K and V for every layer.

Layout per layer: K and V are [num_blocks, block_size, num_kv_heads, head_dim]. A token at
absolute position p of a sequence lives in block ``block_table[p // block_size]``, row
``p % block_size``. FP8 (e4m3) caches carry one fp32 scale per (block, kv head) for K and for
V ([num_layers, num_blocks, num_kv_heads]); dequantised value = fp8 value × scale.
Which blocks belong to whom is the BlockManager's business, not this class's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig


@dataclass(frozen=True)
class LayerKV:
    """One layer's view of the cache, as the attention kernels take it."""

    k: torch.Tensor  # [N, bs, Hkv, D]
    v: torch.Tensor  # [N, bs, Hkv, D]
    k_scale: torch.Tensor | None  # [N, Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None


class PagedKVCache:
    """Preallocated K/V blocks (and FP8 scales) for all layers of one model replica."""

    def __init__(
        self,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = model.num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = model.num_kv_heads
        self.head_dim = model.head_dim
        self.dtype = dtype
        self.device = device
        shape = (model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        if self.is_fp8:
            scale_shape = (model.num_layers, num_blocks, model.num_kv_heads)
            self.k_scale = torch.ones(scale_shape, dtype=torch.float32, device=device)
            self.v_scale = torch.ones(scale_shape, dtype=torch.float32, device=device)
        else:
            self.k_scale = self.v_scale = None

    @property
    def is_fp8(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    def layer(self, index: int) -> LayerKV:
        return LayerKV(
            k=self.k[index],
            v=self.v[index],
            k_scale=None if self.k_scale is None else self.k_scale[index],
            v_scale=None if self.v_scale is None else self.v_scale[index],
        )

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block, every layer's K, V and scales."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for tensor in (self.k, self.v, self.k_scale, self.v_scale):
            if tensor is not None:
                tensor[:, dst] = tensor[:, src]

    def bytes_per_block(self) -> int:
        """Bytes one block occupies across all layers, K and V, scales included."""
        element = self.k.element_size()
        payload = (
            2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element
        )
        scales = 2 * self.num_layers * self.num_kv_heads * 4 if self.is_fp8 else 0
        return payload + scales
