"""Rotary position embeddings (RoPE), with 'linear' and 'llama3' frequency scaling.

Computed exactly as Hugging Face transformers does (fp32 inverse frequencies, fp32
position × frequency products, cos/sin cast to the activation dtype, rotate-half layout), so
that the engine matches it to the last bit in fp32.
"""

from __future__ import annotations

import math

import torch

from engine.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies after the configured scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling_type == "linear":
        return inv_freq / rope.factor
    if rope.scaling_type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to q and k given each token's absolute position.

    Holds [max_positions, head_dim] cos and sign-folded sin tables built once at start-up.
    HF rotates ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``; the
    same products come from swapping x's halves and negating the first half of sin instead
    (``(-a) * b == a * (-b)`` exactly), which takes three ops instead of seven.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(rope, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        sign = torch.cat((-torch.ones(head_dim // 2), torch.ones(head_dim // 2)))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("signed_sin", angles.sin() * sign, persistent=False)
        self.head_dim = head_dim

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, 1, D] for these positions in ``dtype``: looked up once per
        forward, shared by every layer."""
        return (
            self.cos[positions].to(dtype)[:, None, :],
            self.signed_sin[positions].to(dtype)[:, None, :],
        )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [T, H, D] (q and k heads together) with tables [T, 1, D]: a new tensor."""
    tokens, heads, dim = x.shape
    swapped = x.unflatten(-1, (2, dim // 2)).flip(-2).flatten(-2)  # cat(x2, x1), a copy
    # Not addcmul: its fused multiply-add rounds once, HF's mul then add rounds twice.
    return swapped.mul_(signed_sin).add_(x * cos)
