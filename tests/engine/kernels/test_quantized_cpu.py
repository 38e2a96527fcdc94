"""The GEMM on GGUF blocks (engine/kernels/quantized_cpu.c): the values it computes with are
gguf's dequantised weights bit for bit, its products match an fp32 GEMM on them to a BLAS's
rounding, a row's result does not depend on its batch, and the plan routes to it only where
a weight has blocks."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import cpu_isa
from engine.cpu_gemm import GemmPlan, QuantizedGemm
from engine.kernels import cpu_native
from engine.kernels.quantized_cpu import (
    KINDS,
    QuantizedWeight,
    dequantize,
    dequantize_reference,
    quantized_linear,
    stack_rows,
)

pytestmark = pytest.mark.skipif(
    cpu_native.library() is None, reason=f"{cpu_isa.why_missing('none')}: GEMMs stay dense"
)


def _weight(kind: str, out_features: int, in_features: int, seed: int = 0):
    """(blocks, gguf's own dequantisation of them) for a random fp32 matrix."""
    from gguf import GGMLQuantizationType, quants

    dense = np.random.default_rng(seed).standard_normal((out_features, in_features))
    blocks = quants.quantize(dense.astype(np.float32) * 0.1, GGMLQuantizationType[kind])
    values = quants.dequantize(blocks, GGMLQuantizationType[kind]).astype(np.float32)
    weight = QuantizedWeight(kind, torch.from_numpy(blocks.view(np.uint8).copy()), in_features)
    return weight, torch.from_numpy(values.reshape(out_features, in_features))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_kernel_computes_with_ggufs_values_bit_for_bit(kind):
    weight, values = _weight(kind, 70, 96)
    assert torch.equal(dequantize(weight), values)
    assert torch.equal(dequantize_reference(weight), values)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 9])
def test_products_match_an_fp32_gemm_on_the_values(kind, rows):
    weight, values = _weight(kind, 70, 96)
    x, bias = torch.randn(rows, 96), torch.randn(70)
    exact = x.double() @ values.double().T + bias.double()
    ours = quantized_linear(x, weight, bias)
    blas = F.linear(x, values, bias)
    # within a small multiple of what an fp32 BLAS is off by
    assert (ours - exact).abs().max() <= 4 * (blas - exact).abs().max() + 1e-6


def test_a_rows_result_does_not_depend_on_its_batch():
    weight, _ = _weight("Q4_1", 40, 64)
    x = torch.randn(9, 64)
    whole = quantized_linear(x, weight)
    assert all(torch.equal(quantized_linear(x[i : i + 1], weight)[0], whole[i]) for i in range(9))
    assert torch.equal(quantized_linear(x[2:7], weight), whole[2:7])


def test_strided_rows_and_threads_give_the_same_bits():
    weight, _ = _weight("Q8_0", 33, 64)
    wide = torch.randn(5, 100)
    x = wide[:, 10:74]  # row stride 100
    out = quantized_linear(x, weight)
    assert torch.equal(out, quantized_linear(x.contiguous(), weight))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(quantized_linear(x, weight), out)
    finally:
        torch.set_num_threads(threads)


def test_stacked_parts_are_one_weight_of_their_rows():
    q, q_values = _weight("Q4_0", 16, 64, seed=1)
    k, k_values = _weight("Q4_0", 8, 64, seed=2)
    fused = stack_rows([q, k])
    assert torch.equal(dequantize(fused), torch.cat([q_values, k_values]))
    other, _ = _weight("Q8_0", 8, 64)
    with pytest.raises(ValueError, match="cannot stack"):
        stack_rows([q, other])


def test_what_the_kernel_does_not_take_is_refused_or_left_to_the_dense_path():
    weight, _ = _weight("Q4_1", 8, 64)
    assert quantized_linear(torch.randn(2, 64, dtype=torch.bfloat16), weight) is None
    with pytest.raises(ValueError, match="features"):
        quantized_linear(torch.randn(2, 32), weight)
    with pytest.raises(ValueError, match="not one of"):
        QuantizedWeight("Q4_K", weight.blocks, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight("Q4_1", weight.blocks, 48)
    with pytest.raises(ValueError, match=r"uint8 \[rows, 40\]"):
        QuantizedWeight("Q4_1", weight.blocks[:, :20].contiguous(), 64)


def test_the_plan_runs_blocks_where_a_weight_has_them_and_dense_elsewhere():
    weight, values = _weight("Q4_1", 48, 64)
    plain = torch.randn(48, 64)
    plan = GemmPlan(
        choices={1: "gguf", 8: "torch"},
        fallback_choices={1: "torch", 8: "torch"},
        quantized=QuantizedGemm([(values, weight)]),
    )
    x = torch.randn(1, 64)
    assert torch.equal(plan.gemm(x, values, None), quantized_linear(x, weight))
    assert torch.equal(plan.gemm(x, plain, None), F.linear(x, plain))  # no blocks: dense
    x8 = torch.randn(8, 64)
    assert torch.equal(plan.gemm(x8, values, None), F.linear(x8, values))  # its bucket: dense
    with pytest.raises(ValueError, match="a fallback cannot be"):
        GemmPlan(choices={1: "gguf"}, fallback_choices={1: "gguf"})


def test_measuring_times_the_blocks_only_when_every_weight_has_them():
    pairs = [_weight("Q4_1", 64, 64, seed=s) for s in range(2)]
    with_blocks = QuantizedGemm([(values, weight) for weight, values in pairs])
    weights = [values for _, values in pairs]
    plan = GemmPlan.measure(weights, buckets=(1, 64), quantized=with_blocks)
    assert all("gguf" in t for t in plan.timings_ms.values())
    assert all(plan.fallback_choices[b] != "gguf" for b in (1, 64))
    dense = GemmPlan.measure([*weights, torch.randn(64, 64)], buckets=(1,), quantized=with_blocks)
    assert "gguf" not in dense.timings_ms[1]
