"""Paged KV cache storage: fixed-size blocks of K and V for every layer.

Layout per layer: K and V are [num_blocks, block_size, num_kv_heads, head_dim]. A token at
absolute position p of a sequence lives in block ``block_table[p // block_size]``, row
``p % block_size``. FP8 (e4m3) caches carry one fp32 scale per (block, kv head) for K and for
V ([num_layers, num_blocks, num_kv_heads]); dequantised value = fp8 value × scale.
Which blocks belong to whom is the BlockManager's business, not this class's.
"""

from __future__ import annotations

from collections.abc import Sequence
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

    def gather(self, layer: int, block_ids: torch.Tensor) -> LayerKV:
        """Copies of cache blocks ``block_ids`` (int64, on this device) of one layer, in that
        order: [n, bs, Hkv, D] (scales [n, Hkv])."""

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[layer].index_select(0, block_ids)

        return LayerKV(take(self.k), take(self.v), take(self.k_scale), take(self.v_scale))

    def gather_layers(self, first_layer: int, layer_count: int, block_ids: torch.Tensor) -> LayerKV:
        """``gather`` of layers ``[first_layer, first_layer + layer_count)`` at once, each
        tensor with a leading layer axis: [L, n, bs, Hkv, D] (scales [L, n, Hkv])."""
        layers = slice(first_layer, first_layer + layer_count)

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[layers].index_select(1, block_ids)

        return LayerKV(take(self.k), take(self.v), take(self.k_scale), take(self.v_scale))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a block has a row in, in payload order: K, V, then (fp8) their scales."""
        parts = [self.k, self.v]
        if self.is_fp8:
            parts += [self.k_scale, self.v_scale]
        return parts

    def payload_views(self, layer: int, block_ids: Sequence[int]) -> list:
        """The bytes of cache blocks ``block_ids`` of one layer in payload order (K, V, then
        fp8 scales; one numpy uint8 view per run of consecutive blocks), to read or write
        in place. CPU caches only."""
        runs = block_runs(block_ids)
        views = []
        for tensor in self.tensors():
            rows = byte_rows(tensor[layer])
            views += [rows[first : first + n] for first, _, n in runs]
        return views

    def scatter(
        self,
        layer: int,
        block_ids: Sequence[int] | torch.Tensor,
        blocks: LayerKV,
        heads: slice | None = None,
    ) -> None:
        """Write ``blocks`` ([n, ...], in order; scales when the cache is fp8) into cache
        blocks ``block_ids`` of one layer; ``heads``: into those of the cache's KV heads
        only (``blocks`` then hold just them). CPU caches take the ids as a list, other
        devices as an int64 tensor on the device."""
        sources = (blocks.k, blocks.v, blocks.k_scale, blocks.v_scale)
        if heads is not None and heads != slice(0, self.num_kv_heads):
            self._scatter_heads(layer, block_ids, sources, heads)
            return
        pairs = [(t[layer], src) for t, src in zip(self.tensors(), sources, strict=False)]
        if self.device.type == "cpu":
            # numpy slice copies per run of consecutive blocks: plain memcpys on the calling
            # thread with the GIL released (torch's own copies fan out to its intra-op pool,
            # which on a busy host is many times slower than one thread).
            ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else block_ids
            runs = block_runs(ids)
            for dst, src in pairs:
                dst_rows, src_rows = byte_rows(dst), byte_rows(src)
                for first, offset, n in runs:
                    dst_rows[first : first + n] = src_rows[offset : offset + n]
            return
        # index_put_ on [blocks, row] views: one vectorised scatter of whole blocks
        # (index_copy_ has no fp8 kernels), moving 8-byte words where rows allow (the cost
        # is per element, the bytes are the same).
        for dst, src in pairs:
            _word_rows(dst).index_put_((block_ids,), _word_rows(src))

    def scatter_layers(
        self,
        layers: range,
        block_ids: Sequence[int] | torch.Tensor,
        blocks: LayerKV,
        heads: slice | None = None,
    ) -> None:
        """``scatter`` into the same blocks of consecutive ``layers``: ``blocks`` with a
        leading layer axis ([L, n, ...]). On CPU, for all the heads, one strided numpy copy
        per tensor and run of consecutive blocks covers every layer."""
        sources = (blocks.k, blocks.v, blocks.k_scale, blocks.v_scale)
        all_heads = heads is None or heads == slice(0, self.num_kv_heads)
        if self.device.type != "cpu" or not all_heads or layers.step != 1:
            for i, layer in enumerate(layers):
                layer_blocks = LayerKV(*(None if t is None else t[i] for t in sources))
                self.scatter(layer, block_ids, layer_blocks, heads)
            return
        ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else block_ids
        runs = block_runs(ids)
        for tensor, src in zip(self.tensors(), sources, strict=False):
            dst_rows, src_rows = (
                layer_byte_rows(tensor[layers.start : layers.stop]),
                layer_byte_rows(src),
            )
            for first, offset, n in runs:
                dst_rows[:, first : first + n] = src_rows[:, offset : offset + n]

    def _scatter_heads(self, layer: int, block_ids, sources, heads: slice) -> None:
        """Some KV heads of whole blocks: strided copies (a tensor-parallel peer's share)."""
        for tensor, src in zip(self.tensors(), sources, strict=False):
            dst = tensor[layer]
            if self.device.type == "cpu":
                ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else block_ids
                for first, offset, n in block_runs(ids):
                    view = dst[first : first + n]
                    target = view[:, :, heads] if view.dim() == 4 else view[:, heads]
                    target.copy_(src[offset : offset + n])
            elif dst.dim() == 4:  # K or V [N, bs, Hkv, D]
                dst[block_ids, :, heads] = src
            else:  # scales [N, Hkv]
                dst[block_ids, heads] = src

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block, every layer's K, V and scales."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for tensor in self.tensors():
            tensor[:, dst] = tensor[:, src]

    def bytes_per_block(self) -> int:
        """Bytes one block occupies across all layers, K and V, scales included."""
        element = self.k.element_size()
        payload = (
            2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element
        )
        scales = 2 * self.num_layers * self.num_kv_heads * 4 if self.is_fp8 else 0
        return payload + scales


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``block_ids`` as runs of consecutive cache blocks: (first block, first index, length)."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(block_ids):
        if runs and runs[-1][0] + runs[-1][2] == block:
            first, src, n = runs[-1]
            runs[-1] = (first, src, n + 1)
        else:
            runs.append((block, i, 1))
    return runs


def byte_rows(t: torch.Tensor):
    """A contiguous CPU tensor [blocks, ...] as a numpy uint8 array [blocks, bytes] (a view)."""
    return t.reshape(t.shape[0], -1).view(torch.uint8).numpy()


def layer_byte_rows(t: torch.Tensor):
    """A CPU tensor [layers, blocks, ...] (each layer's blocks contiguous) as a numpy uint8
    array [layers, blocks, bytes] (a view)."""
    return t.reshape(t.shape[0], t.shape[1], -1).view(torch.uint8).numpy()


def _word_rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(t.shape[0], -1).view(torch.uint8)
    return rows.view(torch.int64) if rows.shape[1] % 8 == 0 else rows
