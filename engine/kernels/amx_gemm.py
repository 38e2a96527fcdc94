"""bf16 GEMMs on AMX tiles (``gemm_amx.c``) for weights packed once into the tiles' layout:
a decode step's few rows against weights it must read in full, at the machine's read
bandwidth. ``GemmPlan`` times it against the other backends and routes the row counts it
wins (engine.cpu_gemm); where it does not apply it returns None and the plan's fallback runs.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from engine.kernels import cpu_native

COLUMNS_PER_BLOCK = 16  # a tile's output columns
INPUTS_PER_BLOCK = 32  # a tile's bf16 inputs per row


def amx_available() -> bool:
    """Whether the C kernels were built with AMX here and the OS grants the tile state."""
    lib = cpu_native.library()
    return lib is not None and bool(lib.amx_gemm_available())


class AmxGemm:
    """``x @ W.T (+ bias)`` for bf16 x and W on AMX tiles.

    Each weight is packed on its first use (or by ``pack``, at start-up) and kept while the
    weight lives: keyed by the tensor object, as engine.cpu_gemm.PackedOneDNN does, so a
    freed weight's packing is never reused. One more copy of every weight it runs.

    ``__call__`` returns None for what it does not take: no AMX here, a dtype other than
    bf16, a weight whose out / in features are not multiples of 16 / 32, a strided row."""

    def __init__(self) -> None:
        self._packed: WeakIdKeyDictionary = WeakIdKeyDictionary()

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

    def pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The weight in the tiles' layout (None if it is not one ``accepts`` takes)."""
        packed = self._packed.get(weight)
        if packed is None:
            if not self.accepts(weight):
                return None
            out_features, in_features = weight.shape
            packed = torch.empty(out_features * in_features, dtype=torch.bfloat16)
            cpu_native.library().amx_pack_weight(
                weight.contiguous().data_ptr(), out_features, in_features, packed.data_ptr(),
                torch.get_num_threads(),
            )  # fmt: skip
            self._packed[weight] = packed
        return packed

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        if (
            x.dim() != 2
            or x.dtype != torch.bfloat16
            or x.device.type != "cpu"
            or x.stride(1) != 1
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()))
        ):
            return None
        if x.shape[1] != weight.shape[1]:
            raise ValueError(f"x has {x.shape[1]} features, the weight takes {weight.shape[1]}")
        packed = self.pack(weight)
        if packed is None:
            return None
        rows, out_features = x.shape[0], weight.shape[0]
        out = torch.empty((rows, out_features), dtype=torch.bfloat16)
        status = cpu_native.library().amx_linear_bf16(
            x.data_ptr(), max(x.stride(0), x.shape[1]), rows, packed.data_ptr(), out_features,
            weight.shape[1], bias.data_ptr() if bias is not None else None, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise RuntimeError(f"amx_linear_bf16 refused {rows} x {tuple(weight.shape)}")
        return out
