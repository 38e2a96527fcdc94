"""Layer codec: passthrough is bit-exact, fp8 stays within e4m3's error bound per element;
several layers encoded / decoded at once give each layer's bytes alone."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.codec import (
    FP8,
    WireSpec,
    decode_chunk,
    decode_layers,
    encode_layer,
    encode_layers,
    layer_chunks,
    stacked_layer_parts,
)
from kv_transfer.errors import FrameError
from tests.kv_transfer.helpers import BLOCK_SIZE, MODEL, equal_bytes, random_blocks

CPU = torch.device("cpu")


def _spec(dtype: torch.dtype) -> WireSpec:
    return WireSpec(BLOCK_SIZE, MODEL.num_kv_heads, MODEL.head_dim, dtype)


def _roundtrip(k, v, wire, num_tokens, cache_dtype, blocks_per_frame=2, **scales):
    encoded = encode_layer(k, v, wire_dtype=wire, num_tokens=num_tokens, **scales)
    spec = _spec(FP8 if wire == "fp8" else k.dtype)
    out = [[], [], [], []]
    for _start, count, payload in layer_chunks(encoded, blocks_per_frame):
        assert len(payload) == spec.chunk_bytes(count)
        for i, t in enumerate(decode_chunk(payload, count, spec, cache_dtype, CPU)):
            if t is not None:
                out[i].append(t)
    return [torch.cat(ts) if ts else None for ts in out]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_passthrough_is_bit_exact(dtype):
    k, v = random_blocks(5, dtype)
    k[0, 0, 0, 0] = float("nan")  # even odd values come through as bits
    k2, v2, ks, vs = _roundtrip(k, v, "passthrough", 5 * BLOCK_SIZE - 3, dtype)
    assert equal_bytes(k2, k) and equal_bytes(v2, v)
    assert ks is None and vs is None


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_fp8_error_within_e4m3_bound(cache_dtype, capsys):
    num_tokens = 4 * BLOCK_SIZE + 5
    k, v = random_blocks(5, torch.float32, seed=3)
    k[-1, 5:] = 1e4  # stale rows past the last token must not coarsen its block's scale
    k2, v2, _, _ = _roundtrip(k, v, "fp8", num_tokens, cache_dtype)
    for name, x, y in (("k", k, k2), ("v", v, v2)):
        x = x.reshape(-1, BLOCK_SIZE, *x.shape[2:])
        mask = torch.zeros(x.shape[:2], dtype=torch.bool)
        mask.view(-1)[:num_tokens] = True
        x = torch.where(mask[:, :, None, None], x, 0.0)
        scale = x.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12) / 448.0  # [n,1,H,1]
        err = (y.float() - x).abs()[mask]
        rel = err / scale.expand_as(x)[mask]
        # e4m3: 3 mantissa bits → half an ulp is 2^-4 of the value (normals), 2^-10 of the
        # scale for subnormals; a bf16 cache adds its own rounding (2^-9 of the value).
        extra = 2.0**-9 if cache_dtype == torch.bfloat16 else 1e-6
        bound = x.abs()[mask] * (2.0**-4 + extra) + scale.expand_as(x)[mask] * 2.0**-10 * 1.001
        assert bool((err <= bound).all()), f"{name}: max excess {(err - bound).max()}"
        with capsys.disabled():
            print(
                f"\nfp8 {name} -> {cache_dtype}: mean |err|/scale = {rel.mean():.3f} "
                f"(= {rel.mean() / 448:.2e} of the block amax), max {rel.max():.2f} "
                "(e4m3 half-ulp at the top of the range: 16)"
            )
    # The stale rows were ignored: the last block's K scale comes from its 5 real rows.
    encoded = encode_layer(k, v, wire_dtype="fp8", num_tokens=num_tokens)
    assert float(encoded.k_scale[-1].max()) < 1.0


def test_fp8_pages_go_out_as_they_are_and_land_in_an_fp8_cache():
    k, v = random_blocks(3, torch.float32)
    kq, vq = k.to(FP8), v.to(FP8)
    ks, vs = torch.rand(3, MODEL.num_kv_heads) + 0.5, torch.rand(3, MODEL.num_kv_heads) + 0.5
    k2, v2, ks2, vs2 = _roundtrip(kq, vq, "fp8", 40, FP8, k_scale=ks, v_scale=vs)
    assert equal_bytes(k2, kq) and equal_bytes(v2, vq)
    assert torch.equal(ks2, ks) and torch.equal(vs2, vs)


def test_decode_refuses_wrong_size_and_bad_scales():
    spec = _spec(FP8)
    with pytest.raises(FrameError, match="must be"):
        decode_chunk(b"\0" * (spec.chunk_bytes(1) - 1), 1, spec, torch.float32, CPU)
    payload = bytearray(spec.chunk_bytes(1))  # scales of zero
    with pytest.raises(FrameError, match="scales"):
        decode_chunk(bytes(payload), 1, spec, torch.float32, CPU)


def test_encode_rejects_fp8_passthrough_and_missing_scales():
    k, v = random_blocks(1, torch.float32)
    with pytest.raises(ValueError):
        encode_layer(k.to(FP8), v.to(FP8), wire_dtype="fp8", num_tokens=16)
    with pytest.raises(ValueError):
        encode_layer(k, v[:, :8], wire_dtype="passthrough", num_tokens=16)


@pytest.mark.parametrize("wire", ["passthrough", "fp8"])
def test_layers_encode_and_decode_at_once_as_each_layer_alone(wire):
    """encode_layers / decode_layers over a stack of layers give each layer's bytes and values
    as encode_layer / decode_chunk of that layer alone (the stale rows of the last block
    ignored per layer)."""
    layers, n, num_tokens = 3, 4, 3 * BLOCK_SIZE + 5
    pairs = [random_blocks(n, torch.bfloat16, seed=i) for i in range(layers)]
    for k, _ in pairs:
        k[-1, 5:] = 1e4  # stale rows
    k_layers, v_layers = (torch.stack(t) for t in zip(*pairs, strict=True))
    stacked = encode_layers(k_layers, v_layers, wire_dtype=wire, num_tokens=num_tokens)
    parts = stacked_layer_parts(stacked)
    spec = _spec(FP8 if wire == "fp8" else torch.bfloat16)
    for i, (k, v) in enumerate(pairs):
        alone = encode_layer(k, v, wire_dtype=wire, num_tokens=num_tokens)
        [(_, _, payload)] = layer_chunks(alone, n)
        assert b"".join(parts[i]) == payload
    frame = b"".join(b"".join(p) for p in parts)
    for cache_dtype in (torch.bfloat16, FP8) if wire == "fp8" else (torch.bfloat16,):
        together = decode_layers(frame, layers, n, spec, cache_dtype, CPU)
        size = spec.chunk_bytes(n)
        for i in range(layers):
            alone = decode_chunk(frame[i * size : (i + 1) * size], n, spec, cache_dtype, CPU)
            for a, b in zip(alone, together, strict=True):
                assert (a is None and b is None) or equal_bytes(a, b[i])


def test_decode_layers_refuses_wrong_size_and_bad_scales():
    spec = _spec(FP8)
    with pytest.raises(FrameError, match="must be"):
        decode_layers(b"\0" * (2 * spec.chunk_bytes(1) - 1), 2, 1, spec, torch.float32, CPU)
    k, v = random_blocks(1, torch.float32)
    [(_, _, good)] = layer_chunks(encode_layer(k, v, wire_dtype="fp8", num_tokens=16), 1)
    bad = bytearray(good)
    bad[-4:] = bytes(4)  # the second layer's last V scale: 0
    with pytest.raises(FrameError, match="scales"):
        decode_layers(good + bytes(bad), 2, 1, spec, torch.float32, CPU)
