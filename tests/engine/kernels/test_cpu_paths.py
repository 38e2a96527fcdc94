"""The CPU production paths against their references: decode attention (the C kernel, and
SDPA over gathered pages without one), prefill SDPA, the fused RMSNorm, the index_copy KV
store, the sign-folded RoPE and the GEMM plan."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_isa
from engine.config import RopeConfig
from engine.cpu_gemm import BACKENDS, GemmPlan, PackedOneDNN, available_backends
from engine.kernels import cpu_native
from engine.kernels.cpu_attention import (
    decode_attention_cpu,
    decode_plan,
    prefill_attention_cpu,
    prefill_plan,
)
from engine.kernels.decode_attention import decode_attention_reference
from engine.kernels.kv_store import store_kv_cpu, store_kv_reference
from engine.kernels.prefill_attention import prefill_attention_reference
from engine.kernels.rmsnorm import rmsnorm_cpu, rmsnorm_reference
from engine.rope import RotaryEmbedding, apply_rotary
from tests.engine.kernels.test_decode_attention import _paged_case
from tests.engine.kernels.test_prefill_attention import _case

DECODE_CASES = [
    # dtype, hq, hkv, d, context lengths, fp8, tolerance
    (torch.float32, 9, 3, 64, [1, 17, 40], False, 1e-5),
    (torch.float32, 8, 2, 64, [16, 32], False, 1e-5),  # whole pages: no mask
    (torch.float32, 4, 1, 128, [5, 200, 33], False, 1e-5),
    (torch.bfloat16, 4, 2, 64, [5, 70], False, 2e-2),
    # bf16 dot products on the cached rows: whole and partial blocks, whole-sequence items
    (torch.bfloat16, 9, 3, 64, [1, 16, 17, 100, 33, 5], False, 2e-2),
    (torch.bfloat16, 8, 2, 128, [40, 9], False, 2e-2),
    # values from the bf16 rows for 1-4 query heads per KV head; 8 take the fp32 copy
    (torch.bfloat16, 2, 2, 64, [9, 64], False, 2e-2),
    (torch.bfloat16, 16, 2, 64, [20, 3], False, 2e-2),
    (torch.float32, 8, 2, 64, [33, 150], True, 1e-5),
]


@pytest.mark.parametrize("native", [True, False], ids=["c-kernel", "sdpa"])
@pytest.mark.parametrize("dtype, hq, hkv, d, lens, fp8, tol", DECODE_CASES)
def test_decode_attention_cpu_equals_reference(
    dtype, hq, hkv, d, lens, fp8, tol, native, monkeypatch
):
    if not native:
        monkeypatch.setattr(cpu_native, "library", lambda: None)
    elif cpu_native.library() is None:
        pytest.skip(cpu_isa.why_missing("none"))
    (q, k, v, ks, vs, tables, ctx), scale = _paged_case(dtype, hq, hkv, d, lens, fp8=fp8)
    plan = decode_plan(tables, lens, k.shape[1])
    assert (plan.gather is None) == native
    out = decode_attention_cpu(q, k, v, ks, vs, plan, scale)
    expected = decode_attention_reference(q, k, v, ks, vs, tables, ctx, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


PREFILL_CASES = [
    # dtype, hq, hkv, d, new lengths, prefix lengths, fp8, tolerance
    (torch.float32, 9, 3, 64, [40], [0], False, 1e-5),
    (torch.float32, 8, 2, 64, [7, 30, 1], [0, 20, 33], False, 1e-5),  # prefixes, a 1-token row
    (torch.float32, 4, 4, 64, [16, 5], [16, 0], False, 1e-5),
    (torch.bfloat16, 4, 2, 64, [20, 9], [3, 0], False, 2e-2),
    (torch.float32, 8, 2, 64, [12, 18], [17, 0], True, 1e-5),
]


@pytest.mark.parametrize("native", [True, False], ids=["c-kernel-where-it-applies", "sdpa"])
@pytest.mark.parametrize("dtype, hq, hkv, d, new, prefix, fp8, tol", PREFILL_CASES)
def test_prefill_attention_cpu_equals_reference(
    dtype, hq, hkv, d, new, prefix, fp8, tol, native, monkeypatch
):
    if not native:
        monkeypatch.setattr(cpu_native, "library", lambda: None)
    args, scale = _case(dtype, hq, hkv, d, new, prefix, fp8=fp8)
    q, k, v, cu, prefix_lens, kc, vc, ks, vs, tables = args
    plan = prefill_plan(cu.tolist(), prefix_lens.tolist(), tables, kc.shape[1])
    out = prefill_attention_cpu(q, k, v, kc, vc, ks, vs, plan, scale)
    expected = prefill_attention_reference(*args, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def test_rmsnorm_cpu_is_the_reference_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for rows in (1, 7, 300):
        x, r = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g)
        w = torch.randn(576, generator=g)
        assert torch.equal(rmsnorm_cpu(x, w, 1e-5), rmsnorm_reference(x, w, 1e-5))
        out, residual = rmsnorm_cpu(x, w, 1e-6, r)
        expected, expected_residual = rmsnorm_reference(x, w, 1e-6, r)
        assert torch.equal(out, expected) and torch.equal(residual, expected_residual)


def test_store_kv_cpu_equals_reference_with_and_without_skipped_slots():
    g = torch.Generator().manual_seed(0)
    for slots in ([5, 6, 7, 40, 41], [3, -1, 9, -1]):
        slot_mapping = torch.tensor(slots)
        k = torch.randn(len(slots), 2, 8, generator=g)
        v = torch.randn(len(slots), 2, 8, generator=g)
        caches = [torch.zeros(4, 16, 2, 8) for _ in range(4)]
        store_kv_cpu(k, v, caches[0], caches[1], slot_mapping)
        store_kv_reference(k, v, caches[2], caches[3], None, None, slot_mapping)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_rotary_is_hf_rotate_half_bit_for_bit():
    rope = RotaryEmbedding(RopeConfig(theta=1e5), 64, 2048)
    positions = torch.randint(0, 2048, (300,), generator=torch.Generator().manual_seed(1))
    x = torch.randn(300, 12, 64)
    half = torch.arange(0, 64, 2, dtype=torch.int64).float() / 64
    angles = positions[:, None].float() * (1.0 / (1e5**half))[None]
    angles = torch.cat((angles, angles), -1)[:, None]
    rotated = torch.cat((-x[..., 32:], x[..., :32]), -1)
    expected = x * angles.cos() + rotated * angles.sin()  # transformers' apply_rotary_pos_emb
    assert torch.equal(apply_rotary(x, *rope.tables(positions, torch.float32)), expected)


@pytest.mark.parametrize("name", ["torch", "onednn", "onednn-packed", "openblas"])
def test_every_gemm_backend_computes_the_linear(name):
    x, w, b = torch.randn(5, 64), torch.randn(48, 64), torch.randn(48)
    backend = GemmPlan().backend(name)
    torch.testing.assert_close(backend(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(backend(x, w, None), F.linear(x, w), atol=1e-5, rtol=1e-5)


def _onednn_packs_bf16() -> bool:
    """oneDNN reorders bf16 weights only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT."""
    try:
        PackedOneDNN().pack(torch.randn(16, 32).bfloat16())
    except RuntimeError:
        return False
    return True


def test_packed_onednn_weights_give_onednns_bits_in_bf16():
    # bf16 (the CPU dtype where packing pays most) rounds alike on either layout; fp32's
    # one-row GEMV takes another oneDNN kernel there, equal within rounding. An AVX2 CPU
    # cannot pack bf16 (nor does dtype auto pick bf16 there): fp32 only.
    packed = PackedOneDNN()
    dtypes = (torch.bfloat16, torch.float32) if _onednn_packs_bf16() else (torch.float32,)
    for dtype in dtypes:
        w, b = torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype)
        for rows in (1, 3, 8, 32, 100):
            x = torch.randn(rows, 64).to(dtype)
            got, want = packed(x, w, b), BACKENDS["onednn"](x, w, b)
            if dtype == torch.bfloat16:
                assert torch.equal(got, want), rows
            else:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_packings_follow_their_weights_not_their_addresses():
    packed = PackedOneDNN()
    x = torch.randn(2, 32)
    for _ in range(3):  # each new weight may reuse the freed one's memory
        w = torch.randn(16, 32)
        torch.testing.assert_close(packed(x, w, None), F.linear(x, w), atol=1e-5, rtol=1e-5)
    del w
    import gc

    gc.collect()
    assert len(packed._packed) == 0  # no packing outlives its weight


def test_a_plan_packs_its_weights_up_front_only_when_it_uses_packing():
    weights = [torch.randn(16, 32), torch.randn(32, 16)]
    packing = GemmPlan(choices={1: "onednn", 8: "onednn-packed"})
    packing.prepare(weights)
    assert len(packing.packed._packed) == 2  # no request pays for the reorder
    plain = GemmPlan(choices={1: "onednn", 8: "torch"})
    plain.prepare(weights)
    assert len(plain.packed._packed) == 0


def test_a_plan_naming_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown CPU GEMM backend"):
        GemmPlan(choices={1: "mkl-magic"})


def test_gemm_plan_measures_each_bucket_and_routes_by_rows():
    weights = [torch.randn(96, 64), torch.randn(64, 96)] * 4
    plan = GemmPlan.measure(weights, buckets=(1, 8, 64))
    assert set(plan.choices) == {1, 8, 64}
    assert all(
        set(t) <= set(available_backends(torch.float32, torch.get_num_threads()))
        for t in plan.timings_ms.values()
    )
    routed = GemmPlan(choices={1: "openblas", 8: "onednn", 64: "torch"})
    assert [routed.choice_for(n) for n in (1, 5, 64, 10_000)] == [
        "openblas", "onednn", "torch", "torch"
    ]  # fmt: skip
    assert GemmPlan().backend("onednn-packed").__class__ is PackedOneDNN
    assert GemmPlan().backend("openblas") is BACKENDS["openblas"]
    x, w = torch.randn(3, 64), torch.randn(2 * 32, 64)
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    torch.testing.assert_close(routed.linear(x, w, activation="silu_mul"), F.silu(gate) * up)


def test_a_shape_whose_own_fastest_backend_differs_runs_on_it(tmp_path, monkeypatch):
    """Above COLD_SWEEP_ROWS each weight shape is timed apart: the bucket keeps the backend
    fastest over all shapes, and a shape where another one wins runs on that one."""
    import time

    from engine import cpu_gemm

    slow_on = {"torch": (64, 96), "onednn": (96, 64)}  # each backend's slow shape

    def backend(name):
        def run(x, weight, bias):
            time.sleep(0.004 if tuple(weight.shape) == slow_on[name] else 0.0)
            return F.linear(x, weight, bias)

        return run

    monkeypatch.setattr(cpu_gemm, "available_backends", lambda dtype, threads: ["torch", "onednn"])
    monkeypatch.setitem(cpu_gemm.BACKENDS, "torch", backend("torch"))
    monkeypatch.setitem(cpu_gemm.BACKENDS, "onednn", backend("onednn"))
    # three 96x64 weights to one 64x96: oneDNN loses the bucket, but wins the 64x96 shape
    weights = [torch.randn(96, 64), torch.randn(96, 64), torch.randn(96, 64), torch.randn(64, 96)]
    rows = cpu_gemm.COLD_SWEEP_ROWS * 2
    plan = GemmPlan.measure(weights, buckets=(rows,), cold_layers=1)
    assert plan.choices == {rows: "torch"}
    assert plan.shape_choices == {rows: {"64x96": "onednn"}}
    assert plan.timings_ms[rows]["onednn"] > plan.timings_ms[rows]["torch"]
    assert plan.choice_for(rows, shape=torch.Size([64, 96])) == "onednn"
    assert plan.choice_for(rows, shape=torch.Size([96, 64])) == "torch"
    assert plan.choice_for(rows, fallback=True, shape=torch.Size([64, 96])) == "torch"
    assert plan._route(rows, torch.Size([64, 96]))[0] is cpu_gemm.BACKENDS["onednn"]
    assert "64x96:onednn" in plan.describe()
    # kept on disk with the plan: another replica routes the same
    monkeypatch.setattr(
        cpu_gemm.GemmPlan, "measure", staticmethod(lambda ws, **kw: plan), raising=True
    )
    cpu_gemm.cached_plan(weights, tmp_path)
    again = cpu_gemm.cached_plan(weights, tmp_path)
    assert again is not plan and again.shape_choices == plan.shape_choices
    with pytest.raises(ValueError, match="unknown CPU GEMM backend"):
        GemmPlan(choices={rows: "torch"}, shape_choices={rows: {"64x96": "mkl-magic"}})


def test_openblas_is_offered_only_to_single_thread_workers():
    assert "openblas" in available_backends(torch.float32, 1)
    assert "openblas" not in available_backends(torch.float32, 2)
    assert "openblas" not in available_backends(torch.bfloat16, 1)


def test_the_plan_is_measured_once_per_machine_and_shared(tmp_path, monkeypatch):
    from engine import cpu_gemm

    weights = [torch.randn(48, 32), torch.randn(32, 48)]
    measured = []
    real = cpu_gemm.GemmPlan.measure

    def counting(ws, **kw):
        measured.append(1)
        return real(ws, buckets=(1, 8), **kw)

    monkeypatch.setattr(cpu_gemm.GemmPlan, "measure", staticmethod(counting))
    first = cpu_gemm.cached_plan(weights, tmp_path)
    second = cpu_gemm.cached_plan(weights, tmp_path)  # another replica on this machine
    assert measured == [1] and second.choices == first.choices
    cpu_gemm.cached_plan([torch.randn(64, 32)], tmp_path)  # other shapes: their own plan
    assert measured == [1, 1]
