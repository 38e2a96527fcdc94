"""rmsnorm: Triton kernel (interpreter here, CUDA with the gpu marker) vs torch reference."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from engine.kernels.rmsnorm import rmsnorm, rmsnorm_reference, rmsnorm_triton

EPS = 1e-6
# Kernel and reference differ only in the fp32 reduction order, so after rounding to a
# 16-bit dtype at most the odd element lands one ulp away.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
}


def _inputs(m, h, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, h, generator=g) * 3).to(device=device, dtype=dtype)
    residual = torch.randn(m, h, generator=g).to(device=device, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(h, generator=g)).to(device=device, dtype=dtype)
    return x, residual, weight


def _assert_close(out, ref):
    rtol, atol = TOL[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("h", [64, 100, 1000])
def test_triton_matches_reference(dtype, m, h):
    x, _, w = _inputs(m, h, dtype)
    _assert_close(rmsnorm_triton(x, w, EPS), rmsnorm_reference(x, w, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("h", [100, 256])
def test_triton_residual_matches_reference(dtype, h):
    x, r, w = _inputs(7, h, dtype)
    out, new_residual = rmsnorm_triton(x, w, EPS, residual=r)
    ref_out, ref_residual = rmsnorm_reference(x, w, EPS, residual=r)
    # The residual sum is one rounding of an exact fp32 add on both sides: bit-identical.
    assert torch.equal(new_residual, ref_residual)
    assert torch.equal(ref_residual, x + r)
    _assert_close(out, ref_out)


def test_strided_rows_and_fp32_weight_promotion():
    x_full, r, _ = _inputs(5, 120, torch.bfloat16)
    x = x_full[:, :100]  # row stride 120
    w = 1 + 0.1 * torch.randn(100)  # fp32 weight with bf16 x -> fp32 output, as torch promotes
    out = rmsnorm_triton(x, w, EPS)
    ref = rmsnorm_reference(x, w, EPS)
    assert out.dtype == torch.float32
    _assert_close(out, ref)


def test_empty_batch():
    x, r, w = _inputs(0, 64, torch.float32)
    out, new_residual = rmsnorm_triton(x, w, EPS, residual=r)
    assert out.shape == new_residual.shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_is_hf_llama_rmsnorm(dtype):
    x, r, w = _inputs(6, 96, dtype)
    hf = LlamaRMSNorm(96, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
        assert torch.equal(rmsnorm_reference(x, w, EPS), hf(x))
        # The decoder layer's pattern: residual + hidden, then the next norm.
        summed = r + x
        out, new_residual = rmsnorm_reference(x, w, EPS, residual=r)
        assert torch.equal(new_residual, summed)
        assert torch.equal(out, hf(summed))


def test_dispatch(monkeypatch):
    x, r, w = _inputs(3, 100, torch.float32)
    monkeypatch.delenv("PDCLUSTER_FORCE_TRITON", raising=False)
    assert torch.equal(rmsnorm(x, w, EPS), rmsnorm_reference(x, w, EPS))
    monkeypatch.setenv("PDCLUSTER_FORCE_TRITON", "1")
    out, new_residual = rmsnorm(x, w, EPS, residual=r)
    ref_out, ref_residual = rmsnorm_reference(x, w, EPS, residual=r)
    _assert_close(out, ref_out)
    assert torch.equal(new_residual, ref_residual)


@pytest.mark.parametrize(
    "x, w, residual, match",
    [
        (torch.randn(8), torch.randn(8), None, "x must be 2-D"),
        (torch.randn(2, 8), torch.randn(7), None, "weight must be"),
        (torch.randn(2, 8), torch.randn(8), torch.randn(3, 8), "residual shape"),
        (torch.randn(2, 8), torch.randn(8), torch.randn(2, 8).half(), "residual dtype"),
        (torch.randn(2, 8).double(), torch.randn(8), None, "unsupported x dtype"),
    ],
)
def test_invalid_inputs(x, w, residual, match):
    with pytest.raises(ValueError, match=match):
        rmsnorm_triton(x, w, EPS, residual)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,h", [(1, 100), (33, 4096), (257, 5120)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_cuda_matches_reference(dtype, m, h, with_residual):
    x, r, w = _inputs(m, h, dtype, device="cuda")
    if with_residual:
        out, new_residual = rmsnorm(x, w, EPS, residual=r)
        ref_out, ref_residual = rmsnorm_reference(x, w, EPS, residual=r)
        assert torch.equal(new_residual, ref_residual)
    else:
        out, ref_out = rmsnorm(x, w, EPS), rmsnorm_reference(x, w, EPS)
    _assert_close(out, ref_out)
