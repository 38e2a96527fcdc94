"""The C attention kernels against the torch references: paged decode attention
(engine/kernels/attention_cpu.c), bf16 causal prefill (prefill_attention_cpu.c), and the
SDPA paths they replace where no C compiler (or no AVX-512 BF16) is at hand."""

import pytest
import torch

from engine import cpu_isa
from engine.kernels import cpu_attention, cpu_native
from engine.kernels.cpu_attention import (
    decode_attention_cpu,
    decode_plan,
    prefill_attention_cpu,
    prefill_plan,
)
from engine.kernels.decode_attention import decode_attention_reference
from engine.kernels.prefill_attention import prefill_attention_reference
from tests.engine.kernels.test_decode_attention import _paged_case
from tests.engine.kernels.test_prefill_attention import _case

needs_c = pytest.mark.skipif(
    cpu_native.library() is None,
    reason=f"{cpu_isa.why_missing('none')}: decode attention runs in SDPA",
)

CASES = [
    # dtype, hq, hkv, d, context lengths, fp8, tolerance against the fp32 reference
    (torch.float32, 9, 3, 64, [1, 17, 40, 16], False, 1e-5),  # smollm2's heads
    (torch.float32, 8, 8, 128, [5, 200], False, 1e-5),  # no GQA, long head
    (torch.float32, 4, 1, 40, [33, 3], False, 1e-5),  # D with a tail past 16 lanes
    (torch.bfloat16, 9, 3, 64, [5, 70, 130], False, 8e-3),  # one bf16 rounding at the end
    (torch.float16, 4, 2, 64, [19, 64], False, 2e-3),
    (torch.float32, 8, 2, 64, [33, 150], True, 1e-5),  # fp8 cache with per-block scales
    (torch.bfloat16, 8, 2, 64, [33, 9], True, 8e-3),
    (torch.bfloat16, 8, 2, 64, [33, 9, 1, 48, 16], True, 8e-3),  # whole sequences per thread
]


@needs_c
@pytest.mark.parametrize("dtype, hq, hkv, d, lens, fp8, tol", CASES)
def test_c_kernel_equals_reference(dtype, hq, hkv, d, lens, fp8, tol):
    # Rows outside every context hold NaN (see _paged_case): never read, or the output is NaN.
    (q, k, v, ks, vs, tables, ctx), scale = _paged_case(dtype, hq, hkv, d, lens, fp8=fp8)
    plan = decode_plan(tables, lens, k.shape[1])
    assert plan.gather is None  # the C kernel, not SDPA
    out = decode_attention_cpu(q, k, v, ks, vs, plan, scale)
    expected = decode_attention_reference(q, k, v, ks, vs, tables, ctx, scale)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@needs_c
@pytest.mark.parametrize(
    "dtype, fp8", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_strided_queries_and_thread_counts_give_the_same_bits(dtype, fp8):
    """One thread takes whole sequences (every KV head of a block in one pass), two threads
    (sequence, KV head) pairs here: the same sums in the same order either way."""
    (q, k, v, ks, vs, tables, ctx), scale = _paged_case(dtype, 9, 3, 64, [50, 7, 90], fp8=fp8)
    plan = decode_plan(tables, ctx.tolist(), k.shape[1])
    fused = torch.cat([q, torch.randn(3, 3, 64).to(q.dtype)], dim=1)  # [B, Hq + Hkv, D]: qk
    strided = fused[:, :9]
    assert not strided.is_contiguous()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_attention_cpu(strided, k, v, ks, vs, plan, scale)
        torch.set_num_threads(2)
        two = decode_attention_cpu(q, k, v, ks, vs, plan, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_c
def test_an_empty_context_gives_zeros():
    (q, k, v, ks, vs, tables, ctx), scale = _paged_case(torch.float32, 4, 2, 64, [3, 20])
    plan = decode_plan(tables, [0, 20], k.shape[1])
    out = decode_attention_cpu(q, k, v, ks, vs, plan, scale)
    expected = decode_attention_reference(q, k, v, ks, vs, tables, plan.context_lens, scale)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_c
def test_bad_inputs_get_clear_errors_not_a_crash():
    (q, k, v, ks, vs, tables, ctx), scale = _paged_case(torch.float32, 4, 2, 64, [3, 20])
    plan = decode_plan(tables, ctx.tolist(), k.shape[1])
    with pytest.raises(ValueError, match="block table names block"):
        decode_attention_cpu(q, k[:2], v[:2], ks, vs, plan, scale)  # ids past the cache
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention_cpu(q[..., :32], k, v, ks, vs, plan, scale)
    with pytest.raises(ValueError, match="does not fit a block table"):
        decode_plan(tables, [3, tables.shape[1] * 16 + 1], k.shape[1])


def test_without_a_compiler_sdpa_serves_decode(monkeypatch):
    monkeypatch.setattr(cpu_native, "library", lambda: None)
    (q, k, v, ks, vs, tables, ctx), scale = _paged_case(torch.bfloat16, 9, 3, 64, [5, 70])
    plan = cpu_attention.decode_plan(tables, ctx.tolist(), k.shape[1])
    assert plan.gather is not None
    out = decode_attention_cpu(q, k, v, ks, vs, plan, scale)
    expected = decode_attention_reference(q, k, v, ks, vs, tables, ctx, scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


needs_bf16_prefill = pytest.mark.skipif(
    cpu_native.library() is None or not cpu_native.library().prefill_attention_bf16_available(),
    reason=f"{cpu_isa.why_missing('avx512')}: bf16 prefill attention runs in SDPA",
)

PREFILL_CASES = [
    # hq, hkv, d, new lengths, prefix lengths
    (9, 3, 64, [1, 5, 70], [0, 0, 0]),  # smollm2's heads; rows past a 6-row block
    (9, 3, 64, [130, 7], [23, 64]),  # a cached prefix, tiles that straddle it
    (8, 8, 128, [40], [0]),  # no GQA, a long head (the AMX kernel declines: AVX-512 BF16)
    (4, 2, 32, [200, 3], [0, 150]),
    (9, 3, 64, [600, 45], [0, 1000]),  # many of the AMX kernel's 128-key chunks
]

_needs_amx_prefill = pytest.mark.skipif(
    cpu_native.library() is None or not cpu_native.library().prefill_attention_amx_available(),
    reason=f"{cpu_isa.why_missing('amx')}: the AVX-512 BF16 prefill kernel (or SDPA) runs",
)
PREFILL_KERNELS = ["avx512_bf16", pytest.param("amx", marks=_needs_amx_prefill)]


def _only_kernel(monkeypatch, kernel: str):
    """Route bf16 prefill through one C kernel (the AMX one is preferred where present)."""
    if kernel == "avx512_bf16":  # None where the test takes the library away
        monkeypatch.setattr(
            cpu_attention,
            "_prefill_kernel",
            lambda d: (
                cpu_native.library()
                and cpu_attention.PrefillKernel(
                    "avx512_bf16", cpu_native.library().prefill_attention_bf16
                )
            ),
        )


def _record_c_kernel_sequences(monkeypatch) -> list:
    """The sequences prefill attention hands its C kernel from now on, in order."""
    ran = []
    real = cpu_attention._prefill_attention_native
    monkeypatch.setattr(
        cpu_attention,
        "_prefill_attention_native",
        lambda *a: ran.extend(a[8].sequences) or real(*a),
    )
    return ran


@needs_bf16_prefill
@pytest.mark.parametrize("kernel", PREFILL_KERNELS)
@pytest.mark.parametrize("hq, hkv, d, new, prefix", PREFILL_CASES)
def test_bf16_prefill_kernel_equals_reference(hq, hkv, d, new, prefix, kernel, monkeypatch):
    _only_kernel(monkeypatch, kernel)
    args, scale = _case(torch.bfloat16, hq, hkv, d, new, prefix)
    q, k, v, cu, prefix_lens, kc, vc, ks, vs, tables = args
    plan = prefill_plan(cu.tolist(), prefix_lens.tolist(), tables, kc.shape[1])
    ran = _record_c_kernel_sequences(monkeypatch)
    monkeypatch.setattr(cpu_attention, "native_prefill_wins", lambda *a: True)  # SDPA may win here
    out = prefill_attention_cpu(q, k, v, kc, vc, ks, vs, plan, scale)
    assert len(ran) == len(new)  # every sequence through the C kernel
    expected = prefill_attention_reference(*args, scale)  # fp32 throughout
    assert not out.isnan().any()
    # SDPA in bf16 is as far from the fp32 reference: both round the probabilities to bf16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@needs_bf16_prefill
@pytest.mark.parametrize("kernel", PREFILL_KERNELS)
def test_an_fp8_cache_is_read_by_the_amx_kernel_and_skipped_by_the_other(kernel, monkeypatch):
    """A prompt with no cached prefix reads no page, so an fp8 cache keeps it on either C
    kernel; the AMX kernel also widens fp8 prefix pages (value times its block's scale,
    rounded to bf16, as the torch path), where the AVX-512 BF16 kernel leaves them to SDPA."""
    _only_kernel(monkeypatch, kernel)
    args, scale = _case(torch.bfloat16, 9, 3, 64, [70, 30, 5, 200], [0, 40, 0, 300], fp8=True)
    q, k, v, cu, prefix_lens, kc, vc, ks, vs, tables = args
    plan = prefill_plan(cu.tolist(), prefix_lens.tolist(), tables, kc.shape[1])
    ran = _record_c_kernel_sequences(monkeypatch)
    monkeypatch.setattr(cpu_attention, "native_prefill_wins", lambda *a: True)
    out = prefill_attention_cpu(q, k, v, kc, vc, ks, vs, plan, scale)
    assert [seq.prefix for seq in ran] == ([0, 40, 0, 300] if kernel == "amx" else [0, 0])
    expected = prefill_attention_reference(*args, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    if kernel == "amx":  # the same widening as SDPA's path: the same maximum error
        monkeypatch.setattr(cpu_native, "library", lambda: None)
        sdpa = prefill_attention_cpu(q, k, v, kc, vc, ks, vs, plan, scale)
        err, sdpa_err = ((x.float() - expected.float()).abs().max() for x in (out, sdpa))
        assert err <= sdpa_err * 1.5


@_needs_amx_prefill
@pytest.mark.parametrize("q_scale", [2.0, 100.0])  # 100: scores hundreds apart
def test_amx_prefill_rescales_when_a_later_chunk_holds_the_maximum(q_scale, monkeypatch):
    """Keys that grow along the prompt put each query's largest scores in its last key
    chunk: the sums of the earlier chunks are rescaled to it, not overflowed or lost."""
    args, scale = _case(torch.bfloat16, 9, 3, 64, [1500], [0])
    q, k, v, cu, prefix_lens, kc, vc, ks, vs, tables = args
    growth = torch.linspace(0.2, 3.0, 1500)[:, None, None]
    args[1] = k = (k.float() * growth).to(torch.bfloat16)
    args[0] = q = (q.float() * q_scale).to(torch.bfloat16)
    plan = prefill_plan(cu.tolist(), prefix_lens.tolist(), tables, kc.shape[1])
    monkeypatch.setattr(cpu_attention, "native_prefill_wins", lambda *a: True)
    out = prefill_attention_cpu(q, k, v, kc, vc, ks, vs, plan, scale)
    expected = prefill_attention_reference(*args, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@_needs_amx_prefill
def test_amx_prefill_gives_the_same_bits_strided_and_at_any_thread_count(monkeypatch):
    """Each 16 queries of a head are summed by one thread in key order, whichever thread."""
    args, scale = _case(torch.bfloat16, 9, 3, 64, [700, 30], [0, 40])
    q, k, v, cu, prefix_lens, kc, vc, ks, vs, tables = args
    plan = prefill_plan(cu.tolist(), prefix_lens.tolist(), tables, kc.shape[1])
    monkeypatch.setattr(cpu_attention, "native_prefill_wins", lambda *a: True)
    fused = torch.cat([q, k, v], dim=1)  # [T, Hq + 2 Hkv, D]: the qkv projection's rows
    strided_q, strided_k, strided_v = fused[:, :9], fused[:, 9:12], fused[:, 12:]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = prefill_attention_cpu(q, k, v, kc, vc, ks, vs, plan, scale)
        torch.set_num_threads(2)
        two = prefill_attention_cpu(strided_q, strided_k, strided_v, kc, vc, ks, vs, plan, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@_needs_amx_prefill
def test_amx_prefill_gives_each_sequence_of_a_batch_the_bits_it_gets_alone(monkeypatch):
    """One call takes the whole batch; no sequence's result depends on the others."""
    new, prefix = [70, 300, 5, 16, 129], [0, 40, 0, 300, 17]
    args, scale = _case(torch.bfloat16, 9, 3, 64, new, prefix)
    q, k, v, cu, prefix_lens, kc, vc, ks, vs, tables = args
    monkeypatch.setattr(cpu_attention, "native_prefill_wins", lambda *a: True)
    plan = prefill_plan(cu.tolist(), prefix_lens.tolist(), tables, kc.shape[1])
    batched = prefill_attention_cpu(q, k, v, kc, vc, ks, vs, plan, scale)
    starts = cu.tolist()
    for b in range(len(new)):
        rows = slice(starts[b], starts[b + 1])
        alone = prefill_plan([0, new[b]], [prefix[b]], tables[b : b + 1], kc.shape[1])
        out = prefill_attention_cpu(q[rows], k[rows], v[rows], kc, vc, ks, vs, alone, scale)
        assert torch.equal(out, batched[rows])


@needs_bf16_prefill
@pytest.mark.parametrize("kernel", PREFILL_KERNELS)
def test_bf16_prefill_is_no_further_from_exact_than_sdpa(kernel, monkeypatch):
    _only_kernel(monkeypatch, kernel)
    args, scale = _case(torch.bfloat16, 9, 3, 64, [300], [0])
    q, k, v, cu, prefix_lens, kc, vc, ks, vs, tables = args
    plan = prefill_plan(cu.tolist(), prefix_lens.tolist(), tables, kc.shape[1])
    expected = prefill_attention_reference(*args, scale).float()
    monkeypatch.setattr(cpu_attention, "native_prefill_wins", lambda *a: True)
    native = prefill_attention_cpu(q, k, v, kc, vc, ks, vs, plan, scale)
    monkeypatch.setattr(cpu_native, "library", lambda: None)
    sdpa = prefill_attention_cpu(q, k, v, kc, vc, ks, vs, plan, scale)
    native_err = (native.float() - expected).abs().max()
    sdpa_err = (sdpa.float() - expected).abs().max()
    assert native_err <= sdpa_err * 1.5


@needs_bf16_prefill
def test_a_prefix_page_past_the_cache_is_refused_before_the_c_kernel_reads_it(monkeypatch):
    args, scale = _case(torch.bfloat16, 9, 3, 64, [40, 9], [0, 16])
    q, k, v, cu, prefix_lens, kc, vc, ks, vs, tables = args
    tables = tables.clone()
    tables[1, 0] = kc.shape[0]  # one past the last block
    plan = prefill_plan(cu.tolist(), prefix_lens.tolist(), tables, kc.shape[1])
    monkeypatch.setattr(cpu_attention, "native_prefill_wins", lambda *a: True)
    with pytest.raises(ValueError, match="prefix page past"):
        prefill_attention_cpu(q, k, v, kc, vc, ks, vs, plan, scale)


@needs_bf16_prefill
@pytest.mark.parametrize("c_kernel_wins", [True, False])
def test_bf16_prefill_takes_the_kernel_measured_faster(c_kernel_wins, monkeypatch):
    args, scale = _case(torch.bfloat16, 9, 3, 64, [40, 9], [0, 16])
    q, k, v, cu, prefix_lens, kc, vc, ks, vs, tables = args
    plan = prefill_plan(cu.tolist(), prefix_lens.tolist(), tables, kc.shape[1])
    asked, ran = [], _record_c_kernel_sequences(monkeypatch)
    monkeypatch.setattr(
        cpu_attention, "native_prefill_wins", lambda *a: asked.append(a) or c_kernel_wins
    )
    out = prefill_attention_cpu(q, k, v, kc, vc, ks, vs, plan, scale)
    assert asked and asked[0] == (9, 3, 64, torch.get_num_threads())
    assert len(ran) == (2 if c_kernel_wins else 0)
    expected = prefill_attention_reference(*args, scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@needs_bf16_prefill
def test_the_prefill_kernel_choice_is_timed_once_per_shape_and_thread_count(monkeypatch):
    cpu_attention.native_prefill_wins.cache_clear()
    threads = torch.get_num_threads()
    timed = []
    real = cpu_attention._best_s
    monkeypatch.setattr(cpu_attention, "_best_s", lambda run: timed.append(1) or real(run))
    first = cpu_attention.native_prefill_wins(4, 2, 32, 1)
    assert isinstance(first, bool) and len(timed) == 2  # the C kernel, then SDPA
    assert cpu_attention.native_prefill_wins(4, 2, 32, 1) is first and len(timed) == 2
    cpu_attention.native_prefill_wins(4, 2, 32, 2)
    assert len(timed) == 4
    assert torch.get_num_threads() == threads  # timed at the asked count, then restored
