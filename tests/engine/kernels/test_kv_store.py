"""store_kv: scatter (fp32/fp16/bf16 caches) and per-run fp8 stores with scale updates."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.fp8 import FP8_DTYPE
from engine.kernels.kv_store import (
    block_runs_from_slots,
    store_kv,
    store_kv_reference,
    store_kv_triton,
)

BS, H, D = 16, 2, 64


def _nan_cache(dtype: torch.dtype, num_blocks: int = 6) -> torch.Tensor:
    return torch.full((num_blocks, BS, H, D), float("nan"), dtype=dtype)


def _fp8_cache(num_blocks: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    cache = (torch.randn(num_blocks, BS, H, D, generator=g) * 50).to(FP8_DTYPE)
    scale = torch.rand(num_blocks, H, generator=g) * 0.01  # stale scales of reused blocks
    return cache, scale


def _same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal fp8 values (compared as floats, so +0.0 == -0.0)."""
    return torch.equal(a.float().nan_to_num(123.0), b.float().nan_to_num(123.0))


def test_block_runs_from_slots():
    slots = torch.tensor([3 * 16 + 5, 3 * 16 + 6, -1, 16, 17, 18, 4 * 16 + 15, 0])
    runs = block_runs_from_slots(slots, 16)
    assert runs.dtype == torch.int32
    expected = [[3, 5, 0, 2], [1, 0, 3, 3], [4, 15, 6, 1], [0, 0, 7, 1]]
    assert runs.tolist() == expected
    assert block_runs_from_slots(torch.tensor([-1, -1]), 16).shape == (0, 4)
    # One block written in two separate runs would race on its scale.
    with pytest.raises(ValueError, match="several non-contiguous runs"):
        block_runs_from_slots(torch.tensor([16, 18]), 16)


@pytest.mark.parametrize(
    "src_dtype,cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float16),
        (torch.float32, torch.bfloat16),
    ],
)
def test_scatter_triton_matches_reference_and_naive(src_dtype, cache_dtype):
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([5 * 16 + 3, -1, 2 * 16 + 15, 7, 4 * 16 + 0, 4 * 16 + 1])
    k = torch.randn(len(slots), H, D, generator=g).to(src_dtype)
    v = torch.randn(len(slots), H, D, generator=g).to(src_dtype)
    kc, vc = _nan_cache(cache_dtype), _nan_cache(cache_dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv_triton(k, v, kc, vc, None, None, slots)
    store_kv_reference(k, v, kc_ref, vc_ref, None, None, slots)
    assert torch.equal(kc.nan_to_num(7.0), kc_ref.nan_to_num(7.0))
    assert torch.equal(vc.nan_to_num(7.0), vc_ref.nan_to_num(7.0))
    naive = _nan_cache(cache_dtype)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            naive[slot // BS, slot % BS] = k[t].to(cache_dtype)
    assert torch.equal(kc_ref.nan_to_num(7.0), naive.nan_to_num(7.0))


def _check_fp8_step(k, v, slots, state, state_ref, block_runs=None):
    store_kv_triton(k, v, *state, slots, block_runs)
    # The reference on the CPU (its e4m3 cast rounds once; see test_kv_codec's GPU test),
    # written back where the kernel's state lives so the next step starts from the same.
    cpu_ref = [t.cpu() for t in state_ref]
    runs = None if block_runs is None else block_runs.cpu()
    store_kv_reference(k.cpu(), v.cpu(), *cpu_ref, slots.cpu(), runs)
    for t, cpu in zip(state_ref, cpu_ref, strict=True):
        t.copy_(cpu)
    kc, vc, ks, vs = [t.cpu() for t in state]
    kc_r, vc_r, ks_r, vs_r = cpu_ref
    # Kernel vs reference: bit-exact (scales and fp8 values; only the sign of zero may differ).
    assert torch.equal(ks, ks_r) and torch.equal(vs, vs_r)
    assert _same_fp8(kc, kc_r) and _same_fp8(vc, vc_r)


def test_fp8_prefill_then_decode_appends_with_requantisation():
    g = torch.Generator().manual_seed(0)
    kc, ks = _fp8_cache()
    vc, vs = _fp8_cache()
    state = [kc, vc, ks, vs]
    state_ref = [t.clone() for t in state]
    # Prefill of 20 tokens into blocks 2 (full) and 5 (rows 0..3); a second sequence of
    # 3 tokens into block 0 rows 0..2.
    slots = torch.cat([torch.arange(32, 48), torch.arange(80, 84), torch.arange(0, 3)])
    k_all = torch.randn(len(slots), H, D, generator=g)
    v_all = torch.randn(len(slots), H, D, generator=g) * 1e-3
    runs = block_runs_from_slots(slots, BS)
    _check_fp8_step(k_all, v_all, slots, state, state_ref, block_runs=runs)
    scale_before = ks[5].clone()

    # Decode steps append one token per sequence (first_row > 0); the second step's token in
    # block 5 has a 10x larger amax in head 0 only, forcing requantisation of rows 0..4.
    for step, boost in enumerate([1.0, 10.0, 0.5]):
        slots = torch.tensor([84 + step, 3 + step])
        k = torch.randn(2, H, D, generator=g)
        k[0, 0] *= boost
        v = torch.randn(2, H, D, generator=g) * 1e-3
        _check_fp8_step(k, v, slots, state, state_ref)  # runs built internally
        k_all = torch.cat([k_all, k])
    assert ks[5, 0] > scale_before[0] * 5  # grew with the big token
    # The block's scale is max over its rows of amax/448 (head 1 never saw a big token).
    rows_block5 = torch.cat([k_all[16:20], k_all[[23, 25, 27]]])
    expected = rows_block5.abs().amax(dim=(0, 2)) / 448.0
    torch.testing.assert_close(ks[5], expected, rtol=1e-6, atol=0)
    # Requantised old rows still dequantise close to the originals (coarser grid now).
    deq = ks[5, 0] * kc[5, :7, 0].float()
    torch.testing.assert_close(deq, rows_block5[:, 0], atol=ks[5, 0].item() * 1.5, rtol=0.07)
    # Rows past what was written keep their old contents.
    assert _same_fp8(kc[5, 7:], state_ref[0][5, 7:])


def test_fp8_fresh_block_ignores_stale_scale():
    kc, ks = _fp8_cache()
    vc, vs = _fp8_cache()
    ks.fill_(1e6)  # stale, huge: a fresh block (first_row == 0) must not keep it
    state = [kc, vc, ks, vs]
    state_ref = [t.clone() for t in state]
    k = torch.randn(5, H, D)
    _check_fp8_step(k, k.clone(), torch.arange(48, 53), state, state_ref)
    torch.testing.assert_close(ks[3], k.abs().amax(dim=(0, 2)) / 448.0, rtol=1e-6, atol=0)
    torch.testing.assert_close(kc[3, :5].float() * ks[3][None, :, None], k, rtol=0.07, atol=1e-2)


def test_dispatcher_reference_on_cpu():
    k = torch.randn(3, H, D)
    kc, vc = _nan_cache(torch.float32), _nan_cache(torch.float32)
    store_kv(k, k, kc, vc, None, None, torch.tensor([0, 1, 2]))
    assert torch.equal(kc[0, :3], k)


def test_errors():
    k = torch.randn(3, H, D)
    kc, vc = _nan_cache(torch.float32), _nan_cache(torch.float32)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_triton(k, k, kc, vc, None, None, slots[:2])
    with pytest.raises(ValueError, match="heads/head_dim"):
        store_kv_triton(k[:, :1], k[:, :1], kc, vc, None, None, slots)
    with pytest.raises(ValueError, match="k/v must be"):
        store_kv_triton(k.double(), k.double(), kc, vc, None, None, slots)
    f8, s = _fp8_cache()
    with pytest.raises(ValueError, match="k_scale"):
        store_kv_triton(k, k, f8, f8.clone(), None, None, slots)
    with pytest.raises(ValueError, match="block_runs"):
        store_kv_triton(k, k, f8, f8.clone(), s, s.clone(), slots, torch.zeros(1, 4))
    with pytest.raises(ValueError, match="power of two"):
        bad = torch.zeros(2, 12, H, D)
        store_kv_reference(k, k, bad, bad.clone(), None, None, slots)


@pytest.mark.gpu
def test_gpu_matches_reference():
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(64 * BS, generator=g)[:300].sort().values
    k = torch.randn(300, H, D, generator=g).cuda().half()
    slots = slots.cuda()
    kc, vc = _nan_cache(torch.float16, 64).cuda(), _nan_cache(torch.float16, 64).cuda()
    kc_r, vc_r = kc.clone(), vc.clone()
    store_kv_triton(k, k, kc, vc, None, None, slots)
    store_kv_reference(k, k, kc_r, vc_r, None, None, slots)
    assert torch.equal(kc.nan_to_num(7.0), kc_r.nan_to_num(7.0))
    # fp8: contiguous slots, so each block gets exactly one run.
    slots = torch.arange(5, 305, device="cuda")
    f8, s = _fp8_cache(64)
    state = [f8.cuda(), f8.cuda(), s.cuda(), s.cuda()]
    state_ref = [t.clone() for t in state]
    _check_fp8_step(k, k, slots, state, state_ref)
