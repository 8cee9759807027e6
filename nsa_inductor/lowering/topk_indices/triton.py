"""Triton kernel of ``nsa.topk_indices``: a bisection select on order-preserving integer keys.

Why this shape: the cost of a row is the number of CTA-wide counts, not bytes (a row of 8192 fp32 is 32 KB). A row
of up to ``MAX_BLOCK`` columns stays in one program's registers; each step is one compare-and-count, and the search
stops as soon as the keys at or above the bound are exactly the ones wanted. A longer row is split: one program per
segment of ``MAX_BLOCK`` columns selects that segment's top k (in registers), then one program per row selects the
top k of those candidates; the top k of a row is among its segments' top k, and no program waits on another (two
launches, safe under CUDA-graph capture). Per-phase costs on the H200 are in BENCHMARKS.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_common import next_power_of_2

# Rows up to this many columns stay in registers; longer rows are split into segments of this size (or, where the
# segments' candidates would not be much fewer than the columns, streamed in blocks of this size).
MAX_BLOCK = 8192
# Up to this k, and this many rows, the survivors are sorted in registers by the kernel itself (one sort per
# program); more rows are ordered by one batched torch sort after the kernel (BENCHMARKS.md, top-k).
MAX_SORTED_K = 4096
MAX_SORTED_ROWS = 256

# What a program selects from (`MODE`): a row's columns, one segment of a row (writing candidate columns), or the
# candidate columns its row's segments wrote.
ROWS, SEGMENTS, CANDIDATES = 0, 1, 2
KEY_NEG_INF = tl.constexpr(0x007FFFFF)  # _order_key(-inf): every key of a real value is >= this one


@triton.jit
def _order_key(x):
    """fp32 -> uint32 ordered as torch.topk ranks values: -inf lowest, NaN of either sign highest."""
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed int32 ordered like the floats
    key = tl.where(x != x, 0x7FFFFFFF, key)
    return key.to(tl.uint32, bitcast=True) ^ 0x80000000  # sign bit flipped: unsigned order


@triton.jit
def _columns(cand, pos, n_pos, GATHER: tl.constexpr):
    """Column at each position (-1: none): the position itself below ``n_pos``, or with ``GATHER`` the candidate
    column listed at ``cand[pos]``."""
    if GATHER:
        return tl.load(cand + pos, mask=pos < n_pos, other=-1)
    return tl.where(pos < n_pos, pos, -1)


@triton.jit
def _keys(src, col):
    """Order keys of the values at ``col``; 0, below every value's key, where ``col`` is -1 (never loaded)."""
    x = tl.load(src + col, mask=col >= 0, other=float("-inf"))
    return tl.where(col >= 0, _order_key(x), 0)


@triton.jit
def _position_keys(src, cand_keys, pos, n_pos, GATHER: tl.constexpr):
    """Keys at positions ``pos`` (0 past ``n_pos``): of the row's columns, or with ``GATHER`` the candidates' keys
    their segments wrote (contiguous: no gather of the logits per bisection step)."""
    if GATHER:
        return tl.load(cand_keys + pos, mask=pos < n_pos, other=0).to(tl.uint32, bitcast=True)
    return _keys(src, tl.where(pos < n_pos, pos, -1))


@triton.jit
def _count_at_least(src, cand_keys, u0, pos, n_pos, bound, GATHER: tl.constexpr, BLOCK: tl.constexpr,
                    ONE_BLOCK: tl.constexpr):
    """Keys >= bound (> 0: positions without a column never count)."""
    if ONE_BLOCK:
        count = tl.sum((u0 >= bound).to(tl.int32), axis=0)
    else:
        count = tl.zeros((), dtype=tl.int32)
        for start in range(0, n_pos, BLOCK):
            u = _position_keys(src, cand_keys, start + pos, n_pos, GATHER)
            count += tl.sum((u >= bound).to(tl.int32), axis=0)
    return count


@triton.jit
def _topk_indices_kernel(logits, lengths, offset, cand, cand_keys, out, n_cols, stride_row, k, n_segments,
                         HAS_LENGTHS: tl.constexpr, HAS_OFFSET: tl.constexpr, MODE: tl.constexpr,
                         PAD_COLUMNS: tl.constexpr, SORTED: tl.constexpr, BLOCK: tl.constexpr,
                         ONE_BLOCK: tl.constexpr, K_POW2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = logits + row * stride_row
    length = n_cols
    if HAS_LENGTHS:
        length = tl.minimum(tl.maximum(tl.load(lengths + row).to(tl.int32), 0), n_cols)
    take = tl.minimum(k, length)
    n_pos = length
    col_base = tl.zeros((), dtype=tl.int64)  # column of position 0 (a segment's first)
    dst = out + row * k
    keys_dst = cand_keys
    if MODE == 1:  # SEGMENTS: this program's segment; it writes its top k (absolute columns and keys), then -1 / 0
        segment = tl.program_id(1)
        col_base = segment.to(tl.int64) * BLOCK
        src += col_base
        n_pos = tl.minimum(tl.maximum(length - segment * BLOCK, 0), BLOCK)
        take = tl.minimum(k, n_pos)
        dst = cand + (row * n_segments + segment) * k
        keys_dst = cand_keys + (row * n_segments + segment) * k
    cand_row = cand + row * n_segments * k
    keys_row = cand_keys + row * n_segments * k
    if MODE == 2:  # CANDIDATES: the columns this row's segments wrote
        n_pos = n_segments * k
    pos = tl.arange(0, BLOCK)
    u0 = _position_keys(src, keys_row, pos, n_pos, MODE == 2)

    # Invariants of the bisection on the key bits, top down: count(key >= bound) = at_bound >= take, and
    # above_bound = count(key >= the last bound that failed) < take, i.e. count(key > bound) once all bits are set.
    # With fewer than `take` values above -inf it is over at once: the -inf entries are the ties at the bound.
    # (k = 0 starts at the highest key: nothing is above it, and no tie is needed.)
    n_valid = n_pos
    if MODE == 2:
        n_valid = _count_at_least(src, keys_row, u0, pos, n_pos, 1, True, BLOCK, ONE_BLOCK)
    n_finite = _count_at_least(src, keys_row, u0, pos, n_pos, KEY_NEG_INF + 1, MODE == 2, BLOCK, ONE_BLOCK)
    bound = tl.full((), 0, tl.uint32)
    bound = tl.where(n_finite < take, tl.full((), KEY_NEG_INF, tl.uint32), bound)
    bound = tl.where(take == 0, tl.full((), 0xFFFFFFFF, tl.uint32), bound)
    at_bound = n_valid
    above_bound = tl.where(n_finite < take, n_finite, 0)
    shift = tl.full((), 31, tl.uint32)
    go = (take > 0) & (at_bound != take) & (n_finite >= take)
    while go:
        trial = bound | (tl.full((), 1, tl.uint32) << shift)
        count = _count_at_least(src, keys_row, u0, pos, n_pos, trial, MODE == 2, BLOCK, ONE_BLOCK)
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
    if HAS_OFFSET and MODE != 1:
        shift_cols = tl.load(offset + row).to(tl.int64)
    for start in range(0, n_pos, BLOCK):
        col = _columns(cand_row, start + pos, n_pos, MODE == 2)
        if ONE_BLOCK:
            u = u0
        else:
            u = _position_keys(src, keys_row, start + pos, n_pos, MODE == 2)
        is_above = (u > 0) & ((u > bound) | ((u == bound) & exact))
        is_tie = (u > 0) & (u == bound) & (at_bound != take)
        ranks = tl.cumsum(is_above.to(tl.int32) + (is_tie.to(tl.int32) << 16), axis=0)  # two counts, one scan
        above_rank = above_seen + (ranks & 0xFFFF) - 1
        tie_rank = ties_seen + (ranks >> 16) - 1
        chosen_tie = is_tie & (tie_rank < need)
        slot = tl.where(is_above, above_rank, n_above + tie_rank)
        index = col.to(tl.int64) + col_base - shift_cols
        if MODE != 1 and not PAD_COLUMNS:
            index = tl.where(u == KEY_NEG_INF, -1, index)
        # (the sum of the two masks: the interpreter's `|` of these masks is not a boolean)
        chosen = (is_above.to(tl.int32) + chosen_tie.to(tl.int32)) > 0
        tl.store(dst + slot, index.to(tl.int32), mask=chosen)
        if MODE == 1:
            tl.store(keys_dst + slot, u.to(tl.int32, bitcast=True), mask=chosen)
        above_seen += tl.sum(is_above.to(tl.int32), axis=0)
        ties_seen += tl.sum(is_tie.to(tl.int32), axis=0)

    for start in range(take, k, BLOCK):  # fewer than k columns (in the row, or in a segment: -1, no candidate)
        slot = start + pos
        fill = tl.full((BLOCK,), -1, tl.int64)
        if PAD_COLUMNS and MODE != 1:  # distinct columns past the row's length (k <= N, and they read as -inf)
            fill = length + (slot - take).to(tl.int64) - shift_cols
        tl.store(dst + slot, fill.to(tl.int32), mask=slot < k)
        if MODE == 1:
            tl.store(keys_dst + slot, tl.zeros((BLOCK,), tl.int32), mask=slot < k)

    if SORTED:  # descending value order: sort the k survivors by (key, index) in registers
        tl.debug_barrier()
        slots = tl.arange(0, K_POW2)
        index = tl.load(dst + slots, mask=slots < k, other=-1)
        marker = slots >= k  # -1 of an -inf value or a missing column, and the lanes past k
        if not PAD_COLUMNS:
            marker |= index == -1
        col = index.to(tl.int64) + shift_cols
        u = tl.maximum(_keys(src, tl.where((col >= 0) & (col < length), col, -1)), KEY_NEG_INF)  # past it: -inf
        signed = (u ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64)
        empty = tl.full((), -9223372036854775807, tl.int64) - 1  # below every selected key
        packed = tl.where(marker, empty, (signed << 32) | (index.to(tl.int64) & 0xFFFFFFFF))
        packed = tl.sort(packed, descending=True)
        tl.debug_barrier()
        tl.store(dst + slots, tl.where(packed == empty, -1, (packed & 0xFFFFFFFF).to(tl.int32)), mask=slots < k)


def block_for(n_cols: int) -> int:
    """Columns held in registers for rows of ``n_cols``: the whole row up to ``MAX_BLOCK``."""
    return min(max(next_power_of_2(n_cols), 128), MAX_BLOCK)


def segments_for(n_cols: int, k: int, block: int) -> int:
    """Segments of ``block`` columns a row of ``n_cols`` is split into (1: not split, the row is held or streamed by
    one program): only where the segments' candidates, ``k`` each, are at most half the columns."""
    segments = -(-n_cols // block)
    return segments if segments > 1 and 2 * segments * k <= n_cols else 1


def warps_for(rows: int, block: int, sort_in_kernel: bool) -> int:
    """Warps per program: fewer where many rows fill the GPU anyway or the block is small; more for the in-register
    sort (BENCHMARKS.md, top-k warps)."""
    if rows >= 1024 or block <= 1024:
        return 4
    return 16 if sort_in_kernel else 8


def topk_indices(logits, k, lengths, offset, pad="neg1", sorted=False, out=None, block=None, num_warps=None):
    """``[R, k]`` int32 per the op contract (see ``nsa.topk_indices``); ``block`` (a power of two) overrides the
    columns held in registers, so tests reach the split and streamed paths at small sizes; ``num_warps`` overrides
    ``warps_for`` (the benchmark's sweep)."""
    rows, n_cols = logits.shape
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int32, device=logits.device)
    if rows == 0 or k == 0:
        return out
    block = block or block_for(n_cols)
    sort_in_kernel = sorted and k <= MAX_SORTED_K and rows <= MAX_SORTED_ROWS
    segments = segments_for(n_cols, k, block)
    flags = dict(HAS_LENGTHS=lengths is not None, HAS_OFFSET=offset is not None, PAD_COLUMNS=pad == "column",
                 BLOCK=block, K_POW2=next_power_of_2(k),
                 num_warps=num_warps or warps_for(rows, block, sort_in_kernel))
    lengths_arg = lengths if lengths is not None else logits
    offset_arg = offset if offset is not None else logits
    if segments == 1:
        _topk_indices_kernel[(rows,)](logits, lengths_arg, offset_arg, out, out, out, n_cols, logits.stride(0), k, 1,
                                      MODE=ROWS, SORTED=sort_in_kernel, ONE_BLOCK=n_cols <= block, **flags)
    else:
        cand = torch.empty(rows, segments, k, dtype=torch.int32, device=logits.device)
        cand_keys = torch.empty(rows, segments, k, dtype=torch.int32, device=logits.device)  # uint32 keys' bits
        _topk_indices_kernel[(rows, segments)](logits, lengths_arg, offset_arg, cand, cand_keys, out, n_cols,
                                               logits.stride(0), k, segments, MODE=SEGMENTS, SORTED=False,
                                               ONE_BLOCK=True, **flags)
        _topk_indices_kernel[(rows,)](logits, lengths_arg, offset_arg, cand, cand_keys, out, n_cols, logits.stride(0),
                                      k, segments, MODE=CANDIDATES, SORTED=sort_in_kernel,
                                      ONE_BLOCK=segments * k <= block, **flags)
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
