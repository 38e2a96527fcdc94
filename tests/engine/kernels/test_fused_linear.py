"""fused_linear: Triton kernel (interpreter here, CUDA with the gpu marker) vs torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from engine.kernels.fused_linear import (
    fused_linear,
    fused_linear_reference,
    fused_linear_triton,
)

# (rtol, atol) per dtype; inputs are scaled so outputs are O(1).
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}


def _inputs(m, n, k, dtype, bias, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    to = lambda t: None if t is None else t.to(device=device, dtype=dtype)
    return to(x), to(w), to(b)


def _assert_close(out, ref, dtype):
    rtol, atol = TOL[dtype]
    assert out.dtype == ref.dtype == dtype
    assert out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("n,k", [(40, 72), (64, 64)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", [None, "silu_mul"])
def test_triton_matches_reference(dtype, m, n, k, bias, activation):
    x, w, b = _inputs(m, n, k, dtype, bias)
    out = fused_linear_triton(x, w, b, activation)
    ref = fused_linear_reference(x, w, b, activation)
    assert out.shape == (m, n // 2 if activation else n)
    _assert_close(out, ref, dtype)


@pytest.mark.parametrize("activation", [None, "silu_mul"])
def test_bf16(activation):
    x, w, b = _inputs(33, 80, 72, torch.bfloat16, bias=True)
    _assert_close(
        fused_linear_triton(x, w, b, activation),
        fused_linear_reference(x, w, b, activation),
        torch.bfloat16,
    )


def test_multiple_k_blocks_and_m_groups():
    # K spans several BLOCK_K steps with a ragged tail; M spans several GROUP_M groups.
    x, w, b = _inputs(70, 72, 100, torch.float32, bias=True)
    _assert_close(fused_linear_triton(x, w, b), fused_linear_reference(x, w, b), torch.float32)
    _assert_close(
        fused_linear_triton(x, w, b, "silu_mul"),
        fused_linear_reference(x, w, b, "silu_mul"),
        torch.float32,
    )


def test_strided_inputs():
    # x a column slice (row stride > K); weight a transposed view (K-stride != 1).
    x_full, _, b = _inputs(9, 48, 80, torch.float32, bias=True)
    x = x_full[:, :72]
    w = torch.randn(72, 48).t()
    out = fused_linear_triton(x, w, b)
    _assert_close(out, fused_linear_reference(x, w, b), torch.float32)


def test_empty_batch():
    x, w, b = _inputs(0, 40, 72, torch.float32, bias=True)
    assert fused_linear_triton(x, w, b, "silu_mul").shape == (0, 20)


def test_reference_is_hf_mlp_and_separate_qkv():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu", mlp_bias=False)
    mlp = LlamaMLP(cfg).eval()
    x = torch.randn(5, 32)
    gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # [2I, H]
    with torch.no_grad():
        ours = mlp.down_proj(fused_linear_reference(x, gate_up, activation="silu_mul"))
        torch.testing.assert_close(ours, mlp(x), rtol=1e-6, atol=1e-6)

    # Fused QKV (with bias, as Qwen-style checkpoints have) == the three separate projections.
    wq, wk, wv = torch.randn(32, 32), torch.randn(8, 32), torch.randn(8, 32)
    bq, bk, bv = torch.randn(32), torch.randn(8), torch.randn(8)
    fused = fused_linear_reference(x, torch.cat([wq, wk, wv]), torch.cat([bq, bk, bv]))
    separate = torch.cat([F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)], -1)
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)


def test_dispatch(monkeypatch):
    x, w, b = _inputs(7, 40, 72, torch.float32, bias=True)
    monkeypatch.delenv("PDCLUSTER_FORCE_TRITON", raising=False)
    assert torch.equal(
        fused_linear(x, w, b, "silu_mul"), fused_linear_reference(x, w, b, "silu_mul")
    )
    monkeypatch.setenv("PDCLUSTER_FORCE_TRITON", "1")
    _assert_close(fused_linear(x, w, b), fused_linear_reference(x, w, b), torch.float32)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.randn(4, 8), torch.randn(6, 9)), "disagree on K"),
        ((torch.randn(8), torch.randn(6, 8)), "x must be 2-D"),
        ((torch.randn(4, 8), torch.randn(6, 8, 1)), "weight must be 2-D"),
        ((torch.randn(4, 8), torch.randn(5, 8), None, "silu_mul"), "gate_up weight"),
        ((torch.randn(4, 8), torch.randn(6, 8), None, "gelu"), "activation"),
        ((torch.randn(4, 8), torch.randn(6, 8), torch.randn(5)), "bias must be"),
        ((torch.randn(4, 8), torch.randn(6, 8).half()), "dtypes must match"),
        ((torch.randn(4, 8).double(), torch.randn(6, 8).double()), "unsupported dtype"),
    ],
)
def test_invalid_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        fused_linear_triton(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "m,n,k,bias", [(1, 40, 72, True), (7, 1024, 512, False), (1000, 1024, 520, True)]
)
@pytest.mark.parametrize("activation", [None, "silu_mul"])
def test_cuda_matches_reference(dtype, m, n, k, bias, activation):
    # Every new (M bucket, N, K) autotunes, so the GPU matrix stays small.
    x, w, b = _inputs(m, n, k, dtype, bias, device="cuda")
    out = fused_linear(x, w, b, activation)
    ref = fused_linear_reference(x, w, b, activation)
    rtol, atol = TOL[dtype]
    if dtype == torch.float32:
        # cuBLAS and the kernel sum K in different orders.
        rtol, atol = 1e-4, 1e-4
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)
