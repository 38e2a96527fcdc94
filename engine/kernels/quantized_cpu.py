"""GEMMs on weights kept in their GGUF blocks (``quantized_cpu.c``): what a CPU decode step
reads is its weights, and a Q4_1 block holds 32 of them in 20 bytes where fp32 takes 128.

A ``QuantizedWeight`` is one GEMM weight [out, in] as its rows of blocks; fused weights
(QKV, gate-up) are their parts' rows stacked, which a row-major block layout allows. The
kernel computes with exactly the fp32 values gguf's dequantiser gives (``dequantize`` is
the check; the engine runs it on every weight at load), so only the summation order differs
from a BLAS on the dense weights. fp32 activations only: other dtypes keep the dense path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import cpu_native

QBLOCK = 32  # weights per block
# GGUF block type → (the kernel's code, bytes per block)
KINDS = {"Q4_0": (0, 18), "Q4_1": (1, 20), "Q8_0": (2, 34)}


@dataclass(frozen=True)
class QuantizedWeight:
    kind: str  # a key of KINDS
    blocks: torch.Tensor  # uint8 [out_features, in_features / 32 * bytes per block], contiguous
    in_features: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"block type {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.in_features <= 0 or self.in_features % QBLOCK:
            raise ValueError(f"in_features {self.in_features} is not a multiple of {QBLOCK}")
        row_bytes = self.in_features // QBLOCK * KINDS[self.kind][1]
        b = self.blocks
        if b.dtype != torch.uint8 or b.dim() != 2 or b.shape[1] != row_bytes:
            raise ValueError(
                f"{self.kind} blocks of {self.in_features} inputs are uint8 [rows, {row_bytes}], "
                f"got {b.dtype} {tuple(b.shape)}"
            )
        if not b.is_contiguous() or b.device.type != "cpu":
            raise ValueError("quantized blocks must be a contiguous CPU tensor")

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


def stack_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight of ``parts``' rows one after another (a fused QKV or gate-up)."""
    kinds = {p.kind for p in parts}
    widths = {p.in_features for p in parts}
    if len(kinds) != 1 or len(widths) != 1:
        raise ValueError(f"cannot stack blocks of types {kinds} and widths {widths}")
    return QuantizedWeight(parts[0].kind, torch.cat([p.blocks for p in parts]), widths.pop())


def quantized_linear(
    x: torch.Tensor,  # [rows, in] fp32
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [out] fp32
) -> torch.Tensor | None:
    """``x @ W.T (+ bias)`` [rows, out], or None where the kernel does not apply (no C
    compiler, a dtype other than fp32, a strided row)."""
    lib = cpu_native.library()
    if (
        lib is None
        or x.dim() != 2
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or x.stride(1) != 1
        or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))
    ):
        return None
    if x.shape[1] != weight.in_features:
        raise ValueError(f"x has {x.shape[1]} features, the weight takes {weight.in_features}")
    rows = x.shape[0]
    out = torch.empty((rows, weight.out_features), dtype=torch.float32)
    status = lib.quantized_linear(
        weight.blocks.data_ptr(), KINDS[weight.kind][0], weight.out_features, weight.in_features,
        x.data_ptr(), rows, x.stride(0), bias.data_ptr() if bias is not None else None,
        out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise MemoryError("quantized_linear: no memory for a row buffer")
    return out


def dequantize(weight: QuantizedWeight) -> torch.Tensor | None:
    """The fp32 [out, in] values ``quantized_linear`` computes with; None without the C
    library."""
    lib = cpu_native.library()
    if lib is None:
        return None
    out = torch.empty((weight.out_features, weight.in_features), dtype=torch.float32)
    lib.quantized_dequantize(
        weight.blocks.data_ptr(), KINDS[weight.kind][0], weight.out_features, weight.in_features,
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def dequantize_reference(weight: QuantizedWeight) -> torch.Tensor:
    """The same values in torch ops, as gguf's numpy dequantiser computes them."""
    _, size = KINDS[weight.kind]
    blocks = weight.blocks.view(weight.out_features, -1, size)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [out, nb, 1]
    if weight.kind == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        values = d * q
    else:
        nibbles = blocks[..., 4:] if weight.kind == "Q4_1" else blocks[..., 2:]
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()  # [out, nb, 32]
        if weight.kind == "Q4_0":
            values = d * (q - 8)
        else:
            values = d * q + blocks[..., 2:4].contiguous().view(torch.float16).float()
    return values.reshape(weight.out_features, weight.in_features)
