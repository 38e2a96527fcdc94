"""Chooses between a kernel's Triton implementation and its plain-torch reference.

The engine runs Triton on CUDA tensors and the torch reference on CPU tensors. Tests (and
anyone debugging) can force the Triton path on CPU tensors with ``PDCLUSTER_FORCE_TRITON=1``
together with ``TRITON_INTERPRET=1``, which runs the real kernels in Triton's interpreter.
"""

from __future__ import annotations

import os

import torch


def interpreter_active() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``).

    Kernels pass this as a ``tl.constexpr`` so that, under the interpreter, bf16 tiles are
    converted to fp32 before any arithmetic (the interpreter's bf16 arithmetic is wrong).
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether an op on ``tensor`` should launch its Triton kernel."""
    if tensor.is_cuda:
        return True
    return os.environ.get("PDCLUSTER_FORCE_TRITON", "0") == "1" and interpreter_active()
