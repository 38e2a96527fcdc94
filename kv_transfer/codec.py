"""Layer payloads: K/V blocks of one layer to wire bytes and back, passthrough or fp8.

Sender side: :func:`encode_layer` turns one layer's gathered blocks ``[n, bs, Hkv, D]`` into
CPU tensors of the wire dtype (fp8 e4m3 with one scale per (block, kv head) via
``engine.kernels.kv_codec``, or the cache dtype unchanged), and :func:`layer_chunks` cuts them
into frame payloads of bounded size. Receiver side: :func:`decode_chunk` views a payload as
tensors (``torch.frombuffer``: no per-element Python) and converts them into the receiving
cache's dtype on its device. :func:`encode_layers` / :func:`decode_layers` do the same for
the same blocks of several layers at once (a frame of whole layers). Pure functions,
thread-safe.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.kernels.kv_codec import dequantize_kv_blocks, quantize_kv_blocks
from kv_transfer.errors import FrameError

FP8 = torch.float8_e4m3fn
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    FP8: "float8_e4m3fn",
}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}

# Payloads arrive as views of immutable ``bytes``; the tensors viewing them are only read
# (copied into the cache), so torch's warning about non-writable buffers does not apply.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"KV dtype {dtype} cannot be transferred (use {list(_DTYPE_NAMES)})")
    return _DTYPE_NAMES[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name]


def payload_dtype_for(wire_dtype: str, cache_dtype: torch.dtype) -> torch.dtype:
    """Element dtype on the wire: fp8 for the fp8 wire, else the sender's cache dtype."""
    if wire_dtype == "fp8":
        return FP8
    if wire_dtype != "passthrough":
        raise ValueError(f"wire_dtype must be 'passthrough' or 'fp8', got {wire_dtype!r}")
    if cache_dtype == FP8:
        raise ValueError("an fp8 cache is sent with wire_dtype 'fp8' (its pages as they are)")
    dtype_name(cache_dtype)
    return cache_dtype


@dataclass(frozen=True)
class WireSpec:
    """Shape of the payloads of one transfer (both sides derive it from the handshake)."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # payload element dtype

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K (or of V) of one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def scale_bytes(self) -> int:
        """Bytes of one block's scales for K (or V): one float32 per kv head, fp8 only."""
        return 4 * self.num_kv_heads if self.is_fp8 else 0

    def chunk_bytes(self, block_count: int) -> int:
        return 2 * block_count * (self.block_bytes + self.scale_bytes)

    def blocks_per_frame(self, max_frame_bytes: int) -> int:
        return max(1, max_frame_bytes // self.chunk_bytes(1))


@dataclass(frozen=True)
class EncodedLayer:
    """One layer ready for the wire: contiguous CPU tensors (from ``encode_layers``: several
    layers', each with a leading layer axis)."""

    k: torch.Tensor  # [n, bs, Hkv, D] payload dtype
    v: torch.Tensor
    k_scale: torch.Tensor | None  # [n, Hkv] float32 (fp8 wire only)
    v_scale: torch.Tensor | None


def _quantize(x: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n, bs, Hkv, D] (a leading index per layer, the same blocks in each) -> fp8 of
    that shape and scales [..., n, Hkv], in one pass over every layer's blocks."""
    blocks = x.shape[-4:]
    q, scale = quantize_kv_blocks(x.reshape(-1, *blocks[1:]))
    q, scale = q.view(x.shape), scale.view(*x.shape[:-3], blocks[2])
    tail = num_tokens % x.shape[-3]
    if tail:
        # Rows past the last token hold stale data; their amax must not coarsen the scale of
        # the real rows. Requantise only the last block (of each layer), from a zeroed copy.
        last = x[..., -1:, :, :, :].clone()
        last[..., tail:, :, :] = 0
        q_last, s_last = quantize_kv_blocks(last.reshape(-1, *blocks[1:]))
        q[..., -1:, :, :, :] = q_last.view(last.shape)
        scale[..., -1:, :] = s_last.view(*last.shape[:-3], blocks[2])
    return q, scale


def encode_layer(
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    *,
    wire_dtype: str,
    num_tokens: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> EncodedLayer:
    """Blocks of one layer (any device) → wire tensors on the CPU.

    An fp8 source (``k_scale``/``v_scale`` given) goes out as its pages; a float source on the
    fp8 wire is quantised where it lives (on the GPU that is the Triton kernel), so only fp8
    bytes cross to the host.
    """
    if k_blocks.shape != v_blocks.shape or k_blocks.dim() != 4:
        raise ValueError(
            f"k and v blocks must both be [n, block_size, kv_heads, head_dim], got "
            f"{tuple(k_blocks.shape)} and {tuple(v_blocks.shape)}"
        )
    return _encode(k_blocks, v_blocks, wire_dtype, num_tokens, k_scale, v_scale)


def encode_layers(
    k_layers: torch.Tensor,
    v_layers: torch.Tensor,
    *,
    wire_dtype: str,
    num_tokens: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> EncodedLayer:
    """``encode_layer`` over the same blocks of several layers at once: ``[L, n, bs, Hkv, D]``
    (scales ``[L, n, Hkv]``) → an EncodedLayer whose tensors keep the leading layer axis. The
    same bytes per layer as ``encode_layer`` of each, in one quantisation pass."""
    if k_layers.shape != v_layers.shape or k_layers.dim() != 5:
        raise ValueError(
            f"k and v layers must both be [layers, n, block_size, kv_heads, head_dim], got "
            f"{tuple(k_layers.shape)} and {tuple(v_layers.shape)}"
        )
    return _encode(k_layers, v_layers, wire_dtype, num_tokens, k_scale, v_scale)


def _encode(k_blocks, v_blocks, wire_dtype, num_tokens, k_scale, v_scale) -> EncodedLayer:
    source_fp8 = k_blocks.dtype == FP8
    if source_fp8 != (k_scale is not None and v_scale is not None):
        raise ValueError("scales must be given exactly when the blocks are fp8")
    if wire_dtype == "fp8":
        if source_fp8:
            k, v, ks, vs = k_blocks, v_blocks, k_scale, v_scale
        else:
            k, ks = _quantize(k_blocks, num_tokens)
            v, vs = _quantize(v_blocks, num_tokens)
        cpu = lambda t: t.detach().to("cpu").contiguous()
        return EncodedLayer(cpu(k), cpu(v), cpu(ks.float()), cpu(vs.float()))
    payload_dtype_for(wire_dtype, k_blocks.dtype)
    return EncodedLayer(
        k_blocks.detach().to("cpu").contiguous(),
        v_blocks.detach().to("cpu").contiguous(),
        None,
        None,
    )


def _flat(t: torch.Tensor) -> tuple[memoryview, int]:
    """A flat byte view of a contiguous CPU tensor (the view keeps it alive) and the bytes of
    one block (row)."""
    flat = t.view(torch.uint8).reshape(-1)
    return memoryview(flat.numpy()), flat.numel() // max(1, t.shape[0])


def layer_chunk_parts(
    layer: EncodedLayer, blocks_per_frame: int
) -> Iterator[tuple[int, int, list[memoryview]]]:
    """(block_start, block_count, payload parts) per frame: the parts (K rows, V rows, then K
    and V scales) are flat memoryviews of the layer's tensors, not copies; their
    concatenation is the frame's payload."""
    n = layer.k.shape[0]
    tensors = [layer.k, layer.v]
    if layer.k_scale is not None:
        tensors += [layer.k_scale, layer.v_scale]
    views = [_flat(t) for t in tensors]
    for start in range(0, n, blocks_per_frame):
        stop = min(n, start + blocks_per_frame)
        yield start, stop - start, [view[start * row : stop * row] for view, row in views]


def stacked_layer_parts(layers: EncodedLayer) -> list[list[memoryview]]:
    """Per layer of an ``encode_layers`` result, all its blocks' payload parts (K rows, V rows,
    then K and V scales: flat memoryviews of the tensors, not copies), as
    ``layer_chunk_parts`` gives a layer's parts when one frame takes all its blocks."""
    tensors = [layers.k, layers.v]
    if layers.k_scale is not None:
        tensors += [layers.k_scale, layers.v_scale]
    views = [_flat(t) for t in tensors]  # a layer per row
    return [[view[i * row : (i + 1) * row] for view, row in views] for i in range(len(layers.k))]


def layer_chunks(layer: EncodedLayer, blocks_per_frame: int) -> Iterator[tuple[int, int, bytes]]:
    """(block_start, block_count, payload) per frame: K rows, V rows, then K and V scales."""
    for start, count, parts in layer_chunk_parts(layer, blocks_per_frame):
        yield start, count, b"".join(parts)


def decode_chunk(
    payload: bytes | memoryview,
    block_count: int,
    spec: WireSpec,
    cache_dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Payload of ``block_count`` blocks → (k, v, k_scale, v_scale) ready to copy into a cache
    of ``cache_dtype`` on ``device``. Scales are returned only for an fp8 cache (pages stored as
    they came); a float cache gets the fp8 payload dequantised, or a passthrough payload cast
    (a no-op, so bit-exact, when the dtypes agree). Raises FrameError on a wrong size."""
    expected = spec.chunk_bytes(block_count)
    if memoryview(payload).nbytes != expected:
        raise FrameError(
            f"payload of {block_count} blocks must be {expected} bytes, got {len(payload)}"
        )
    shape = (block_count, spec.block_size, spec.num_kv_heads, spec.head_dim)
    elements = block_count * spec.block_size * spec.num_kv_heads * spec.head_dim
    span = block_count * spec.block_bytes

    def view(offset: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        return torch.frombuffer(payload, dtype=dtype, count=count, offset=offset)

    k = view(0, spec.dtype, elements).view(shape).to(device)
    v = view(span, spec.dtype, elements).view(shape).to(device)
    if not spec.is_fp8:
        return k.to(cache_dtype), v.to(cache_dtype), None, None
    heads = spec.num_kv_heads
    k_scale = view(2 * span, torch.float32, block_count * heads).view(block_count, heads)
    v_scale = view(2 * span + 4 * block_count * heads, torch.float32, block_count * heads)
    return _from_fp8(k, v, k_scale, v_scale.view(block_count, heads), cache_dtype, device)


def decode_layers(
    payload: bytes | memoryview,
    layer_count: int,
    block_count: int,
    spec: WireSpec,
    cache_dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``decode_chunk`` of a frame of ``layer_count`` layers (one chunk each, in order) at
    once: (k, v, k_scale, v_scale) with a leading layer axis, [L, n, bs, Hkv, D] (scales
    [L, n, Hkv]); the fp8 payload dequantised in one pass. The same values as
    ``decode_chunk`` of each layer's chunk."""
    size = spec.chunk_bytes(block_count)
    if memoryview(payload).nbytes != size * layer_count:
        raise FrameError(
            f"payload of {layer_count} layers of {block_count} blocks must be "
            f"{size * layer_count} bytes, got {memoryview(payload).nbytes}"
        )
    rows = torch.frombuffer(payload, dtype=torch.uint8).view(layer_count, size)
    shape = (layer_count, block_count, spec.block_size, spec.num_kv_heads, spec.head_dim)
    span = block_count * spec.block_bytes

    def part(start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        # every layer's bytes of one part, gathered contiguous (a copy: small frames only)
        return rows[:, start:stop].contiguous().view(dtype).to(device)

    k = part(0, span, spec.dtype).view(shape)
    v = part(span, 2 * span, spec.dtype).view(shape)
    if not spec.is_fp8:
        return k.to(cache_dtype), v.to(cache_dtype), None, None
    scales = part(2 * span, size, torch.float32).view(layer_count, 2, block_count, -1)
    return _from_fp8(k, v, scales[:, 0], scales[:, 1], cache_dtype, device)


def _from_fp8(k, v, k_scale, v_scale, cache_dtype: torch.dtype, device: torch.device):
    """fp8 pages [..., n, bs, Hkv, D] and their scales [..., n, Hkv] as a cache of
    ``cache_dtype`` stores them: as they are (fp8), or dequantised."""
    for scale in (k_scale, v_scale):
        # A scale that is not a positive finite number would poison every value it scales.
        if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
            raise FrameError("fp8 scales must be positive finite numbers")
    k_scale, v_scale = k_scale.to(device), v_scale.to(device)
    if cache_dtype == FP8:
        return k, v, k_scale, v_scale
    blocks = k.shape[-3:]

    def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        flat = dequantize_kv_blocks(
            q.reshape(-1, *blocks), scale.reshape(-1, blocks[1]), cache_dtype
        )
        return flat.view(q.shape)

    return dequantize(k, k_scale), dequantize(v, v_scale), None, None
