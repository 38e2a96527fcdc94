"""Prefill flash attention over packed sequences with a paged prefix."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.fp8 import FP8_DTYPE
from engine.kernels.kv_codec import quantize_kv_blocks_reference
from engine.kernels.kv_store import store_kv_reference
from engine.kernels.prefill_attention import (
    prefill_attention,
    prefill_attention_reference,
    prefill_attention_triton,
)


def _case(dtype, hq, hkv, d, new_lens, prefix_lens, fp8=False, block_size=16, seed=0, device="cpu"):
    """Packed new tokens plus a random paged prefix cache (NaN everywhere outside prefixes)."""
    g = torch.Generator().manual_seed(seed)
    batch = len(new_lens)
    max_blocks = (
        max(math.ceil((n + p) / block_size) for n, p in zip(new_lens, prefix_lens, strict=True)) + 1
    )
    num_blocks = batch * max_blocks + 2
    kc = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    vc = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks)
    valid = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for b, p in enumerate(prefix_lens):
        for pos in range(p):
            valid[tables[b, pos // block_size], pos % block_size] = True
    ks = vs = None
    if fp8:
        kc, ks = quantize_kv_blocks_reference(kc)
        vc, vs = quantize_kv_blocks_reference(vc)
        kc.view(torch.uint8)[~valid] = 0x7F  # e4m3 NaN
        vc.view(torch.uint8)[~valid] = 0x7F
    else:
        kc = kc.masked_fill(~valid[:, :, None, None], float("nan")).to(dtype)
        vc = vc.masked_fill(~valid[:, :, None, None], float("nan")).to(dtype)
    total = sum(new_lens)
    q = torch.randn(total, hq, d, generator=g).to(dtype)
    k = torch.randn(total, hkv, d, generator=g).to(dtype)
    v = torch.randn(total, hkv, d, generator=g).to(dtype)
    cu = torch.tensor([0, *new_lens]).cumsum(0).to(torch.int32)
    prefix = torch.tensor(prefix_lens, dtype=torch.int32)
    args = [q, k, v, cu, prefix, kc, vc, ks, vs, tables.to(torch.int32)]
    args = [a.to(device) if a is not None else None for a in args]
    return args, 1.0 / math.sqrt(d)


def _naive(q, k, v, cu, prefix_lens, kc, vc, ks, vs, tables, scale):
    """Token loop over the paged prefix, then torch SDPA with an explicit offset-causal mask."""
    out = torch.empty_like(q, dtype=torch.float32)
    hq, hkv = q.shape[1], k.shape[1]
    bs = kc.shape[1]
    for b in range(len(prefix_lens)):
        s, e, p = int(cu[b]), int(cu[b + 1]), int(prefix_lens[b])
        pk, pv = [], []
        for pos in range(p):
            blk, row = int(tables[b, pos // bs]), pos % bs
            kk, vv = kc[blk, row].float(), vc[blk, row].float()
            if kc.dtype == FP8_DTYPE:
                kk, vv = kk * ks[blk][:, None], vv * vs[blk][:, None]
            pk.append(kk)
            pv.append(vv)
        keys = torch.cat([torch.stack(pk) if pk else k[:0].float(), k[s:e].float()])
        values = torch.cat([torch.stack(pv) if pv else v[:0].float(), v[s:e].float()])
        mask = torch.ones(e - s, p + e - s, dtype=torch.bool).tril(diagonal=p)
        out[s:e] = F.scaled_dot_product_attention(
            q[s:e].float().transpose(0, 1),
            keys.transpose(0, 1).repeat_interleave(hq // hkv, 0),
            values.transpose(0, 1).repeat_interleave(hq // hkv, 0),
            attn_mask=mask,
            scale=scale,
        ).transpose(0, 1)
    return out


CASES = [
    # dtype, hq, hkv, d, new lens, prefix lens, fp8, tolerance
    (torch.float32, 4, 4, 64, [1, 17, 40], [0, 16, 23], False, 1e-5),
    (torch.float32, 8, 2, 128, [40, 1, 17], [23, 0, 16], False, 1e-5),
    (torch.float16, 8, 1, 64, [17, 40, 1], [5, 0, 23], False, 2e-3),
    (torch.bfloat16, 4, 1, 64, [17, 33], [16, 0], False, 1e-2),
    (torch.float16, 4, 1, 64, [17, 40], [16, 23], True, 2e-3),
    (torch.float32, 2, 2, 128, [33], [40], True, 1e-5),
]


@pytest.mark.parametrize("dtype,hq,hkv,d,new,prefix,fp8,tol", CASES)
def test_triton_matches_reference(dtype, hq, hkv, d, new, prefix, fp8, tol):
    args, scale = _case(dtype, hq, hkv, d, new, prefix, fp8=fp8)
    out = prefill_attention_triton(*args, scale)
    ref = prefill_attention_reference(*args, scale)
    assert out.dtype == dtype and ref.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("fp8", [False, True])
def test_reference_matches_naive(fp8):
    args, scale = _case(torch.float32, 8, 2, 64, [1, 17, 40], [0, 16, 23], fp8=fp8, seed=2)
    torch.testing.assert_close(
        prefill_attention_reference(*args, scale), _naive(*args, scale), atol=1e-5, rtol=1e-5
    )


def test_chunked_prefill_equals_one_shot():
    """Chunk 2 reading chunk 1 from the cache (written by store_kv) == the one-shot prefill."""
    g = torch.Generator().manual_seed(4)
    hq, hkv, d, bs, n1, n2 = 4, 2, 64, 16, 23, 20
    q = torch.randn(n1 + n2, hq, d, generator=g)
    k = torch.randn(n1 + n2, hkv, d, generator=g)
    v = torch.randn(n1 + n2, hkv, d, generator=g)
    kc = torch.full((8, bs, hkv, d), float("nan"))
    vc = kc.clone()
    tables = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32)
    slots = torch.tensor([int(tables[0, p // bs]) * bs + p % bs for p in range(n1 + n2)])
    store_kv_reference(k[:n1], v[:n1], kc, vc, None, None, slots[:n1])
    scale = 1 / math.sqrt(d)
    zero = torch.tensor([0], dtype=torch.int32)
    one_shot = prefill_attention_triton(
        q,
        k,
        v,
        torch.tensor([0, n1 + n2], dtype=torch.int32),
        zero,
        kc,
        vc,
        None,
        None,
        tables,
        scale,
    )
    chunk2 = prefill_attention_triton(
        q[n1:], k[n1:], v[n1:], torch.tensor([0, n2], dtype=torch.int32),
        torch.tensor([n1], dtype=torch.int32), kc, vc, None, None, tables, scale,
        max_new_len=64,  # an upper bound is enough
    )  # fmt: skip
    torch.testing.assert_close(chunk2, one_shot[n1:], atol=1e-5, rtol=1e-5)


def test_fresh_prompt_matches_sdpa_causal():
    args, scale = _case(torch.float32, 2, 2, 64, [40], [0])
    q, k, v = args[:3]
    sdpa = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
    ).transpose(0, 1)
    torch.testing.assert_close(prefill_attention_triton(*args, scale), sdpa, atol=1e-5, rtol=1e-5)


def test_dispatcher_reference_on_cpu():
    args, scale = _case(torch.float32, 2, 1, 64, [3, 5], [0, 7])
    torch.testing.assert_close(
        prefill_attention(*args, scale), prefill_attention_reference(*args, scale)
    )


def test_errors():
    (q, k, v, cu, pre, kc, vc, ks, vs, bt), scale = _case(torch.float32, 4, 2, 64, [3, 5], [0, 7])
    with pytest.raises(ValueError, match="share a float32"):
        prefill_attention_triton(q.half(), k, v, cu, pre, kc, vc, ks, vs, bt, scale)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        prefill_attention_triton(q[:, :3], k, v, cu, pre, kc, vc, ks, vs, bt, scale)
    with pytest.raises(ValueError, match="cu_seqlens"):
        prefill_attention_triton(q, k, v, cu.long(), pre, kc, vc, ks, vs, bt, scale)
    with pytest.raises(ValueError, match="prefix_lens"):
        prefill_attention_triton(q, k, v, cu, pre[:1], kc, vc, ks, vs, bt, scale)
    with pytest.raises(ValueError, match="cache heads/head_dim"):
        prefill_attention_triton(q, k, v, cu, pre, kc[..., :32], vc[..., :32], ks, vs, bt, scale)
    with pytest.raises(ValueError, match="k_scale"):
        k8 = kc.nan_to_num(0).to(FP8_DTYPE)
        prefill_attention_triton(q, k, v, cu, pre, k8, k8, None, None, bt, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,fp8", [(torch.bfloat16, False), (torch.float16, True)])
def test_gpu_matches_reference(dtype, fp8):
    args, scale = _case(
        dtype, 32, 8, 128, [1, 300, 17, 700], [0, 16, 523, 0], fp8=fp8, device="cuda"
    )
    out = prefill_attention_triton(*args, scale)
    ref = prefill_attention_reference(*args, scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
