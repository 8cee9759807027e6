"""Triton kernel of ``nsa.topk_indices``: a radix select of the k-th largest key per row, then one compaction."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sortable_key(x):
    """fp32 -> int64 in [0, 2^32) ordered like the floats (bit flip of negatives, sign bit moved to the top)."""
    bits = x.to(tl.int32, bitcast=True)
    flipped = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return flipped.to(tl.int64) + 2147483648


@triton.jit
def _topk_indices_kernel(logits, lengths, offset, out, n_cols, stride_row, k,
                         HAS_LENGTHS: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program. The k-th largest key is found bit by bit (32 counting sweeps of the row, which stays
    in L1/L2); then one sweep writes every key above it and the first ties at it, compacted with prefix sums."""
    row = tl.program_id(0).to(tl.int64)
    src = logits + row * stride_row
    dst = out + row * k
    length = n_cols
    if HAS_LENGTHS:
        length = tl.minimum(tl.maximum(tl.load(lengths + row).to(tl.int32), 0), n_cols)
    take = tl.minimum(k, length)
    shift = 0
    if HAS_OFFSET:
        shift = tl.load(offset + row).to(tl.int64)
    cols = tl.arange(0, BLOCK)

    threshold = tl.zeros((), dtype=tl.int64)
    for step in range(32):
        candidate = threshold | (tl.full((), 1, tl.int64) << (31 - step))
        count = tl.zeros((), dtype=tl.int32)
        for start in range(0, length, BLOCK):
            col = start + cols
            key = _sortable_key(tl.load(src + col, mask=col < length, other=0.0))
            count += tl.sum(((key >= candidate) & (col < length)).to(tl.int32), axis=0)
        threshold = tl.where(count >= take, candidate, threshold)

    above_total = tl.zeros((), dtype=tl.int32)
    for start in range(0, length, BLOCK):
        col = start + cols
        key = _sortable_key(tl.load(src + col, mask=col < length, other=0.0))
        above_total += tl.sum(((key > threshold) & (col < length)).to(tl.int32), axis=0)
    ties_wanted = take - above_total

    above_seen = tl.zeros((), dtype=tl.int32)
    ties_seen = tl.zeros((), dtype=tl.int32)
    for start in range(0, length, BLOCK):
        col = start + cols
        valid = col < length
        x = tl.load(src + col, mask=valid, other=0.0)
        key = _sortable_key(x)
        above = valid & (key > threshold)
        tie = valid & (key == threshold)
        above_rank = above_seen + tl.cumsum(above.to(tl.int32), axis=0) - 1
        tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        chosen_tie = tie & (tie_rank < ties_wanted)
        slot = tl.where(above, above_rank, above_total + tie_rank)
        index = tl.where(x == float("-inf"), -1, col.to(tl.int64) - shift).to(tl.int32)
        tl.store(dst + slot, index, mask=above | chosen_tie)
        above_seen += tl.sum(above.to(tl.int32), axis=0)
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)

    for start in range(take, k, BLOCK):
        slot = start + cols
        tl.store(dst + slot, tl.full((BLOCK,), -1, tl.int32), mask=slot < k)


TOPK_BLOCK = 1024


def topk_indices(logits, k, lengths, offset, out=None):
    """``[R, k]`` int32: a top-k set per row (the larger values in column order, then the ties), -1 for -inf values
    and missing columns."""
    rows, n_cols = logits.shape
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int32, device=logits.device)
    if rows == 0 or k == 0:
        return out
    _topk_indices_kernel[(rows,)](
        logits, lengths if lengths is not None else logits, offset if offset is not None else logits, out,
        n_cols, logits.stride(0), k,
        HAS_LENGTHS=lengths is not None, HAS_OFFSET=offset is not None, BLOCK=TOPK_BLOCK, num_warps=4,
    )
    return out
