"""The C FP8 KV codec (engine/kernels/kv_codec_cpu.c) against the torch reference: bit for
bit, on every float dtype, on the values that exercise its rounding paths."""

import pytest
import torch

from engine import cpu_isa
from engine.kernels import cpu_native, kv_codec
from engine.kernels.kv_codec import (
    dequantize_kv_blocks_cpu,
    dequantize_kv_blocks_reference,
    quantize_kv_blocks_cpu,
    quantize_kv_blocks_reference,
)

pytestmark = pytest.mark.skipif(
    cpu_native.library() is None, reason=f"{cpu_isa.why_missing('none')}: the codec runs in torch"
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other is NaN (NaN payloads may differ)."""
    if a.dtype == kv_codec.FP8_DTYPE:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
        return torch.equal(a, b)
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))


def awkward_blocks(dtype: torch.dtype, shape=(12, 16, 3, 80)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, shape[2], 1, generator=g) * 8
    x[1] = 0  # all-zero block: the 1e-12 floor on amax
    x[2] *= 1e-6  # lands in e4m3's subnormals after scaling... and fp16's
    x[3, 0, 0, :4] = torch.tensor([448.0, -448.0, 0.0009765625, -0.0])  # exact grid points
    x[4, 5, 1, 7] = float("nan")  # NaN: its (block, head) scale is NaN, as torch's amax
    x[5, 2, 2, 3] = float("inf")
    x[6, :, 0, :] = torch.linspace(-3, 3, shape[1] * shape[3]).view(shape[1], shape[3])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_is_the_reference_bit_for_bit(dtype):
    x = awkward_blocks(dtype)
    want_q, want_scale = quantize_kv_blocks_reference(x)
    got_q, got_scale = quantize_kv_blocks_cpu(x)
    assert same_bits(got_scale, want_scale)
    assert same_bits(got_q, want_q)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_dequantize_is_the_reference_bit_for_bit(dtype, out_dtype):
    q, scale = quantize_kv_blocks_reference(awkward_blocks(dtype))
    every_code = torch.arange(256, dtype=torch.uint8).view(1, 16, 1, 16)  # NaN codes included
    for blocks, scales in ((q, scale), (every_code.view(kv_codec.FP8_DTYPE), torch.ones(1, 1))):
        want = dequantize_kv_blocks_reference(blocks, scales, out_dtype)
        assert same_bits(dequantize_kv_blocks_cpu(blocks, scales, out_dtype), want)


def test_strided_and_empty_inputs():
    x = awkward_blocks(torch.bfloat16, (8, 16, 4, 64))[:, :, 1:3]  # a heads slice: strided
    assert not x.is_contiguous()
    want_q, want_scale = quantize_kv_blocks_reference(x)
    got_q, got_scale = quantize_kv_blocks_cpu(x)
    assert same_bits(got_q, want_q) and same_bits(got_scale, want_scale)
    empty_q, empty_scale = quantize_kv_blocks_cpu(torch.empty(0, 16, 2, 64))
    assert empty_q.shape == (0, 16, 2, 64) and empty_scale.shape == (0, 2)


def test_the_dispatcher_takes_the_c_kernel_and_falls_back_without_one(monkeypatch):
    x = awkward_blocks(torch.float32, (8, 16, 3, 32))
    calls = []
    real = kv_codec.quantize_kv_blocks_cpu
    monkeypatch.setattr(kv_codec, "quantize_kv_blocks_cpu", lambda t: calls.append(1) or real(t))
    kv_codec.quantize_kv_blocks(x)
    assert calls == [1]
    monkeypatch.setattr(cpu_native, "library", lambda: None)  # no compiler on this machine
    q, scale = kv_codec.quantize_kv_blocks(x)
    assert calls == [1] and same_bits(q, quantize_kv_blocks_reference(x)[0])


def test_no_native_opts_out(monkeypatch):
    monkeypatch.setenv("PDCLUSTER_NO_NATIVE", "1")
    assert cpu_native.library.__wrapped__() is None


def test_an_unwritable_cache_leaves_the_torch_codec(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("PDCLUSTER_CACHE", str(blocked))  # mkdir under it fails
    assert cpu_native.library.__wrapped__() is None


def test_bad_inputs_get_the_references_errors():
    with pytest.raises(ValueError, match="must be"):
        quantize_kv_blocks_cpu(torch.zeros(4, 16, 2))
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        quantize_kv_blocks_cpu(torch.zeros(1, 16, 2, 8, dtype=torch.int32))
    q, scale = quantize_kv_blocks_cpu(torch.randn(2, 16, 2, 8))
    with pytest.raises(ValueError, match="scale must be float32"):
        dequantize_kv_blocks_cpu(q, scale[:1], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_heads_of_any_width(dtype):
    """Heads of whole 16-lane vectors take the vector path, others the scalar loop: both
    the reference's bits."""
    for head_dim in (16, 24, 8):
        x = awkward_blocks(dtype, (7, 16, 3, head_dim))
        want_q, want_scale = quantize_kv_blocks_reference(x)
        got_q, got_scale = quantize_kv_blocks_cpu(x)
        assert same_bits(got_q, want_q) and same_bits(got_scale, want_scale)
        for out_dtype in DTYPES:
            want = dequantize_kv_blocks_reference(want_q, want_scale, out_dtype)
            assert same_bits(dequantize_kv_blocks_cpu(want_q, want_scale, out_dtype), want)
