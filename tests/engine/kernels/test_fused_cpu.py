"""The fused C steps (engine/kernels/fused_cpu.c) against their torch versions: RoPE with
the KV store bit for bit, RMSNorm with its residual add and SiLU-and-mul to the last
rounding."""

import numpy as np
import pytest
import torch

from engine import cpu_isa
from engine.config import RopeConfig
from engine.kernels import cpu_native
from engine.kernels.fused_cpu import rmsnorm_native, rope_and_store_cpu, silu_mul_native
from engine.kernels.kv_store import store_kv_cpu
from engine.kernels.rmsnorm import rmsnorm_reference
from engine.kernels.silu_mul import silu_mul_reference
from engine.rope import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(
    cpu_native.library() is None, reason=f"{cpu_isa.why_missing('none')}: these steps run in torch"
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rope_case(dtype, tokens=5, hq=9, hkv=3, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype)
    qk = qkv[:, : (hq + hkv) * d].view(tokens, hq + hkv, d)  # strided, as the model's
    v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), d, max_positions=4096)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    cos, sin = rope.tables(positions, dtype)
    cache = torch.full((8, 16, hkv, d), float("nan"), dtype=dtype)
    slots = torch.randperm(8 * 16, generator=g)[:tokens]
    return qk, v, cos, sin, hq, cache, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 48])  # half heads of whole 16-lane vectors, and not
def test_rope_and_store_is_the_torch_path_bit_for_bit(dtype, d):
    qk, v, cos, sin, hq, cache, slots = _rope_case(dtype, d=d)
    k_cache, v_cache = cache.clone(), cache.clone()
    q, k = rope_and_store_cpu(qk, v, cos, sin, hq, k_cache, v_cache, slots)
    q_ref, k_ref = apply_rotary(qk, cos, sin).split([hq, qk.shape[1] - hq], dim=1)
    k_ref_cache, v_ref_cache = cache.clone(), cache.clone()
    store_kv_cpu(k_ref, v, k_ref_cache, v_ref_cache, slots)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    # every untouched row is still NaN, and the stored ones are equal
    assert torch.equal(k_cache.isnan(), k_ref_cache.isnan())
    assert torch.equal(k_cache.nan_to_num(0), k_ref_cache.nan_to_num(0))
    assert torch.equal(v_cache.nan_to_num(0), v_ref_cache.nan_to_num(0))


def test_rope_and_store_skips_negative_slots_and_refuses_what_it_cannot_take():
    qk, v, cos, sin, hq, cache, slots = _rope_case(torch.float32, tokens=3)
    k_cache, v_cache = cache.clone(), cache.clone()
    slots[1] = -1  # padding
    rope_and_store_cpu(qk, v, cos, sin, hq, k_cache, v_cache, slots)
    assert int((~k_cache.isnan()).any(dim=(2, 3)).sum()) == 2
    fp8 = torch.zeros(8, 16, 3, 64, dtype=torch.float8_e4m3fn)
    assert rope_and_store_cpu(qk, v, cos, sin, hq, fp8, fp8, slots) is None  # torch path
    with pytest.raises(ValueError, match="slot past"):
        rope_and_store_cpu(qk, v, cos, sin, hq, k_cache, v_cache, torch.tensor([0, 1, 8 * 16]))
    with pytest.raises(ValueError, match="do not agree"):
        rope_and_store_cpu(qk, v[:, :2], cos, sin, hq, k_cache, v_cache, slots)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_the_reference(dtype, with_residual):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(33, 576, generator=g) * 4).to(dtype)
    weight = torch.randn(576, generator=g).to(dtype)
    residual = torch.randn(33, 576, generator=g).to(dtype) if with_residual else None
    got = rmsnorm_native(x, weight, 1e-5, residual)
    want = rmsnorm_reference(x, weight, 1e-5, residual)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the sum is rounded as torch rounds it
        got, want = got[0], want[0]
    # The mean sums in another order: at most one rounding step of the dtype apart, and in
    # 16 bits (the dtypes the engine uses it for) the same value almost everywhere.
    ulp = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=ulp)
    if dtype != torch.float32:
        assert (got != want).float().mean() < 0.01


def _rmsnorm_c_order(x, weight, eps, residual):
    """fused_cpu.c's RMSNorm in its own order of fp32 operations, row by row: the sum of
    squares in 16 lanes (lane l over columns l, l + 16, ...), the lanes added in order, the
    columns past the last whole 16 added after them; so the exact bits it must give."""
    h = x.float() if residual is None else (residual.float() + x.float()).bfloat16().float()
    out = torch.empty_like(x)
    H = x.shape[1]
    whole = H // 16 * 16
    for t in range(x.shape[0]):
        lanes = torch.zeros(16)
        for i in range(0, whole, 16):
            lanes = lanes + h[t, i : i + 16] * h[t, i : i + 16]
        total = np.float32(0.0)
        for value in [*lanes.numpy(), *(h[t, whole:] * h[t, whole:]).numpy()]:
            total = np.float32(total + value)
        rstd = np.float32(1.0) / np.sqrt(np.float32(total / np.float32(H) + np.float32(eps)))
        normed = (h[t] * float(rstd)).bfloat16().float()
        out[t] = (weight.float() * normed).bfloat16()
    return out


@pytest.mark.parametrize("hidden", [576, 584])  # whole 16-lane vectors, and a tail
@pytest.mark.parametrize("with_residual", [False, True])
def test_bf16_rmsnorm_sums_in_its_stated_order(hidden, with_residual):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(9, hidden, generator=g) * 4).bfloat16()
    x[0, :4] = torch.tensor([1e-39, -3e-39, 0.0, -0.0])  # bf16 subnormals and signed zeros
    weight = torch.randn(hidden, generator=g).bfloat16()
    residual = torch.randn(9, hidden, generator=g).bfloat16() if with_residual else None
    got = rmsnorm_native(x, weight, 1e-5, residual)
    got = got[0] if with_residual else got
    assert torch.equal(got, _rmsnorm_c_order(x, weight, 1e-5, residual))


def test_rmsnorm_declines_mixed_dtypes():
    x = torch.randn(2, 64).bfloat16()
    assert rmsnorm_native(x, torch.randn(64), 1e-5) is None  # fp32 weight: torch promotes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_matches_the_reference(dtype):
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(70, 2 * 1536, generator=g) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and signed zeros
    got = silu_mul_native(gate_up)
    want = silu_mul_reference(gate_up)
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * ulp, atol=ulp)
    assert (got != want).float().mean() < 0.01  # a rare last-bit difference from the exp
    assert torch.equal(got[0, :4].signbit(), want[0, :4].signbit())


def test_silu_mul_gives_the_same_bits_in_vector_lanes_and_the_scalar_tail():
    # A row of 16 * 3 + 7 columns: its first 48 run 16 lanes at a time where the CPU has
    # AVX-512 BF16, its last 7 the scalar loop. The same values in both places, specials
    # included, must give the same bits (NaN as float_to_bf16's 0x7FC0).
    values = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 88.7, 89.0, -87.3]
    values += [-88.0, 1e-39, 3e38, -3e38, 100.0, -100.0, 0.5, -2.25]
    width = 16 * 3 + 7
    g = torch.Generator().manual_seed(4)
    gate = (torch.randn(len(values), width, generator=g) * 6).to(torch.bfloat16)
    up = (torch.randn(len(values), width, generator=g) * 6).to(torch.bfloat16)
    for row, value in enumerate(values):
        gate[row, 5] = gate[row, width - 2] = value  # a vector column and a tail column
        up[row, width - 2] = up[row, 5]
    gate.view(torch.int16)[0, 5] = gate.view(torch.int16)[0, width - 2] = -1  # a negative NaN
    got = silu_mul_native(torch.cat([gate, up], dim=1)).view(torch.int16)
    assert torch.equal(got[:, 5], got[:, width - 2])
    assert got[0, 5] == 0x7FC0


def test_silu_mul_gives_the_same_bits_for_every_bf16_gate_in_lanes_and_scalar_loop():
    # Every bf16 bit pattern as a gate, times up = 1 (exact): in rows of 16 they run in the
    # vector lanes (a table where the CPU has AVX-512 BF16), in rows of 1 the scalar loop.
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = torch.ones_like(gate)
    lanes = silu_mul_native(torch.stack([gate, up]).view(2, -1, 16).transpose(0, 1).flatten(1))
    scalar = silu_mul_native(torch.stack([gate, up], dim=1))
    assert torch.equal(lanes.flatten().view(torch.int16), scalar.flatten().view(torch.int16))
    finite = gate.isfinite()
    want = silu_mul_reference(torch.stack([gate, up], dim=1)).flatten()
    torch.testing.assert_close(scalar.flatten()[finite].float(), want[finite].float())


def test_bf16_rounding_in_lanes_matches_the_scalar_loop_for_any_products():
    # Random bit patterns for gate and up (NaNs, infinities, subnormals among them): their
    # products reach every kind of fp32 value, rounded to bf16 in the lanes (the hardware
    # instruction where a vector holds no NaN or subnormal) and in the scalar loop.
    g = torch.Generator().manual_seed(6)
    bits = torch.randint(-(2**15), 2**15, (2, 1 << 20), generator=g, dtype=torch.int32)
    gate, up = bits.to(torch.int16).view(torch.bfloat16)
    lanes = silu_mul_native(torch.stack([gate, up]).view(2, -1, 16).transpose(0, 1).flatten(1))
    scalar = silu_mul_native(torch.stack([gate, up], dim=1))
    assert torch.equal(lanes.flatten().view(torch.int16), scalar.flatten().view(torch.int16))


def test_silu_mul_keeps_fp32_on_torch():
    assert silu_mul_native(torch.randn(3, 8)) is None


def test_many_rows_split_across_threads_give_the_same_bits():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 576, generator=g).bfloat16()
    r = torch.randn(300, 576, generator=g).bfloat16()
    w = torch.randn(576, generator=g).bfloat16()
    gate_up = torch.randn(300, 64, generator=g).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rmsnorm_native(x, w, 1e-5, r), silu_mul_native(gate_up)
        torch.set_num_threads(2)
        two = rmsnorm_native(x, w, 1e-5, r), silu_mul_native(gate_up)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0][0], two[0][0]) and torch.equal(one[0][1], two[0][1])
    assert torch.equal(one[1], two[1])
