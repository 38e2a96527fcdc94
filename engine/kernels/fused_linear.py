"""GEMM with a fused epilogue, for the fused QKV and gate_up projections.

``fused_linear(x, weight, bias, activation)`` computes ``x @ weight.T (+ bias)`` with
``weight`` in ``nn.Linear`` layout [N, K]. With ``activation="silu_mul"`` the weight is the
fused gate_up projection [2I, K] (gate rows, then up rows) and each program accumulates the
gate tile and the matching up tile against the same x tiles, then applies SiLU·mul in the
epilogue: the [M, 2I] intermediate never reaches memory.

Numerics follow HF's order of rounding: each projection is rounded to the model dtype
(bias added in fp32 first), then SiLU is rounded, then the product (see ``silu_mul``).

On CUDA the kernel is autotuned per (M bucket, N, K, dtype, epilogue); under the
interpreter one small fixed config keeps the CPU tests fast. Both launch the same body.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

from engine.kernels import dispatch
from engine.kernels.silu_mul import cast_rne, silu_mul_math

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ACTIVATIONS = (None, "silu_mul")

# Interpreter config: every program runs in Python, so small tiles, but still >= 16 so
# tl.dot's shape rules are exercised as on a GPU.
_INTERP_BLOCK_M = 16
_INTERP_BLOCK_N = 32
_INTERP_BLOCK_K = 32
_INTERP_GROUP_M = 4


@triton.jit
def _dot_acc(a, b, acc):
    # a [BM, BK], b [BN, BK] (nn.Linear rows); acc [BM, BN] fp32.
    # fp32 inputs would default to TF32 on NVIDIA; torch.matmul's fp32 default is IEEE.
    if a.dtype == tl.float32:
        return tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(b), acc)


# M and M_BUCKET unspecialised: Triton would otherwise compile every tile config again for
# M == 1 and for M a multiple of 16 (the masks make that specialisation worthless here).
@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _fused_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    M_BUCKET,  # only an autotuning key: one tuned config per power-of-two bucket of M
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    INTERPRET: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # N is the number of output columns (I for silu_mul, whose weight has 2N rows).
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row-blocks sweep the same weight column-blocks back to
    # back, so those weight tiles are still in L2 when the next row-block needs them.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    # Out-of-range rows/columns wrap onto valid ones, so the K loop needs no M/N masks
    # (their results are dropped by the masked store).
    rows = offs_m % M
    cols = offs_n % N

    # int64 row offsets: M*K and N*K pass 2^31 at long prefills with wide layers.
    x_ptrs = (
        x_ptr + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    )  # [BM, BK]
    w_ptrs = (
        w_ptr + cols[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
    )  # [BN, BK]
    # The up rows start N rows below the gate rows.
    wu_ptrs = w_ptrs + N * stride_wn  # [BN, BK]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_mask = offs_k[None, :] < K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=k_mask, other=0.0)
            b = tl.load(w_ptrs, mask=k_mask, other=0.0)
        if INTERPRET:
            # The interpreter's bf16 (and fp16) tl.dot is wrong or imprecise; fp32 is exact.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = _dot_acc(a, b, acc)
        if SILU_MUL:
            # Same x tile as the gate: the reason for fusing the two projections.
            if EVEN_K:
                bu = tl.load(wu_ptrs)
            else:
                bu = tl.load(wu_ptrs, mask=k_mask, other=0.0)
            if INTERPRET:
                bu = bu.to(tl.float32)
            acc_up = _dot_acc(a, bu, acc_up)
            wu_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    out_dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        # Masked rather than wrapped offsets: contiguous, so the loads vectorise.
        n_mask = offs_n < N
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            up_bias = tl.load(bias_ptr + N + offs_n, mask=n_mask, other=0.0)
            acc_up += up_bias.to(tl.float32)[None, :]
    if SILU_MUL:
        # Round each projection to the model dtype as HF's separate gate/up linears do.
        gate = cast_rne(acc, out_dtype, INTERPRET).to(tl.float32)
        up = cast_rne(acc_up, out_dtype, INTERPRET).to(tl.float32)
        out = silu_mul_math(gate, up, out_dtype, INTERPRET)
    else:
        out = cast_rne(acc, out_dtype, INTERPRET)

    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptrs, out, mask=out_mask)


def _config(bm: int, bn: int, bk: int, group_m: int, stages: int, warps: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
        num_stages=stages,
        num_warps=warps,
    )


# Hopper-oriented configs (the tutorial's matmul set, trimmed), plus skinny-M tiles for
# decode batches. Shared-memory overflows (e.g. fp32 with deep pipelines) are skipped by
# the autotuner as OutOfResources.
_PLAIN_CONFIGS = [
    _config(128, 256, 64, 8, 3, 8),
    _config(128, 256, 64, 8, 4, 8),
    _config(256, 128, 64, 8, 3, 8),
    _config(128, 128, 64, 8, 4, 8),
    _config(128, 128, 64, 8, 4, 4),
    _config(128, 64, 64, 8, 4, 4),
    _config(64, 128, 64, 8, 4, 4),
    _config(64, 64, 64, 8, 4, 4),
    _config(16, 64, 128, 1, 4, 4),
    _config(16, 128, 64, 1, 4, 4),
    _config(32, 64, 128, 1, 4, 4),
    _config(32, 128, 64, 1, 4, 4),
]
# Two accumulators and two weight tiles per step: the tile's effective width is 2*BN, so
# the widest plain tiles would spill registers.
_SILU_MUL_CONFIGS = [
    _config(128, 128, 64, 8, 3, 8),
    _config(128, 128, 32, 8, 4, 8),
    _config(128, 64, 64, 8, 4, 4),
    _config(64, 128, 64, 8, 4, 4),
    _config(64, 64, 64, 8, 4, 4),
    _config(16, 64, 128, 1, 4, 4),
    _config(16, 128, 64, 1, 4, 4),
    _config(32, 64, 128, 1, 4, 4),
    _config(32, 64, 64, 1, 4, 4),
]


# fp32 (IEEE) dots run on FMA units with the accumulators in registers: above this many
# accumulator elements per program the kernel spills heavily (checked with ptxas, sm_90).
_FP32_MAX_ACC_ELEMENTS = 64 * 128


def _prune_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Tune only tiles that suit the batch (skinny for decode, big for prefill) and dtype."""
    m_bucket = named_args["M_BUCKET"]
    if m_bucket <= 32:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] <= 64]
    elif m_bucket <= 128:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] <= 128]
    else:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] >= 64]
    if named_args["x_ptr"].dtype == torch.float32:
        accumulators = 2 if kwargs.get("SILU_MUL") else 1
        fp32_ok = [
            c
            for c in configs
            if accumulators * c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= _FP32_MAX_ACC_ELEMENTS
        ]
        keep = [c for c in keep if c in fp32_ok] or fp32_ok
    return keep or configs


def _even_k(args: dict) -> bool:
    return args["K"] % args["BLOCK_K"] == 0


_TUNE_KEY = ["M_BUCKET", "N", "K", "HAS_BIAS"]


def _tuning_bench(kernel_call, quantiles):
    # Triton's default (25 ms of warm-up and 100 ms of runs per config) made the start-up
    # warm-up of a 30-layer model's GEMMs at every row bucket outlast two minutes on an H200;
    # a few milliseconds per config still rank tiles whose times differ by a few percent.
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


def _autotuned(configs: list[triton.Config]):
    return triton.autotune(
        configs=configs,
        key=_TUNE_KEY,
        prune_configs_by={"early_config_prune": _prune_configs},
        do_bench=_tuning_bench,
    )(triton.heuristics({"EVEN_K": _even_k})(_fused_linear_kernel))


# Separate tuners (and caches) for the two epilogues, which favour different tiles.
_fused_linear_plain_tuned = _autotuned(_PLAIN_CONFIGS)
_fused_linear_silu_mul_tuned = _autotuned(_SILU_MUL_CONFIGS)


def _m_bucket(m: int) -> int:
    # Serving sees a different M nearly every step; tuning per exact M would re-benchmark
    # constantly. Up to 16 rows the skinny tiles (BLOCK_M 16) win alike; beyond 16k rows the
    # best tile no longer changes.
    return min(max(triton.next_power_of_2(m), 16), 16384)


def _check_inputs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"fused_linear: activation must be one of {_ACTIVATIONS}, got {activation!r}"
        )
    if x.dim() != 2:
        raise ValueError(f"fused_linear: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(
            f"fused_linear: weight must be 2-D [N, K], got shape {tuple(weight.shape)}"
        )
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"fused_linear: x [M, K={x.shape[1]}] and weight [N, K={weight.shape[1]}] disagree on K"
        )
    if activation == "silu_mul" and weight.shape[0] % 2 != 0:
        raise ValueError(
            f"fused_linear: silu_mul needs a gate_up weight [2I, K], got {weight.shape[0]} rows"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(
            f"fused_linear: bias must be 1-D [N={weight.shape[0]}], got shape {tuple(bias.shape)}"
        )


def fused_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Triton ``x @ weight.T (+ bias)``, optionally with the SiLU·mul epilogue.

    x [M, K], weight [N, K], bias [N] -> [M, N]; with ``activation="silu_mul"``,
    weight [2I, K] (gate rows then up rows), bias [2I] -> [M, I]. Output dtype = x.dtype.
    """
    _check_inputs(x, weight, bias, activation)
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"fused_linear: unsupported dtype {x.dtype}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(
            f"fused_linear: dtypes must match: x {x.dtype}, weight {weight.dtype}"
            + (f", bias {bias.dtype}" if bias is not None else "")
        )
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError("fused_linear: x, weight and bias must be on the same device")

    silu_mul = activation == "silu_mul"
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return out
    if bias is not None:
        bias = bias.contiguous()

    args = (
        x,
        weight,
        bias if bias is not None else out,  # never read without HAS_BIAS
        out,
        m,
        n,
        k,
        _m_bucket(m),
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
    )
    flags = {"HAS_BIAS": bias is not None, "SILU_MUL": silu_mul}
    if dispatch.interpreter_active():
        grid = (triton.cdiv(m, _INTERP_BLOCK_M) * triton.cdiv(n, _INTERP_BLOCK_N),)
        _fused_linear_kernel[grid](
            *args,
            **flags,
            INTERPRET=True,
            EVEN_K=k % _INTERP_BLOCK_K == 0,
            BLOCK_M=_INTERP_BLOCK_M,
            BLOCK_N=_INTERP_BLOCK_N,
            BLOCK_K=_INTERP_BLOCK_K,
            GROUP_M=_INTERP_GROUP_M,
        )
    else:
        kernel = _fused_linear_silu_mul_tuned if silu_mul else _fused_linear_plain_tuned

        def grid(meta: dict) -> tuple[int]:
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        kernel[grid](*args, **flags, INTERPRET=False)
    return out


def fused_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Plain torch (the CPU production path): ``F.linear`` then, for silu_mul, silu(gate)*up.

    Works on any leading shape of ``x``.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"fused_linear: activation must be one of {_ACTIVATIONS}, got {activation!r}"
        )
    out = F.linear(x, weight, bias)
    if activation is None:
        return out
    gate, up = out.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with an optional ``"silu_mul"`` epilogue.

    Triton on CUDA tensors, the torch reference otherwise.
    """
    if dispatch.use_triton(x):
        return fused_linear_triton(x, weight, bias, activation)
    return fused_linear_reference(x, weight, bias, activation)
