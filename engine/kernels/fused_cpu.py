"""One C call (``fused_cpu.c``) where the CPU path runs a chain of small torch ops whose
cost is their count, not their arithmetic: RoPE with the KV store, RMSNorm with its
residual add, and SiLU-and-mul. Each returns None where it does not apply (no C compiler,
an fp8 cache, a layout it does not take), and the caller keeps the torch path."""

from __future__ import annotations

import torch

from engine.kernels import cpu_native

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rope_and_store_cpu(
    qk: torch.Tensor,  # [T, Hq + Hkv, D]: q heads, then k heads
    v: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, 1, D] (engine.rope tables)
    signed_sin: torch.Tensor,
    num_q_heads: int,
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, negative: not stored
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RoPE on q and k (``engine.rope.apply_rotary``'s result bit for bit), k and v then
    stored at their slots (``kv_store.store_kv_cpu``'s writes); returns (q, k) rotated."""
    lib = cpu_native.library()
    dtype = qk.dtype
    tokens, heads, head_dim = qk.shape
    num_kv_heads = heads - num_q_heads
    if (
        lib is None
        or dtype not in _FUSED_DTYPES
        or qk.device.type != "cpu"
        or k_cache.dtype != dtype
        or v_cache.dtype != dtype
        or v.dtype != dtype
        or cos.dtype != dtype
        or signed_sin.dtype != dtype
        or head_dim % 2
        or qk.stride(2) != 1
        or qk.stride(1) != head_dim
        or v.stride(2) != 1
        or v.stride(1) != head_dim
        or not (cos.is_contiguous() and signed_sin.is_contiguous())
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or slot_mapping.dtype != torch.int64
    ):
        return None
    if v.shape != (tokens, num_kv_heads, head_dim) or cos.shape != (tokens, 1, head_dim):
        raise ValueError(
            f"rope_and_store: qk {tuple(qk.shape)} with {num_q_heads} q heads, v "
            f"{tuple(v.shape)}, tables {tuple(cos.shape)} do not agree"
        )
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or slot_mapping.shape != (tokens,):
        raise ValueError(
            f"rope_and_store: cache {tuple(k_cache.shape)} or slots {tuple(slot_mapping.shape)} "
            f"do not fit {tokens} tokens of {num_kv_heads} x {head_dim}"
        )
    slots = slot_mapping.contiguous()
    check_slots(slots, k_cache.shape[0] * k_cache.shape[1])
    q = torch.empty((tokens, num_q_heads, head_dim), dtype=dtype)
    k = torch.empty((tokens, num_kv_heads, head_dim), dtype=dtype)
    lib.rope_and_store(
        qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0),
        cos.data_ptr(), signed_sin.data_ptr(), tokens, num_q_heads, num_kv_heads, head_dim,
        cpu_native.C_DTYPES[dtype], q.data_ptr(), k.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slots.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return q, k


def check_slots(slots: torch.Tensor, capacity: int) -> None:
    """The C store trusts its slots: none may be past the cache's ``capacity`` rows."""
    if slots.numel() and int(slots.max()) >= capacity:
        raise ValueError(f"a slot past the cache's {capacity} rows: {int(slots.max())}")


def rmsnorm_native(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H], x's dtype
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """``rmsnorm.rmsnorm_reference``'s rounding points in one pass per row; its mean sums
    in another order than torch's reduction, so a value may round the other way."""
    lib = cpu_native.library()
    if (
        lib is None
        or x.dim() != 2
        or x.dtype not in _FUSED_DTYPES
        or x.device.type != "cpu"
        or weight.dtype != x.dtype
        or weight.shape != (x.shape[1],)
        or not weight.is_contiguous()
        or x.stride(1) != 1
        or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))
        or (residual is not None and residual.stride(1) != 1)
    ):
        return None
    tokens, hidden = x.shape
    out = torch.empty((tokens, hidden), dtype=x.dtype)
    summed = torch.empty((tokens, hidden), dtype=x.dtype) if residual is not None else None
    lib.rmsnorm_rows(
        x.data_ptr(), x.stride(0),
        residual.data_ptr() if residual is not None else None,
        residual.stride(0) if residual is not None else 0,
        weight.data_ptr(), tokens, hidden, eps, cpu_native.C_DTYPES[x.dtype], out.data_ptr(),
        summed.data_ptr() if summed is not None else None, torch.get_num_threads(),
    )  # fmt: skip
    return (out, summed) if residual is not None else out


def silu_mul_native(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu_mul.silu_mul_reference`` ([T, 2I] -> [T, I]) for 16-bit dtypes, where its
    rounding points decide the result; its exp is not torch's, so a value may round the
    other way. None for fp32 (torch's op is kept, for the exactness tests) and what it does
    not take."""
    lib = cpu_native.library()
    if (
        lib is None
        or gate_up.dim() != 2
        or gate_up.dtype not in (torch.bfloat16, torch.float16)
        or gate_up.device.type != "cpu"
        or gate_up.stride(1) != 1
        or gate_up.shape[1] % 2
    ):
        return None
    tokens, two_i = gate_up.shape
    out = torch.empty((tokens, two_i // 2), dtype=gate_up.dtype)
    lib.silu_mul_rows(
        gate_up.data_ptr(), gate_up.stride(0), tokens, two_i // 2, cpu_native.C_DTYPES[gate_up.dtype],
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out
