"""Paged split-K decode attention: Triton (interpreter) vs torch reference vs a naive loop."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.decode_attention import (
    choose_num_splits,
    decode_attention,
    decode_attention_reference,
    decode_attention_triton,
)
from engine.kernels.fp8 import FP8_DTYPE
from engine.kernels.kv_codec import quantize_kv_blocks_reference


def _paged_case(dtype, hq, hkv, d, ctx_lens, fp8=False, block_size=16, seed=0, device="cpu"):
    """Random paged cache; every row outside the contexts holds NaN, to prove it is never used."""
    g = torch.Generator().manual_seed(seed)
    batch = len(ctx_lens)
    max_blocks = max(math.ceil(c / block_size) for c in ctx_lens) + 1
    num_blocks = batch * max_blocks + 3
    k = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    v = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks)
    valid = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for b, c in enumerate(ctx_lens):
        for p in range(c):
            valid[tables[b, p // block_size], p % block_size] = True
        tables[b, math.ceil(c / block_size) :] = 0  # unused entries: anything, e.g. 0
    ks = vs = None
    if fp8:
        k, ks = quantize_kv_blocks_reference(k)
        v, vs = quantize_kv_blocks_reference(v)
        k.view(torch.uint8)[~valid] = 0x7F  # e4m3 NaN
        v.view(torch.uint8)[~valid] = 0x7F
    else:
        k = k.masked_fill(~valid[:, :, None, None], float("nan")).to(dtype)
        v = v.masked_fill(~valid[:, :, None, None], float("nan")).to(dtype)
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    args = [q, k, v, ks, vs, tables.int(), ctx]
    args = [a.to(device) if a is not None else None for a in args]
    return args, 1.0 / math.sqrt(d)


def _naive(q, k_cache, v_cache, k_scale, v_scale, tables, ctx, scale):
    """Loop over sequences and tokens, then torch SDPA."""
    out = torch.empty_like(q, dtype=torch.float32)
    hq, hkv = q.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]
    for b in range(q.shape[0]):
        ks, vs = [], []
        for p in range(int(ctx[b])):
            blk, row = int(tables[b, p // bs]), p % bs
            kk, vv = k_cache[blk, row].float(), v_cache[blk, row].float()
            if k_cache.dtype == FP8_DTYPE:
                kk, vv = kk * k_scale[blk][:, None], vv * v_scale[blk][:, None]
            ks.append(kk)
            vs.append(vv)
        kt = torch.stack(ks, 1).repeat_interleave(hq // hkv, 0)  # [Hq, L, D]
        vt = torch.stack(vs, 1).repeat_interleave(hq // hkv, 0)
        out[b] = F.scaled_dot_product_attention(q[b].float()[:, None], kt, vt, scale=scale)[:, 0]
    return out


CASES = [
    # dtype, hq, hkv, d, context lengths, num_splits, fp8, tolerance
    (torch.float32, 4, 4, 64, [1, 17, 40], None, False, 1e-5),
    (torch.float32, 8, 2, 64, [1, 16, 100], 3, False, 1e-5),
    (torch.float32, 8, 2, 64, [17, 5], 8, False, 1e-5),  # mostly empty splits
    (torch.float16, 8, 1, 128, [33, 200], 4, False, 2e-3),
    (torch.bfloat16, 4, 1, 64, [5, 70], 2, False, 1e-2),
    (torch.float16, 8, 2, 64, [33, 150], 2, True, 2e-3),
    (torch.float32, 4, 4, 128, [9, 64], 1, True, 1e-5),
]


@pytest.mark.parametrize("dtype,hq,hkv,d,ctx,splits,fp8,tol", CASES)
def test_triton_matches_reference(dtype, hq, hkv, d, ctx, splits, fp8, tol):
    args, scale = _paged_case(dtype, hq, hkv, d, ctx, fp8=fp8)
    out = decode_attention_triton(*args, scale, num_splits=splits)
    ref = decode_attention_reference(*args, scale)
    assert out.dtype == dtype and ref.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("fp8", [False, True])
def test_reference_matches_naive(fp8):
    args, scale = _paged_case(torch.float32, 8, 2, 64, [1, 23, 48], fp8=fp8, seed=3)
    ref = decode_attention_reference(*args, scale)
    torch.testing.assert_close(ref, _naive(*args, scale), atol=1e-5, rtol=1e-5)


def test_split_count_does_not_change_result():
    args, scale = _paged_case(torch.float32, 4, 2, 64, [130, 7], seed=5)
    one = decode_attention_triton(*args, scale, num_splits=1)
    for splits in (2, 5):
        torch.testing.assert_close(
            decode_attention_triton(*args, scale, num_splits=splits), one, atol=1e-6, rtol=1e-6
        )


def test_choose_num_splits():
    assert choose_num_splits(1, 8, 32768) == 33  # 2 * 132 SMs / 8 programs
    assert choose_num_splits(1, 8, 300) == 2  # bounded by >= 256 tokens per split
    assert choose_num_splits(256, 8, 4096) == 1  # the batch alone fills the GPU
    assert choose_num_splits(1, 1, 10**6) == 64  # capped


def test_dispatcher_reference_on_cpu():
    args, scale = _paged_case(torch.float32, 4, 2, 64, [5, 9])
    torch.testing.assert_close(
        decode_attention(*args, scale), decode_attention_reference(*args, scale)
    )


def test_errors():
    (q, k, v, ks, vs, tables, ctx), scale = _paged_case(torch.float32, 4, 2, 64, [5, 9])
    with pytest.raises(ValueError, match="q must be"):
        decode_attention_triton(q[0], k, v, ks, vs, tables, ctx, scale)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        decode_attention_triton(q[:, :3], k, v, ks, vs, tables, ctx, scale)
    with pytest.raises(ValueError, match="must be fp8 or match q dtype"):
        decode_attention_triton(q.half(), k, v, ks, vs, tables, ctx, scale)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        decode_attention_triton(q, k, v, ks, vs, tables.long(), ctx, scale)
    with pytest.raises(ValueError, match="context_lens"):
        decode_attention_triton(q, k, v, ks, vs, tables, ctx[:1], scale)
    with pytest.raises(ValueError, match="k_scale"):
        k8 = k.nan_to_num(0).to(FP8_DTYPE)
        decode_attention_triton(q, k8, k8, None, None, tables, ctx, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,fp8", [(torch.bfloat16, False), (torch.float16, True)])
def test_gpu_matches_reference(dtype, fp8):
    args, scale = _paged_case(dtype, 32, 8, 128, [1, 100, 1000, 4097], fp8=fp8, device="cuda")
    ref = decode_attention_reference(*args, scale)
    for splits in (None, 1, 7):
        out = decode_attention_triton(*args, scale, num_splits=splits)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
