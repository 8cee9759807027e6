"""Triton kernel of ``nsa.gather_k_slots``: a byte copy (any fp8 type), BLOCK_R tokens per program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_common import (cdiv, empty_k_rows, launch, readable_index, scale_offsets, value_offsets,
                              wait_for_previous_grid)


@triton.jit
def _gather_k_slots_kernel(
    values_ptr,
    scales_ptr,
    pos_ptr,
    bt_ptr,
    seq_ptr,
    out_k_ptr,
    out_scale_ptr,
    num_tokens,
    num_pages,
    batch,
    bt_stride,
    max_pages,
    PAGE_SIZE: tl.constexpr,
    PRESHUFFLE: tl.constexpr,
    BY_SEQUENCE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Copy BLOCK_R tokens' rows (raw fp8 bytes + scale); each id wraps as a Python index where it is in range
    (``readable_index``), a token with any other id gets zeros."""
    wait_for_previous_grid(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, 128)
    in_rows = rows < num_tokens
    pos = tl.load(pos_ptr + rows, mask=in_rows, other=0).to(tl.int64)
    if BY_SEQUENCE:
        seq = tl.load(seq_ptr + rows, mask=in_rows, other=0).to(tl.int64)
        seq, ok = readable_index(seq, in_rows, batch)
        pos, ok = readable_index(pos, ok, max_pages * PAGE_SIZE)  # wraps the page column, keeps pos % P
        page = tl.load(bt_ptr + seq * bt_stride + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
    else:
        pos, ok = readable_index(pos, in_rows, num_pages * PAGE_SIZE)  # a slot: page = slot // P
        page = pos // PAGE_SIZE
    page, ok = readable_index(page, ok, num_pages)
    in_page = pos % PAGE_SIZE  # non-negative operands only: Triton's // and % truncate
    k = tl.load(values_ptr + value_offsets(page[:, None], in_page[:, None], d[None, :], PAGE_SIZE, PRESHUFFLE),
                mask=ok[:, None], other=0)
    scale = tl.load(scales_ptr + scale_offsets(page, in_page, PAGE_SIZE), mask=ok, other=0.0)
    tl.store(out_k_ptr + rows[:, None].to(tl.int64) * 128 + d[None, :], k, mask=in_rows[:, None])
    tl.store(out_scale_ptr + rows, scale, mask=in_rows)


def gather_k_slots(cache, positions, page_size, preshuffle, fp8_dtype, block_table=None, seq_ids=None, out=None,
                   block_r: int = 16):
    """``(k_fp8 [N, 128], k_scale [N])``; a byte copy, so any fp8 dtype works."""
    num_tokens = positions.shape[0]
    k_out, scale_out = out if out is not None else empty_k_rows(num_tokens, fp8_dtype, cache.device)
    if num_tokens:
        by_sequence = block_table is not None
        launch(_gather_k_slots_kernel, (cdiv(num_tokens, block_r),), cache, cache.view(torch.float32), positions,
               block_table if by_sequence else positions, seq_ids if by_sequence else positions,
               k_out.view(torch.uint8), scale_out, num_tokens, cache.shape[0],
               block_table.shape[0] if by_sequence else 1, block_table.stride(0) if by_sequence else 0,
               block_table.shape[1] if by_sequence else 1, PAGE_SIZE=page_size, PRESHUFFLE=preshuffle,
               BY_SEQUENCE=by_sequence, BLOCK_R=block_r, num_warps=4)
    return k_out, scale_out
