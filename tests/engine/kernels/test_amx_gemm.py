"""The AMX bf16 GEMM (engine.kernels.amx_gemm) against fp32 torch, against oneDNN's bits,
and as a GemmPlan backend with its fallback."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_isa
from engine.cpu_gemm import GemmPlan
from engine.kernels.amx_gemm import AmxGemm, amx_available
from engine.kernels.fused_cpu import silu_mul_native

needs_amx = pytest.mark.skipif(
    not amx_available(), reason=f"{cpu_isa.why_missing('amx')}: other GEMM backends run"
)


def _case(rows: int, out_features: int, in_features: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    return x, w, b


@needs_amx
# 1-16 rows: one row tile against 3 column blocks at a time; more: 2 row tiles x 2 column
# blocks, x in chunks of 256 rows (a last tile of 1-15 rows, a lone last row tile or block).
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 33, 100, 256, 273, 290])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (48, 64), (16, 32)])
def test_amx_gemm_matches_fp32_torch(rows, shape):
    x, w, b = _case(rows, *shape)
    amx = AmxGemm()
    for bias in (None, b):
        out = amx(x, w, bias)
        expected = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        assert out.dtype == torch.bfloat16 and out.shape == (rows, shape[0])
        # fp32 sums of exact products, rounded once: within bf16's rounding of the result
        torch.testing.assert_close(out.float(), expected, rtol=8e-3, atol=1e-4)


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 32])
def test_amx_gemm_gives_onednns_bits_up_to_32_rows(rows):
    x, w, b = _case(rows, 960, 576, seed=1)
    amx = AmxGemm()
    assert torch.equal(amx(x, w, None), F.linear(x, w))
    assert torch.equal(amx(x, w, b), F.linear(x, w, b))


@needs_amx
# from 256 rows a thread the threads share rows, below it column pairs: the same bits either
# way (a last tile of 1-15 rows in a thread's share or in the last; an odd column block)
@pytest.mark.parametrize("rows", [511, 512, 530, 1000])
@pytest.mark.parametrize("shape", [(576, 576), (48, 64), (960, 576)])
def test_threads_sharing_rows_or_columns_give_the_same_bits(rows, shape):
    x, w, b = _case(rows, *shape, seed=3)
    amx = AmxGemm()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = amx(x, w, b)
        torch.set_num_threads(2)
        shared = amx(x, w, b)
        torch.set_num_threads(3)  # shares of unequal size
        thirds = amx(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(shared, alone) and torch.equal(thirds, alone)
    expected = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(alone.float(), expected, rtol=8e-3, atol=1e-4)


@needs_amx
def test_a_rows_result_does_not_depend_on_the_other_rows():
    x, w, _ = _case(300, 576, 1536, seed=2)
    amx = AmxGemm()
    together = amx(x, w, None)
    for row in (0, 15, 16, 39, 255, 256, 299):  # few-row and many-row loops, both chunks
        assert torch.equal(amx(x[row : row + 1], w, None), together[row : row + 1])
        assert torch.equal(amx(x[row : row + 20], w, None), together[row : row + 20])


@needs_amx
def test_an_output_streamed_past_the_caches_has_the_bits_of_cached_writes():
    # 700 x 3,072 bf16 outgrows STREAM_BYTES (4 MiB): the kernel streams y's lines; calls of
    # 100 rows write theirs through the caches
    x, w, b = _case(700, 3072, 576, seed=3)
    amx = AmxGemm()
    streamed = amx(x, w, b)
    cached = torch.cat([amx(x[i : i + 100], w, b) for i in range(0, 700, 100)])
    assert torch.equal(streamed, cached)
    torch.testing.assert_close(
        streamed.float(), F.linear(x.float(), w.float(), b.float()), rtol=8e-3, atol=1e-4
    )


@needs_amx
def test_amx_gemm_reads_strided_rows_and_empty_batches():
    wide = torch.randn(8, 1200).bfloat16()
    x = wide[:, :576]  # rows 1200 apart
    w = torch.randn(960, 576).bfloat16()
    amx = AmxGemm()
    assert torch.equal(amx(x, w, None), amx(x.contiguous(), w, None))
    assert amx(torch.empty(0, 576, dtype=torch.bfloat16), w, None).shape == (0, 960)


def test_what_amx_does_not_take_is_declined():
    amx = AmxGemm()
    w = torch.randn(960, 576).bfloat16()
    assert amx(torch.randn(2, 576), w, None) is None  # fp32 input
    assert amx(torch.randn(2, 576).bfloat16(), w.float(), None) is None  # fp32 weight
    assert amx(torch.randn(2, 560).bfloat16(), torch.randn(16, 560).bfloat16(), None) is None
    assert amx(torch.randn(2, 64).bfloat16(), torch.randn(24, 64).bfloat16(), None) is None
    assert amx(torch.randn(2, 576).bfloat16(), w, torch.randn(960)) is None  # fp32 bias
    if amx_available():
        with pytest.raises(ValueError, match="576 features"):
            amx(torch.randn(2, 576).bfloat16(), torch.randn(16, 64).bfloat16(), None)


@needs_amx
def test_amx_packings_follow_their_weights():
    amx = AmxGemm()
    x = torch.randn(2, 64).bfloat16()
    for _ in range(3):  # a new weight may reuse the freed one's memory
        w = torch.randn(32, 64).bfloat16()
        # fp32, not torch's bf16 GEMM: for a shape this small it may sum in another order
        expected = F.linear(x.float(), w.float())
        torch.testing.assert_close(amx(x, w, None).float(), expected, rtol=8e-3, atol=1e-4)
    del w
    gc.collect()
    assert len(amx._packed) == 0


@needs_amx
# 17 rows and up (fewer decline); a last tile of 1-15 rows, a lone last row tile, chunks of 256
@pytest.mark.parametrize("rows", [17, 32, 33, 100, 256, 273, 290])
@pytest.mark.parametrize("shape", [(3072, 576), (64, 96), (32, 32)])
def test_amx_silu_mul_gives_the_bits_of_the_gemm_then_silu_mul(rows, shape):
    x, w, b = _case(rows, *shape)
    x = x * 4  # gates from ~-30 to 30: SiLU's saturated ends and its curve
    amx = AmxGemm()
    for bias in (None, b):
        fused = amx.silu_mul(x, w, bias)
        assert fused.shape == (rows, shape[0] // 2)
        assert torch.equal(
            fused.view(torch.int16), silu_mul_native(amx(x, w, bias)).view(torch.int16)
        )


@needs_amx
def test_amx_silu_mul_declines_few_rows_and_halves_of_partial_blocks():
    amx = AmxGemm()
    x, w, _ = _case(16, 64, 32)
    assert amx.silu_mul(x, w, None) is None  # decode's few rows: the GEMM, then SiLU
    x, w, _ = _case(40, 48, 32)  # 24 outputs a half: not whole column blocks
    assert amx.silu_mul(x, w, None) is None
    assert amx.silu_mul(x.float(), w.float(), None) is None


@needs_amx
@pytest.mark.parametrize("choice", ["amx", "torch"])
def test_a_plan_fuses_silu_mul_where_it_runs_amx_only(choice, monkeypatch):
    x, w, b = _case(40, 64, 96)
    plan = GemmPlan(choices={64: choice}, fallback_choices={64: "torch"})
    calls = []
    real = plan.amx.silu_mul
    monkeypatch.setattr(plan.amx, "silu_mul", lambda *a: calls.append(1) or real(*a))
    out = plan.linear(x, w, b, activation="silu_mul")
    assert calls == ([1] if choice == "amx" else [])
    gemm = AmxGemm()(x, w, b) if choice == "amx" else F.linear(x, w, b)
    assert torch.equal(out, silu_mul_native(gemm))


def test_a_plan_on_amx_runs_the_weights_it_declines_on_its_fallback():
    plan = GemmPlan(choices={1: "amx", 8: "torch"}, fallback_choices={1: "torch", 8: "torch"})
    odd = torch.randn(24, 64).bfloat16()  # 24 outputs: not whole tiles
    x = torch.randn(1, 64).bfloat16()
    assert torch.equal(plan.gemm(x, odd, None), F.linear(x, odd))
    assert torch.equal(plan.gemm(x.float(), odd.float(), None), F.linear(x.float(), odd.float()))
    with pytest.raises(ValueError, match="a fallback cannot be"):
        GemmPlan(choices={1: "amx"}, fallback_choices={1: "amx"})
    unused = GemmPlan(choices={1: "torch"})
    unused.amx.pack(torch.randn(32, 64).bfloat16())
    unused.prepare([])
    assert len(unused.amx._packed) == 0  # a measurement's packings go when unused


@needs_amx
def test_measuring_bf16_weights_times_amx_and_packs_what_it_chooses():
    weights = [torch.randn(96, 64).bfloat16(), torch.randn(64, 96).bfloat16()] * 2
    plan = GemmPlan.measure(weights, buckets=(1, 32))
    assert all("amx" in t for t in plan.timings_ms.values())
    assert all(plan.fallback_choices[b] != "amx" for b in (1, 32))
    plan.prepare(weights)
    if "amx" in plan.choices.values():
        assert len(plan.amx._packed) == 2
    fp32 = GemmPlan.measure([w.float() for w in weights], buckets=(1,))
    assert "amx" not in fp32.timings_ms[1]


@needs_amx
def test_a_plan_measures_the_fused_silu_mul_keeps_it_and_packs_for_it(tmp_path, monkeypatch):
    from engine import cpu_gemm

    gate_up = torch.randn(128, 64).bfloat16()
    weights = [torch.randn(96, 64).bfloat16(), gate_up, torch.randn(64, 64).bfloat16()]
    plan = GemmPlan.measure(weights, buckets=(8, 32), silu_mul_weights=[gate_up])
    assert set(plan.silu_mul_fused) == {32}  # 8 rows: the fused pass declines
    real = cpu_gemm.GemmPlan.measure
    monkeypatch.setattr(
        cpu_gemm.GemmPlan, "measure", staticmethod(lambda ws, **kw: real(ws, buckets=(32,), **kw))
    )
    stored = cpu_gemm.cached_plan(weights, tmp_path, silu_mul_weights=[gate_up])
    again = cpu_gemm.cached_plan(weights, tmp_path, silu_mul_weights=[gate_up])
    assert again.silu_mul_fused == stored.silu_mul_fused and set(again.silu_mul_fused) == {32}
    fused = GemmPlan(choices={32: "torch"}, silu_mul_fused={32: True})
    fused.prepare(weights, [gate_up])
    assert list(fused.amx._packed) == [gate_up]  # packed at start-up, not on first use
    x = torch.randn(20, 64).bfloat16()
    out = fused.linear(x, gate_up, activation="silu_mul")
    assert torch.equal(out, silu_mul_native(AmxGemm()(x, gate_up, None)))
    GemmPlan(choices={32: "torch"}, silu_mul_fused={32: False}).prepare(weights, [gate_up])


@needs_amx
def test_a_fused_gate_up_leaves_the_other_shapes_to_their_fastest_backend(monkeypatch):
    """Where gate_up runs as the fused AMX pass, its plain GEMM's time (the largest of a layer)
    is left out of the bucket's choice: the backend fastest on the other shapes runs them, and
    gate_up's own fastest stays its fallback."""
    import time

    from engine import cpu_gemm

    gate_up = torch.randn(128, 64).bfloat16()
    others = [torch.randn(96, 64).bfloat16(), torch.randn(64, 64).bfloat16()]
    slow_ms = {"torch": {(128, 64): 20}, "onednn": {(128, 64): 10, (96, 64): 2, (64, 64): 2}}

    def backend(name):
        def run(x, weight, bias):
            time.sleep(slow_ms[name].get(tuple(weight.shape), 0) / 1e3)
            return F.linear(x, weight, bias)

        return run

    def slow_amx(self, x, weight, bias):
        time.sleep(0.03)  # the plain AMX GEMM out of the running; its fused pass is real
        return F.linear(x, weight, bias)

    monkeypatch.setattr(cpu_gemm, "available_backends", lambda dtype, threads: ["torch", "onednn"])
    monkeypatch.setitem(cpu_gemm.BACKENDS, "torch", backend("torch"))
    monkeypatch.setitem(cpu_gemm.BACKENDS, "onednn", backend("onednn"))
    monkeypatch.setattr(cpu_gemm.AmxGemm, "__call__", slow_amx)
    rows = cpu_gemm.COLD_SWEEP_ROWS * 2
    plan = GemmPlan.measure(
        [*others, gate_up], buckets=(rows,), cold_layers=1, silu_mul_weights=[gate_up]
    )
    assert plan.silu_mul_fused == {rows: True}
    # over all three shapes oneDNN (14 ms) beats torch (20 ms); without gate_up, torch (0 ms)
    assert plan.choices == {rows: "torch"}
    assert plan.shape_choices == {rows: {"128x64": "onednn"}}
    assert plan.choice_for(rows, shape=torch.Size([96, 64])) == "torch"


@needs_amx
def test_a_shape_leaves_row_sharing_amx_only_for_a_much_faster_backend():
    """Where AMX is a bucket's choice and shares its rows among the threads, another backend
    takes a shape only if it beats AMX there by ROW_SHARING_MARGIN (the sweep cannot see what
    the rows' locality saves in a forward); with one thread, by SHAPE_MARGIN as before."""
    from engine import cpu_gemm

    rows = 2048
    by_shape = {
        "576x1536": {"amx": 10.0, "onednn": 20.0},
        "960x576": {"amx": 10.0, "onednn": 9.0},  # 10% faster: within the sharing margin
        "576x576": {"amx": 10.0, "onednn": 7.0},  # 30% faster: past it
    }
    timings = cpu_gemm._bucket_timings(by_shape, ["amx", "onednn"])
    threads = torch.get_num_threads()
    chosen = {}
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            plan = GemmPlan()
            plan._choose(rows, timings, by_shape, ["onednn"])
            assert plan.choices == {rows: "amx"}
            chosen[count] = plan.shape_choices[rows]
    finally:
        torch.set_num_threads(threads)
    assert chosen[1] == {"960x576": "onednn", "576x576": "onednn"}
    assert chosen[2] == {"576x576": "onednn"}


@needs_amx
def test_amx_and_onednn_calls_interleave_in_the_same_threads():
    """oneDNN runs its own AMX kernels (prefill's row counts) on the same OpenMP threads;
    each call sets up its tiles, so neither disturbs the other."""
    from engine.cpu_gemm import PackedOneDNN

    amx, onednn = AmxGemm(), PackedOneDNN()
    weights = [_case(1, 960, 576, seed=s)[1] for s in range(2)] + [_case(1, 576, 1536)[1]]
    small = {k: torch.randn(7, k).bfloat16() for k in (576, 1536)}
    large = {k: torch.randn(300, k).bfloat16() for k in (576, 1536)}
    expected_small = [F.linear(small[w.shape[1]], w) for w in weights]
    expected_large = [onednn(large[w.shape[1]], w, None).clone() for w in weights]
    for _ in range(5):
        for w, want_small, want_large in zip(weights, expected_small, expected_large, strict=True):
            assert torch.equal(amx(small[w.shape[1]], w, None), want_small)
            assert torch.equal(onednn(large[w.shape[1]], w, None), want_large)
