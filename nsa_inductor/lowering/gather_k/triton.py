"""Triton kernel of ``nsa.gather_k``: a byte copy (any fp8 type), BLOCK_R output rows per program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_common import (cdiv, empty_k_rows, launch, readable_index, scale_offsets, value_offsets,
                              wait_for_previous_grid)


@triton.jit
def _gather_k_kernel(
    values_ptr,
    scales_ptr,
    bt_ptr,
    cu_ptr,
    out_k_ptr,
    out_scale_ptr,
    num_tokens,
    batch,
    bt_stride,
    max_pages,
    num_pages,
    PAGE_SIZE: tl.constexpr,
    PRESHUFFLE: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Copy BLOCK_R output rows (raw fp8 bytes + scale); rows past ``cu_seqlens[-1]``, before ``cu_seqlens[0]`` or
    on an unreadable page get zeros."""
    wait_for_previous_grid(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, 128)
    # Binary search: the sequence of row r is the first b with cu[b+1] > r.
    lo = tl.zeros([BLOCK_R], dtype=tl.int32)
    hi = tl.zeros([BLOCK_R], dtype=tl.int32) + batch
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        right = tl.load(cu_ptr + mid + 1, mask=active, other=0) <= rows
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    seq = tl.minimum(lo, batch - 1)
    pos = rows - tl.load(cu_ptr + seq)
    page_col = pos // PAGE_SIZE
    in_table = (rows < tl.load(cu_ptr + batch)) & (pos >= 0) & (page_col < max_pages)
    page = tl.load(bt_ptr + seq.to(tl.int64) * bt_stride + page_col, mask=in_table, other=0)
    page, valid = readable_index(page, in_table, num_pages)
    in_page = pos % PAGE_SIZE
    k = tl.load(values_ptr + value_offsets(page[:, None], in_page[:, None], d[None, :], PAGE_SIZE, PRESHUFFLE),
                mask=valid[:, None], other=0)
    scale = tl.load(scales_ptr + scale_offsets(page, in_page, PAGE_SIZE), mask=valid, other=0.0)
    out_rows = rows < num_tokens
    tl.store(out_k_ptr + rows[:, None].to(tl.int64) * 128 + d[None, :], k, mask=out_rows[:, None])
    tl.store(out_scale_ptr + rows, scale, mask=out_rows)


def gather_k(cache, block_table, cu_seqlens, page_size, preshuffle, num_tokens, fp8_dtype, out=None,
             block_r: int = 16):
    """Contiguous ``(k_fp8 [num_tokens,128], k_scale [num_tokens])``; a byte copy, so any fp8 dtype works."""
    k_out, scale_out = out if out is not None else empty_k_rows(num_tokens, fp8_dtype, cache.device)
    if num_tokens:
        batch = block_table.shape[0]
        launch(_gather_k_kernel, (cdiv(num_tokens, block_r),), cache, cache.view(torch.float32), block_table,
               cu_seqlens, k_out.view(torch.uint8), scale_out, num_tokens, batch, block_table.stride(0),
               block_table.shape[1], cache.shape[0], PAGE_SIZE=page_size, PRESHUFFLE=preshuffle,
               SEARCH_STEPS=max(1, batch.bit_length()), BLOCK_R=block_r, num_warps=4)
    return k_out, scale_out
