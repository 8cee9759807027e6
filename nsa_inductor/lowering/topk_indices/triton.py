"""Triton kernel of ``nsa.topk_indices``: a bisection select on order-preserving integer keys, one row per program.

Why this shape: the cost of a row is the number of CTA-wide counts, not bytes (a row of 8192 fp32 is 32 KB). The
row stays in registers when it fits one block (rows of up to 8192 columns; longer rows are re-read from L2 per
step); each step is one compare-and-count, and the search stops as soon as the keys at or above the bound are
exactly the ones wanted. Per-phase costs on the H200 are in BENCHMARKS.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_common import next_power_of_2

# Rows up to this many columns stay in registers; longer rows are streamed in blocks of this size.
MAX_BLOCK = 8192
# Up to this k, and this many rows, the survivors are sorted in registers by the kernel itself (one sort per
# program); more rows are ordered by one batched torch sort after the kernel (BENCHMARKS.md, top-k).
MAX_SORTED_K = 4096
MAX_SORTED_ROWS = 256


@triton.jit
def _order_key(x):
    """fp32 -> uint32 ordered as torch.topk ranks values: -inf lowest, NaN of either sign highest."""
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed int32 ordered like the floats
    key = tl.where(x != x, 0x7FFFFFFF, key)
    return key.to(tl.uint32, bitcast=True) ^ 0x80000000  # sign bit flipped: unsigned order


@triton.jit
def _load_keys(src, col, length):
    """Keys of columns ``[0, length)``; columns outside (either side) read as the lowest key, never load."""
    x = tl.load(src + col, mask=(col >= 0) & (col < length), other=float("-inf"))
    return _order_key(x), x


@triton.jit
def _count_at_least(src, u0, cols, length, bound, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """Keys >= bound among the row's first ``length`` columns."""
    if ONE_BLOCK:
        count = tl.sum(((cols < length) & (u0 >= bound)).to(tl.int32), axis=0)
    else:
        count = tl.zeros((), dtype=tl.int32)
        for start in range(0, length, BLOCK):
            u, _ = _load_keys(src, start + cols, length)
            count += tl.sum(((start + cols < length) & (u >= bound)).to(tl.int32), axis=0)
    return count


@triton.jit
def _topk_indices_kernel(logits, lengths, offset, out, n_cols, stride_row, k,
                         HAS_LENGTHS: tl.constexpr, HAS_OFFSET: tl.constexpr, PAD_COLUMNS: tl.constexpr,
                         SORTED: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, K_POW2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = logits + row * stride_row
    dst = out + row * k
    length = n_cols
    if HAS_LENGTHS:
        length = tl.minimum(tl.maximum(tl.load(lengths + row).to(tl.int32), 0), n_cols)
    take = tl.minimum(k, length)
    cols = tl.arange(0, BLOCK)
    u0, x0 = _load_keys(src, cols, length)

    # bisection on the key bits, top down. Invariants: count(key >= bound) = at_bound >= take, and
    # above_bound = count(key >= the last bound that failed) < take, i.e. count(key > bound) once all bits are set.
    bound = tl.zeros((), dtype=tl.uint32)
    at_bound = length
    above_bound = tl.zeros((), dtype=tl.int32)
    shift = tl.full((), 31, tl.uint32)
    go = take > 0
    while go:
        trial = bound | (tl.full((), 1, tl.uint32) << shift)
        count = _count_at_least(src, u0, cols, length, trial, BLOCK, ONE_BLOCK)
        bound = tl.where(count >= take, trial, bound)
        above_bound = tl.where(count >= take, above_bound, count)
        at_bound = tl.where(count >= take, count, at_bound)
        go = (at_bound != take) & (shift > 0)
        shift -= 1

    # exact: the keys >= bound are the ones wanted; else bound is the k-th key and `need` of its ties are taken
    exact = at_bound == take
    need = tl.where(exact, 0, take - above_bound)
    n_above = take - need
    above_seen = tl.zeros((), dtype=tl.int32)
    ties_seen = tl.zeros((), dtype=tl.int32)
    shift_cols = tl.zeros((), dtype=tl.int64)
    if HAS_OFFSET:
        shift_cols = tl.load(offset + row).to(tl.int64)
    for start in range(0, length, BLOCK):
        col = start + cols
        if ONE_BLOCK:
            u, x = u0, x0
        else:
            u, x = _load_keys(src, col, length)
        valid = col < length
        is_above = valid & ((u > bound) | ((u == bound) & exact))
        is_tie = valid & (u == bound) & (at_bound != take)
        ranks = tl.cumsum(is_above.to(tl.int32) + (is_tie.to(tl.int32) << 16), axis=0)  # two counts, one scan
        above_rank = above_seen + (ranks & 0xFFFF) - 1
        tie_rank = ties_seen + (ranks >> 16) - 1
        chosen_tie = is_tie & (tie_rank < need)
        slot = tl.where(is_above, above_rank, n_above + tie_rank)
        index = col.to(tl.int64) - shift_cols
        if not PAD_COLUMNS:
            index = tl.where(x == float("-inf"), -1, index)
        # (the sum of the two masks: the interpreter's `|` of these masks is not a boolean)
        tl.store(dst + slot, index.to(tl.int32), mask=(is_above.to(tl.int32) + chosen_tie.to(tl.int32)) > 0)
        above_seen += tl.sum(is_above.to(tl.int32), axis=0)
        ties_seen += tl.sum(is_tie.to(tl.int32), axis=0)

    for start in range(take, k, BLOCK):  # rows with fewer than k columns
        slot = start + cols
        fill = tl.full((BLOCK,), -1, tl.int64)
        if PAD_COLUMNS:  # distinct columns past the row's length (k <= N, and they read as -inf)
            fill = length + (slot - take).to(tl.int64) - shift_cols
        tl.store(dst + slot, fill.to(tl.int32), mask=slot < k)

    if SORTED:  # descending value order: sort the k survivors by (key, index) in registers
        tl.debug_barrier()
        slots = tl.arange(0, K_POW2)
        index = tl.load(dst + slots, mask=slots < k, other=-1)
        marker = slots >= k  # -1 of an -inf value or a missing column, and the lanes past k
        if not PAD_COLUMNS:
            marker |= index == -1
        u, _ = _load_keys(src, index.to(tl.int64) + shift_cols, length)
        signed = (u ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64)
        empty = tl.full((), -9223372036854775807, tl.int64) - 1  # below every selected key
        packed = tl.where(marker, empty, (signed << 32) | (index.to(tl.int64) & 0xFFFFFFFF))
        packed = tl.sort(packed, descending=True)
        tl.debug_barrier()
        tl.store(dst + slots, tl.where(packed == empty, -1, (packed & 0xFFFFFFFF).to(tl.int32)), mask=slots < k)


def block_for(n_cols: int) -> int:
    """Columns held in registers for rows of ``n_cols``: the whole row up to ``MAX_BLOCK``."""
    return min(max(next_power_of_2(n_cols), 128), MAX_BLOCK)


def topk_indices(logits, k, lengths, offset, pad="neg1", sorted=False, out=None, block=None):
    """``[R, k]`` int32 per the op contract (see ``nsa.topk_indices``); ``block`` (a power of two) overrides the
    columns held in registers, so tests reach the streamed path at small sizes."""
    rows, n_cols = logits.shape
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int32, device=logits.device)
    if rows == 0 or k == 0:
        return out
    block = block or block_for(n_cols)
    sort_in_kernel = sorted and k <= MAX_SORTED_K and rows <= MAX_SORTED_ROWS
    _topk_indices_kernel[(rows,)](
        logits, lengths if lengths is not None else logits, offset if offset is not None else logits, out,
        n_cols, logits.stride(0), k,
        HAS_LENGTHS=lengths is not None, HAS_OFFSET=offset is not None, PAD_COLUMNS=pad == "column",
        SORTED=sort_in_kernel, BLOCK=block, ONE_BLOCK=n_cols <= block, K_POW2=next_power_of_2(k),
        num_warps=4 if rows >= 1024 or block <= 1024 else 8,
    )
    if sorted and not sort_in_kernel:
        cols = out.long() + (0 if offset is None else offset.long()[:, None])
        values = logits.gather(1, cols.clamp(0, n_cols - 1))
        if lengths is not None:
            values = values.masked_fill(cols >= lengths.long()[:, None], float("-inf"))
        if pad != "column":
            values = values.masked_fill(out == -1, float("-inf"))
        bits = values.view(torch.int32)
        key = torch.where(values.isnan(), torch.iinfo(torch.int32).max, bits ^ ((bits >> 31) & 0x7FFFFFFF))
        out.copy_(out.gather(1, key.argsort(dim=1, descending=True)))  # the kernel's key order: NaN first
    return out
