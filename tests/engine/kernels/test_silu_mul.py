"""silu_mul: Triton kernel (interpreter here, CUDA with the gpu marker) vs torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from engine.kernels.silu_mul import silu_mul, silu_mul_reference, silu_mul_triton

# The kernel keeps torch's two rounding points (silu, then the product); only fp32
# evaluation order of silu differs, so 16-bit results are almost always bit-identical.
TOL = {
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
}


def _gate_up(m, i, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, 2 * i, generator=g) * 3).to(device=device, dtype=dtype)


def _assert_close(out, ref):
    rtol, atol = TOL[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("i", [40, 1500])  # 1500 > BLOCK_I cap: several column blocks
def test_triton_matches_reference(dtype, m, i):
    gate_up = _gate_up(m, i, dtype)
    out = silu_mul_triton(gate_up)
    assert out.shape == (m, i)
    _assert_close(out, silu_mul_reference(gate_up))


def test_strided_rows():
    gate_up = _gate_up(5, 60, torch.float16)[:, :80]  # row stride 120, I = 40
    _assert_close(silu_mul_triton(gate_up), silu_mul_reference(gate_up))


# The interpreter evaluates exp in numpy, which warns where it overflows to inf (as intended).
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_extreme_values():
    # Large |gate| saturates the sigmoid (exp overflow must give 0 or x, not NaN).
    gate = torch.tensor([[-100.0, -30.0, 0.0, 30.0, 100.0]])
    gate_up = torch.cat([gate, torch.full_like(gate, 2.0)], dim=1)
    out = silu_mul_triton(gate_up)
    assert torch.isfinite(out).all()
    _assert_close(out, silu_mul_reference(gate_up))


HF_TOL = {
    torch.float32: {"rtol": 1e-6, "atol": 1e-6},
    torch.bfloat16: {"rtol": 8e-3, "atol": 1e-3},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_hf_llama_mlp(dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu", mlp_bias=False)
    mlp = LlamaMLP(cfg).to(dtype).eval()
    x = torch.randn(5, 32).to(dtype)
    with torch.no_grad():
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        gate_up = torch.cat([gate, up], dim=-1)  # [M, 2I]
        ours = silu_mul_reference(gate_up)
        # Same ops and rounding points as HF. Not asserted bit-equal: torch's CPU silu can
        # differ by an fp32 ulp between a strided view and a contiguous tensor.
        torch.testing.assert_close(ours, F.silu(gate) * up, **HF_TOL[dtype])
        torch.testing.assert_close(mlp.down_proj(ours), mlp(x), **HF_TOL[dtype])


def test_dispatch(monkeypatch):
    gate_up = _gate_up(3, 40, torch.float32)
    monkeypatch.delenv("PDCLUSTER_FORCE_TRITON", raising=False)
    assert torch.equal(silu_mul(gate_up), silu_mul_reference(gate_up))
    monkeypatch.setenv("PDCLUSTER_FORCE_TRITON", "1")
    _assert_close(silu_mul(gate_up), silu_mul_reference(gate_up))


@pytest.mark.parametrize(
    "gate_up, match",
    [
        (torch.randn(8), "must be 2-D"),
        (torch.randn(2, 7), "must be even"),
        (torch.randn(2, 8).double(), "unsupported dtype"),
    ],
)
def test_invalid_inputs(gate_up, match):
    with pytest.raises(ValueError, match=match):
        silu_mul_triton(gate_up)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,i", [(1, 40), (33, 14336), (512, 1500)])
def test_cuda_matches_reference(dtype, m, i):
    gate_up = _gate_up(m, i, dtype, device="cuda")
    _assert_close(silu_mul(gate_up), silu_mul_reference(gate_up))
