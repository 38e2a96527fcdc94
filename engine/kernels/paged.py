"""Loading a tile of K/V rows from the paged cache: the one access pattern the prefill and
decode attention kernels share."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_paged_kv_tile(
    bt_row,  # this sequence's block-table row
    kc_head,  # K cache base, offset to this kv head
    vc_head,  # V cache base, offset to this kv head
    tok,  # [N] absolute token positions of the tile
    tok_ok,  # [N] which of them exist
    offs_d,  # [D] head-dim offsets
    d_ok,  # [D] which of them exist
    stride_kcb,
    stride_kcr,
    stride_kcd,
    stride_vcb,
    stride_vcr,
    stride_vcd,
    BLOCK_SIZE: tl.constexpr,
):
    """Returns (page [N] int64, k [N, D], v [N, D]) in the cache dtype; missing rows are 0.
    A tile spans N / BLOCK_SIZE pages, each looked up in the block table."""
    page = tl.load(bt_row + tok // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
    row = tok % BLOCK_SIZE
    kv_mask = tok_ok[:, None] & d_ok[None, :]
    k = tl.load(
        kc_head
        + page[:, None] * stride_kcb
        + row[:, None] * stride_kcr
        + offs_d[None, :] * stride_kcd,
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        vc_head
        + page[:, None] * stride_vcb
        + row[:, None] * stride_vcr
        + offs_d[None, :] * stride_vcd,
        mask=kv_mask,
        other=0.0,
    )
    return page, k, v
