"""Attention on CPU: C kernels over the paged cache, torch's fused SDPA kernels where they
cannot be built.

The CPU production path of decode and prefill attention (the Triton kernels are the CUDA
path; the ``*_reference`` functions beside them define the result, and tests hold these to
them). What one forward's layers share -- which cache pages each sequence reads, its mask --
is worked out once per step (``decode_plan``, ``prefill_plan``), not once per layer.

- Decode: ``attention_cpu.c`` (built by ``cpu_native``) reads each sequence's K/V in place
  through its block table, in fp32. Without it, every sequence's pages are gathered into
  ``[B, L, Hkv, D]`` and one SDPA call covers the batch, the G query heads of a KV head
  acting as G query rows (GQA without copying K/V). Rows past a sequence's context are
  masked; they are zeroed in the copy too, since a masked score times a garbage (NaN) value
  would still be NaN. At 3 query rows per KV head SDPA's CPU kernel spends most of its time
  on overhead, and the gather copies every page once per layer.
- Prefill: in bf16, a C kernel where it is faster than SDPA, timed once per head shape
  and thread count (``native_prefill_wins``). On a CPU with AMX and a head_dim of 32 or 64,
  ``prefill_attention_amx.c``: S^T = K Q^T and O^T = V^T P^T on the tiles, the softmax
  with one query per lane (1.7-2.3x SDPA at 256-4k tokens here); it reads a cached prefix
  from bf16 or fp8 pages, and takes a layer's whole batch in one call (``PrefillBatch``).
  Otherwise, with AVX-512 BF16, ``prefill_attention_cpu.c`` (flash style, its dot products
  the CPU's bf16 instructions; bf16 pages only): 2-3x SDPA on an AVX-512 BF16 CPU without
  AMX, 3-4x slower than SDPA's AMX products on one with it.
  Otherwise one SDPA call per sequence, never an ``[S, S]`` score tensor: a prompt with no
  cached prefix takes the causal flash kernel, which skips fully masked key blocks; a
  prompt chunk after a prefix gets its keys from the pages plus its own, with a
  bottom-right causal mask.
  fp32 (the exactness tests' dtype) always takes SDPA.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from engine.kernels import cpu_native
from engine.kernels.decode_attention import check_decode_args
from engine.kernels.fp8 import FP8_DTYPE

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatherPlan:
    """The pages every layer gathers for the SDPA path (no C kernel here)."""

    length: int  # gathered rows per sequence (whole pages)
    pages: torch.Tensor  # [B * P] int64 block ids (unused table entries point at block 0)
    mask: torch.Tensor | None  # [B, 1, 1, L] bool, None when every row of every page is real
    invalid_rows: torch.Tensor | None  # [n] int64 rows of the flat [B * L] copy past a context


@dataclass(frozen=True)
class DecodePlan:
    """Per step, for every layer of a decode batch."""

    batch: int
    block_tables: torch.Tensor  # [B, max_blocks] int32, contiguous
    context_lens: torch.Tensor  # [B] int32
    max_block: int  # the largest block id in the tables (the C kernel checks it)
    gather: GatherPlan | None  # None: the C kernel reads the pages in place

    def check_fits(self, num_blocks: int) -> None:
        """The C kernel trusts the block tables: none may name a block past the cache."""
        if self.max_block >= num_blocks:
            raise ValueError(
                f"block table names block {self.max_block} of a {num_blocks}-block cache"
            )


def decode_plan(block_tables: torch.Tensor, context_lens: list[int], block_size: int) -> DecodePlan:
    batch = len(context_lens)
    tables = block_tables.to(torch.int32).contiguous()
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    longest = max(context_lens, default=0)
    if longest > tables.shape[1] * block_size:
        raise ValueError(
            f"a context of {longest} tokens does not fit a block table of {tables.shape[1]} "
            f"blocks of {block_size}"
        )
    # Every id in the tables, not only those the contexts reach: a table holds its
    # sequence's blocks and zeros, so this is the same check, in one op instead of five.
    max_block = int(tables.max()) if tables.numel() else 0
    if cpu_native.library() is not None:
        return DecodePlan(batch, tables, ctx, max_block, None)
    num_pages = max(-(-max(context_lens, default=1) // block_size), 1)
    length = num_pages * block_size
    pages = block_tables[:, :num_pages].long()
    page_start = torch.arange(num_pages)[None] * block_size
    pages = torch.where(page_start < ctx[:, None], pages, 0).flatten()
    if all(n == length for n in context_lens):
        return DecodePlan(batch, tables, ctx, max_block, GatherPlan(length, pages, None, None))
    valid = torch.arange(length)[None] < ctx[:, None]  # [B, L]
    invalid = (~valid).flatten().nonzero().squeeze(1)
    gather = GatherPlan(length, pages, valid[:, None, None, :], invalid)
    return DecodePlan(batch, tables, ctx, max_block, gather)


def decode_attention_cpu(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,  # [N, Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None,
    plan: DecodePlan,
    softmax_scale: float,
) -> torch.Tensor:
    if plan.gather is None:
        return _decode_attention_native(q, k_cache, v_cache, k_scale, v_scale, plan, softmax_scale)
    return _decode_attention_sdpa(q, k_cache, v_cache, k_scale, v_scale, plan.gather, softmax_scale)


def _decode_attention_native(q, k_cache, v_cache, k_scale, v_scale, plan, softmax_scale):
    # The C kernel trusts its arguments: every shape, dtype and block id is checked here.
    check_decode_args(q, k_cache, v_cache, k_scale, v_scale, plan.block_tables, plan.context_lens)
    batch, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    plan.check_fits(num_blocks)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous [num_blocks, block_size, Hkv, D]")
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    fp8 = k_cache.dtype == FP8_DTYPE
    if fp8:
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype)
    failed = cpu_native.library().paged_decode_attention(
        q.data_ptr(), cpu_native.C_DTYPES[q.dtype], q.stride(0),
        k_cache.data_ptr(), v_cache.data_ptr(), cpu_native.C_DTYPES[k_cache.dtype],
        k_scale.data_ptr() if fp8 else None, v_scale.data_ptr() if fp8 else None,
        plan.block_tables.data_ptr(), plan.block_tables.shape[1], plan.context_lens.data_ptr(),
        batch, num_q_heads, num_kv_heads, head_dim, block_size, softmax_scale, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("decode attention could not allocate its scratch memory")
    return out


def _decode_attention_sdpa(q, k_cache, v_cache, k_scale, v_scale, plan: GatherPlan, scale):
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    dtype = q.dtype if k_cache.dtype != FP8_DTYPE else torch.float32

    def gather(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        x = cache.index_select(0, plan.pages)  # [B * P, bs, Hkv, D]
        if scale is not None:
            x = x.float() * scale.index_select(0, plan.pages)[:, None, :, None]
        x = x.to(dtype).view(batch * plan.length, num_kv_heads, head_dim)
        if plan.invalid_rows is not None:
            x.index_fill_(0, plan.invalid_rows, 0.0)
        return x.view(batch, plan.length, num_kv_heads, head_dim).transpose(1, 2)

    fp8 = k_cache.dtype == FP8_DTYPE
    k = gather(k_cache, k_scale if fp8 else None)  # [B, Hkv, L, D]
    v = gather(v_cache, v_scale if fp8 else None)
    out = F.scaled_dot_product_attention(
        q.to(dtype).view(batch, num_kv_heads, group, head_dim),
        k,
        v,
        attn_mask=plan.mask,
        scale=scale,
    )  # [B, Hkv, G, D]
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


@dataclass(frozen=True)
class PrefillSequence:
    start: int  # its first new token's row in the batch
    end: int
    prefix: int  # tokens already cached
    pages: torch.Tensor | None  # [P] int64 pages holding the prefix
    mask: torch.Tensor | None  # [new, prefix + new] bool, when there is a prefix
    table: torch.Tensor | None  # the pages as int32 (for the C kernel)


@dataclass(frozen=True)
class PrefillBatch:
    """Sequences that one call of the AMX kernel takes, with its per-sequence arrays."""

    sequences: list[PrefillSequence]
    starts: torch.Tensor  # [B] int64: first new token's row
    lengths: torch.Tensor  # [B] int64: new tokens
    prefixes: torch.Tensor  # [B] int64: cached tokens
    tables: torch.Tensor | None  # int32: the prefixes' pages, one sequence's after another
    table_starts: torch.Tensor  # [B] int64: where each sequence's pages start in tables
    max_page: int  # the largest page a prefix reads (-1: none; the C kernel checks none)

    def check_fits(self, num_blocks: int) -> None:
        """The C kernel trusts the block tables: no prefix may read a page past the cache."""
        if self.max_page >= num_blocks:
            raise ValueError(f"a prefix page past the cache's {num_blocks} blocks")

    @classmethod
    def of(cls, sequences: list[PrefillSequence]) -> PrefillBatch:
        def int64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        tables = [seq.table for seq in sequences if seq.table is not None]
        sizes = [0 if seq.table is None else seq.table.numel() for seq in sequences]
        joined = torch.cat(tables) if tables else None
        return cls(
            sequences,
            int64([seq.start for seq in sequences]),
            int64([seq.end - seq.start for seq in sequences]),
            int64([seq.prefix for seq in sequences]),
            joined,
            int64([sum(sizes[:b]) for b in range(len(sequences))]),
            int(joined.max()) if joined is not None and joined.numel() else -1,
        )


@dataclass(frozen=True)
class PrefillPlan:
    """Per step, for every layer of a prefill batch: its sequences, and as C kernel batches
    all of them (where the kernel reads the cache's pages) or those without a prefix."""

    sequences: list[PrefillSequence]
    every: PrefillBatch
    unprefixed: PrefillBatch


def prefill_plan(
    cu_seqlens: list[int], prefix_lens: list[int], block_tables: torch.Tensor, block_size: int
) -> PrefillPlan:
    sequences = []
    for b, prefix in enumerate(prefix_lens):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        if end == start:
            continue
        if prefix == 0:
            sequences.append(PrefillSequence(start, end, 0, None, None, None))
            continue
        pages = block_tables[b, : -(-prefix // block_size)].long()
        new = torch.arange(end - start)[:, None]
        keys = torch.arange(prefix + end - start)[None, :]
        table = pages.to(torch.int32)
        sequences.append(PrefillSequence(start, end, prefix, pages, keys <= prefix + new, table))
    every = PrefillBatch.of(sequences)
    unprefixed = [seq for seq in sequences if not seq.prefix]
    return PrefillPlan(
        sequences,
        every,
        every if len(unprefixed) == len(sequences) else PrefillBatch.of(unprefixed),
    )


def prefill_attention_cpu(
    q: torch.Tensor,  # [T, Hq, D] new tokens of every sequence
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    plan: PrefillPlan,
    softmax_scale: float,
) -> torch.Tensor:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    fp8 = k_cache.dtype == FP8_DTYPE
    out = torch.empty_like(q)

    def cached(cache: torch.Tensor, scale: torch.Tensor | None, seq: PrefillSequence):
        x = cache.index_select(0, seq.pages)  # [P, bs, Hkv, D]
        if fp8:
            x = x.float() * scale.index_select(0, seq.pages)[:, None, :, None]
        return x.to(q.dtype).reshape(-1, num_kv_heads, head_dim)[: seq.prefix]

    kernel = _native_prefill(q, k, v)
    # A sequence without a cached prefix reads no page, whatever the cache's dtype (an fp8
    # cache's new tokens arrive as bf16 k, v); one with a prefix needs a kernel that reads it.
    native = None
    if kernel is not None:
        native = plan.every if _reads_pages(kernel, k_cache, v_cache, k_scale) else plan.unprefixed
        caches = (k_cache, v_cache, k_scale, v_scale)
        if not _prefill_attention_native(kernel, q, k, v, *caches, native, softmax_scale, out):
            native = None
    for seq in plan.sequences:
        if native is not None and (seq.prefix == 0 or native is plan.every):
            continue
        keys, values = k[seq.start : seq.end], v[seq.start : seq.end]
        if seq.prefix:
            keys = torch.cat([cached(k_cache, k_scale, seq), keys])
            values = torch.cat([cached(v_cache, v_scale, seq), values])
        attended = _sdpa_prefill(q[seq.start : seq.end], keys, values, seq.mask, softmax_scale)
        out[seq.start : seq.end] = attended[0].transpose(0, 1)
    return out


def _native_prefill(q, k, v) -> PrefillKernel | None:
    """The C prefill kernel that takes this batch's new tokens, or None: bf16 (its products
    are the CPU's bf16 instructions), a head_dim it takes, heads D apart in every row, and
    measured faster than SDPA here."""
    head_dim = q.shape[2]
    kernel = _prefill_kernel(head_dim)
    takes = (
        kernel is not None
        and all(t.dtype == torch.bfloat16 for t in (q, k, v))
        and all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (q, k, v))
        and native_prefill_wins(q.shape[1], k.shape[1], head_dim, torch.get_num_threads())
    )
    return kernel if takes else None


# The measured prompt: long enough that attention's products, not the call, set the time.
_TIMED_TOKENS = 512


@cache
def native_prefill_wins(num_q_heads: int, num_kv_heads: int, head_dim: int, threads: int) -> bool:
    """Whether the C prefill kernel beats SDPA on a bf16 prompt of these heads with
    ``threads`` torch threads, timed here once (tens of ms; the engine asks at load, so no
    request pays it). The caller has checked that the C kernel takes the shape."""
    generator = torch.Generator().manual_seed(0)

    def rows(heads: int) -> torch.Tensor:
        shape = (_TIMED_TOKENS, heads, head_dim)
        return torch.randn(shape, generator=generator).to(torch.bfloat16)

    q, k, v = rows(num_q_heads), rows(num_kv_heads), rows(num_kv_heads)
    pages = torch.zeros(1, 16, num_kv_heads, head_dim, dtype=torch.bfloat16)  # unread
    whole = PrefillSequence(0, _TIMED_TOKENS, 0, None, None, None)
    batch = PrefillBatch.of([whole])
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native = _best_s(
            lambda: _prefill_attention_native(
                _prefill_kernel(head_dim), q, k, v, pages, pages, None, None, batch, scale, out
            )
        )
        sdpa = _best_s(lambda: _sdpa_prefill(q, k, v, whole.mask, scale))
    finally:
        torch.set_num_threads(previous)
    logger.info(
        "prefill attention (bf16, %d:%d heads of %d, %d threads): %s (C kernel %.2f ms, "
        "SDPA %.2f ms at %d tokens)", num_q_heads, num_kv_heads, head_dim, threads,
        "the C kernel" if native < sdpa else "SDPA", native * 1e3, sdpa * 1e3, _TIMED_TOKENS,
    )  # fmt: skip
    return native < sdpa


def choose_prefill_kernel(num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """At engine load: time the bf16 prefill kernels for this shard's heads now, so that
    the first request does not (a no-op where the C kernel cannot take them)."""
    if _native_prefill_builds(head_dim):
        native_prefill_wins(num_q_heads, num_kv_heads, head_dim, torch.get_num_threads())


def _native_prefill_builds(head_dim: int) -> bool:
    """Whether a C prefill kernel was built here for this head_dim."""
    return _prefill_kernel(head_dim) is not None


@dataclass(frozen=True)
class PrefillKernel:
    """A C prefill kernel: ``amx`` (prefill_attention_amx.c, which also reads fp8 pages) or
    ``avx512_bf16`` (prefill_attention_cpu.c, bf16 pages only), and its entry point."""

    name: str
    entry: object  # the ctypes function

    @property
    def reads_fp8_pages(self) -> bool:
        return self.name == "amx"


def _prefill_kernel(head_dim: int) -> PrefillKernel | None:
    """The C prefill kernel for this head_dim: the AMX one where the CPU has AMX and it takes
    the head_dim, else the AVX-512 BF16 one where that was built; None where neither."""
    lib = cpu_native.library()
    if lib is None:
        return None
    if head_dim in (32, 64) and lib.prefill_attention_amx_available():
        return PrefillKernel("amx", lib.prefill_attention_amx_bf16)
    if lib.prefill_attention_bf16_available() and head_dim % 32 == 0:
        return PrefillKernel("avx512_bf16", lib.prefill_attention_bf16)
    return None


def _reads_pages(kernel: PrefillKernel | None, k_cache, v_cache, k_scale) -> bool:
    """Whether ``kernel`` reads a cached prefix in place from these pages: contiguous, bf16,
    or fp8 with their scales where the kernel widens fp8."""
    if kernel is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    if k_cache.dtype == torch.bfloat16:
        return True
    return k_cache.dtype == FP8_DTYPE and k_scale is not None and kernel.reads_fp8_pages


def _best_s(run, repeats: int = 3) -> float:
    run()  # warm: first-touch pages, oneDNN's kernel generation
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _sdpa_prefill(q, k, v, mask, softmax_scale) -> torch.Tensor:
    """One sequence's q [new, Hq, D] over keys/values [S, Hkv, D] -> [1, Hq, new, D];
    causal from the top left where ``mask`` is None."""
    return F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, Hq, new, D]
        k.transpose(0, 1)[None],  # [1, Hkv, S, D]
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=softmax_scale,
        enable_gqa=True,
    )


def _prefill_attention_native(
    kernel: PrefillKernel, q, k, v, k_cache, v_cache, k_scale, v_scale, batch, softmax_scale, out
) -> bool:
    """The batch's sequences through ``kernel`` into out's rows (the AMX kernel in one call,
    the other one sequence by sequence); False (nothing written) where it declined, so the
    caller runs SDPA."""
    if not batch.sequences:
        return True
    num_q_heads, head_dim = q.shape[1:]
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    batch.check_fits(num_blocks)
    tables = batch.tables
    heads = (num_q_heads, num_kv_heads, head_dim, softmax_scale)
    threads = torch.get_num_threads()
    if kernel.reads_fp8_pages:
        fp8 = k_cache.dtype == FP8_DTYPE
        scales = [s.float().contiguous() if fp8 else None for s in (k_scale, v_scale)]
        status = kernel.entry(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            k_cache.data_ptr(), v_cache.data_ptr(),
            None if tables is None else tables.data_ptr(), batch.table_starts.data_ptr(),
            block_size, len(batch.sequences), batch.starts.data_ptr(), batch.lengths.data_ptr(),
            batch.prefixes.data_ptr(), *heads, out.data_ptr(), out.stride(0), threads,
            *(s.data_ptr() if s is not None else None for s in scales), int(fp8),
        )  # fmt: skip
    else:
        status = 0
        for seq in batch.sequences:
            at = seq.start
            status = kernel.entry(
                q[at:].data_ptr(), q.stride(0), k[at:].data_ptr(), k.stride(0),
                v[at:].data_ptr(), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                seq.table.data_ptr() if seq.table is not None else None, block_size,
                seq.end - seq.start, seq.prefix, *heads, out[at:].data_ptr(), out.stride(0),
                threads,
            )  # fmt: skip
            if status:
                break
    if status == -1:
        raise MemoryError("prefill attention could not allocate its scratch memory")
    return status == 0
