"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) with fused QKV and gate_up weights.

One module serves both phases: a forward over the new tokens of a batch, reading earlier
tokens' K/V from the paged cache and writing the new tokens' K/V into it. Every op goes
through a kernel dispatcher: Triton on CUDA, the plain-torch reference on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention import decode_attention, prefill_attention
from engine.attention_metadata import AttentionMetadata
from engine.config import ModelConfig
from engine.kernels import dispatch
from engine.kernels.fused_cpu import rope_and_store_cpu
from engine.kernels.fused_linear import fused_linear
from engine.kernels.kv_store import store_kv
from engine.kernels.rmsnorm import rmsnorm
from engine.kv_cache import LayerKV, PagedKVCache
from engine.rope import RotaryEmbedding, apply_rotary
from engine.tp_group import TPGroup

if TYPE_CHECKING:
    from engine.kernels.decode_layers_cpu import NativeDecodeLayers

# x [T, in], weight [out, in], bias, activation → [T, out] (or [T, out / 2] for silu_mul)
Linear = Callable[..., torch.Tensor]


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class DecoderLayer(nn.Module):
    """``config`` is the shape this rank computes (engine.tensor_parallel: its heads and MLP
    columns); o and down are row-parallel, their partial sums all-reduced over ``tp``."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        c = config
        self.config = c
        self.tp = tp
        self.input_norm_weight = _param(c.hidden_size)
        self.qkv_weight = _param(c.qkv_size, c.hidden_size)  # rows: q heads, k heads, v heads
        self.qkv_bias = _param(c.qkv_size) if c.qkv_bias else None
        self.o_weight = _param(c.hidden_size, c.q_size)
        self.o_bias = _param(c.hidden_size) if c.o_bias else None
        self.post_attention_norm_weight = _param(c.hidden_size)
        self.gate_up_weight = _param(2 * c.intermediate_size, c.hidden_size)  # gate rows, then up
        self.gate_up_bias = _param(2 * c.intermediate_size) if c.mlp_bias else None
        self.down_weight = _param(c.hidden_size, c.intermediate_size)
        self.down_bias = _param(c.hidden_size) if c.mlp_bias else None
        self.softmax_scale = c.head_dim**-0.5
        self.linear: Linear = fused_linear  # LlamaModel.use_linear swaps the GEMM backend

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, D]
        meta: AttentionMetadata,
        cache: PagedKVCache,
        layer_index: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        eps = c.rms_norm_eps
        if residual is None:
            residual = hidden
            hidden = rmsnorm(hidden, self.input_norm_weight, eps)
        else:
            hidden, residual = rmsnorm(hidden, self.input_norm_weight, eps, residual)
        hidden = self._attention(hidden, rope, meta, cache, layer_index)
        hidden, residual = rmsnorm(hidden, self.post_attention_norm_weight, eps, residual)
        hidden = self.linear(hidden, self.gate_up_weight, self.gate_up_bias, activation="silu_mul")
        hidden = self._row_parallel(hidden, self.down_weight, self.down_bias)
        return hidden, residual

    def _row_parallel(self, x, weight, bias) -> torch.Tensor:
        """x [T, in / tp] @ weight [out, in / tp]ᵀ summed over the ranks (+ bias, added once)."""
        return self.tp.all_reduce(self.linear(x, weight, bias if self.tp.is_driver else None))

    def _attention(self, hidden, rope, meta, cache, layer_index) -> torch.Tensor:
        c = self.config
        tokens = hidden.shape[0]
        qkv = self.linear(hidden, self.qkv_weight, self.qkv_bias)  # [T, qkv_size]
        heads = c.num_heads + c.num_kv_heads
        qk = qkv[:, : c.q_size + c.kv_size].view(tokens, heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size :].view(tokens, c.num_kv_heads, c.head_dim)
        layer = cache.layer(layer_index)
        q, k = self._rotate_and_store(qk, v, rope, layer, meta)
        decode, prefill, nd = meta.decode, meta.prefill, meta.num_decode_tokens
        if decode is not None:
            decoded = decode_attention(q[:nd], layer, decode, self.softmax_scale)  # [Bd, Hq, D]
            if prefill is None:
                return self._row_parallel(
                    decoded.reshape(tokens, c.q_size), self.o_weight, self.o_bias
                )
        prefilled = prefill_attention(
            q[nd:], k[nd:], v[nd:], layer, prefill, self.softmax_scale
        )  # [T - Bd, Hq, D]
        out = prefilled if decode is None else torch.cat([decoded, prefilled])
        return self._row_parallel(out.reshape(tokens, c.q_size), self.o_weight, self.o_bias)

    def _rotate_and_store(self, qk, v, rope, layer: LayerKV, meta) -> tuple[torch.Tensor, ...]:
        """RoPE on q and k, then k and v into the cache; one C call on CPU where it applies
        (a float cache), the same values as the torch ops."""
        c = self.config
        if not dispatch.use_triton(qk):
            fused = rope_and_store_cpu(
                qk, v, *rope, c.num_heads, layer.k, layer.v, meta.slot_mapping
            )
            if fused is not None:
                return fused
        q, k = apply_rotary(qk, *rope).split([c.num_heads, c.num_kv_heads], dim=1)
        store_kv(
            k, v, layer.k, layer.v, layer.k_scale, layer.v_scale, meta.slot_mapping, meta.block_runs
        )
        return q, k


class LlamaModel(nn.Module):
    """Embedding → decoder layers → final norm; ``compute_logits`` applies the LM head.

    Under tensor parallelism ``config`` is this rank's shape (ShardLayout.local_config), and
    only the rank that samples (``has_lm_head``) holds an untied LM head."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        tp: TPGroup | None = None,
        has_lm_head: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = tp or TPGroup.single()
        self.has_lm_head = has_lm_head
        self.embed_weight = _param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, tp) for _ in range(config.num_layers))
        self.norm_weight = _param(config.hidden_size)
        self.lm_head_weight = (
            _param(config.vocab_size, config.hidden_size)
            if has_lm_head and not config.tie_word_embeddings
            else None
        )
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions)
        self.linear: Linear = fused_linear
        self.native_decode: NativeDecodeLayers | None = None

    def use_native_decode(self, native_decode: NativeDecodeLayers | None) -> None:
        """Run the layers of the decode steps ``native_decode`` applies to as one C call
        each (engine.kernels.decode_layers_cpu); None: always op by op."""
        self.native_decode = native_decode

    def use_linear(self, linear: Linear) -> None:
        """Run every GEMM through ``linear`` (same signature as ``fused_linear``), e.g. a
        CPU GEMM plan measured on this machine."""
        self.linear = linear
        for layer in self.layers:
            layer.linear = linear

    def gemm_weights(self) -> list[torch.Tensor]:
        """Every GEMM weight in the order one forward reads them (the LM head last)."""
        weights = [
            w
            for layer in self.layers
            for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)
        ]
        if not self.has_lm_head:
            return weights
        return [*weights, self._lm_head()]

    def silu_mul_weights(self) -> list[torch.Tensor]:
        """The GEMM weights whose output goes through SiLU·mul (each layer's gate_up)."""
        return [layer.gate_up_weight for layer in self.layers]

    def _lm_head(self) -> torch.Tensor:
        if not self.has_lm_head:
            raise RuntimeError("this tensor-parallel rank holds no LM head (rank 0 samples)")
        return self.embed_weight if self.lm_head_weight is None else self.lm_head_weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        cache: PagedKVCache,
        layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """``layer_done(i)`` is called once layer i's K/V are in the cache (the KV sender
        ships that layer while later layers compute)."""
        hidden = nn.functional.embedding(input_ids, self.embed_weight)
        rope = self.rotary.tables(positions, hidden.dtype)
        native = self.native_decode
        if native is not None and native.applies(hidden, meta, cache):
            hidden, residual = native(hidden, rope, meta, cache, layer_done)
        else:
            residual = None
            for index, layer in enumerate(self.layers):
                hidden, residual = layer(hidden, residual, rope, meta, cache, index)
                if layer_done is not None:
                    layer_done(index)
        hidden, _ = rmsnorm(hidden, self.norm_weight, self.config.rms_norm_eps, residual)
        return hidden  # [T, H]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] final hidden states → [n, vocab] fp32 logits."""
        return self.linear(hidden, self._lm_head()).float()
