"""bf16 GEMMs on AMX tiles (``gemm_amx.c``) for weights packed once into the tiles' layout:
a decode step's few rows against weights it must read in full, at the machine's read
bandwidth. ``GemmPlan`` times it against the other backends and routes the row counts it
wins (engine.cpu_gemm); where it does not apply it returns None and the plan's fallback runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from engine.kernels import cpu_native

COLUMNS_PER_BLOCK = 16  # a tile's output columns
INPUTS_PER_BLOCK = 32  # a tile's bf16 inputs per row


def amx_available() -> bool:
    """Whether the C kernels were built with AMX here and the OS grants the tile state."""
    lib = cpu_native.library()
    return lib is not None and bool(lib.amx_gemm_available())


def amx_shares_rows(rows: int, threads: int) -> bool:
    """Whether the AMX GEMM gives each of ``threads`` threads its own share of ``rows`` rows
    (every column), as from a few hundred rows a thread: each core then writes the rows that
    it, and the row-parallel ops around the GEMM, read next (else each thread its columns)."""
    lib = cpu_native.library()
    return lib is not None and bool(lib.amx_shares_rows(rows, threads))


@dataclass(frozen=True)
class _Packed:
    tensor: torch.Tensor  # the weight in the tiles' layout, flat
    address: int  # its data pointer (asked once: each call reads it)
    out_features: int
    in_features: int


class AmxGemm:
    """``x @ W.T (+ bias)`` for bf16 x and W on AMX tiles.

    Each weight is packed on its first use (or by ``pack``, at start-up) and kept while the
    weight lives: keyed by the tensor object, as engine.cpu_gemm.PackedOneDNN does, so a
    freed weight's packing is never reused. One more copy of every weight it runs.

    ``__call__`` returns None for what it does not take: no AMX here, a dtype other than
    bf16, a weight whose out / in features are not multiples of 16 / 32, a strided row.
    A decode step makes ~120 of these calls, so the per-call Python is kept short."""

    def __init__(self) -> None:
        self._packed: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight → _Packed | None

    @staticmethod
    def accepts(weight: torch.Tensor) -> bool:
        return (
            weight.dtype == torch.bfloat16
            and weight.dim() == 2
            and weight.device.type == "cpu"
            and weight.shape[0] % COLUMNS_PER_BLOCK == 0
            and weight.shape[1] % INPUTS_PER_BLOCK == 0
            and amx_available()
        )

    def pack(self, weight: torch.Tensor) -> _Packed | None:
        """The weight in the tiles' layout (None if it is not one ``accepts`` takes)."""
        try:
            return self._packed[weight]
        except KeyError:
            pass
        packed = None
        if self.accepts(weight):
            out_features, in_features = weight.shape
            tensor = torch.empty(out_features * in_features, dtype=torch.bfloat16)
            cpu_native.library().amx_pack_weight(
                weight.contiguous().data_ptr(), out_features, in_features, tensor.data_ptr(),
                torch.get_num_threads(),
            )  # fmt: skip
            packed = _Packed(tensor, tensor.data_ptr(), out_features, in_features)
        self._packed[weight] = packed
        return packed

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        packed = self._packed_for(x, weight, bias)
        if packed is None:
            return None
        out = torch.empty((x.shape[0], packed.out_features), dtype=torch.bfloat16)
        self._run(cpu_native.library().amx_linear_bf16, x, packed, bias, out)
        return out

    def silu_mul(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """silu(gate) * up of ``x @ weight.T (+ bias)`` = [gate | up], [rows, out / 2]: the
        bits of ``__call__`` then ``silu_mul_native``, without writing [gate | up] out. None
        where ``__call__`` declines, for 16 rows or fewer, and where out / 2 is not whole
        column blocks."""
        packed = self._packed_for(x, weight, bias)
        if packed is None or x.shape[0] <= 16 or packed.out_features % (2 * COLUMNS_PER_BLOCK):
            return None
        out = torch.empty((x.shape[0], packed.out_features // 2), dtype=torch.bfloat16)
        self._run(cpu_native.library().amx_linear_silu_mul_bf16, x, packed, bias, out)
        return out

    def _packed_for(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> _Packed | None:
        packed = self.pack(weight)
        if (
            packed is None
            or x.dtype != torch.bfloat16
            or x.dim() != 2
            or x.stride(1) != 1
            or not x.is_cpu
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()))
        ):
            return None
        if x.shape[1] != packed.in_features:
            raise ValueError(f"x has {x.shape[1]} features, the weight takes {packed.in_features}")
        return packed

    @staticmethod
    def _run(entry, x: torch.Tensor, packed: _Packed, bias: torch.Tensor | None, out) -> None:
        rows, in_features = x.shape
        status = entry(
            x.data_ptr(), max(x.stride(0), in_features), rows, packed.address, packed.out_features,
            in_features, None if bias is None else bias.data_ptr(), out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if status:
            shape = (packed.out_features, in_features)
            raise RuntimeError(f"{entry.__name__} refused {rows} x {shape}")
