"""Triton kernels of ``nsa.topk_indices``: a bisection select on order-preserving integer keys, and a radix
pre-filter that leaves the bisection a few hundred candidates, spread over many programs for few long rows or in
one program per row for many rows.

Why three paths: a row costs its CTA-wide counts and per-element work, not its bytes (a row of 8192 fp32 is 32 KB).
The bisection holds a row of up to ``MAX_BLOCK`` columns in registers and counts once per trial bound (guessed from
the row's mean and deviation, then interpolated) until the keys at or above the bound are exactly the ones wanted
(a longer row is split: one program per segment selects its top k, then one per row among those); it needs the
whole row in registers, so few programs fit an SM. The radix pre-filter takes a histogram of a digit, writes the
columns above the boundary bin at once and compacts those in it, and searches among those candidates only: in two
launches over (row, segment) programs where rows are few (every SM busy; the row's last program to finish its
compaction selects; where a launch has many segments, a launch of a program per row finds each row's boundary bin
and segments' offsets, and another selects, so that the compaction holds few registers; without lengths, one more
first takes each row's digit from a window around its k-th value found from a sample of the row: 32 bins, not
256), in one launch of one program per row streaming the row in chunks where rows are many (small programs, many
per SM). The compactions hold their columns as vectors of 4 (one scan step a vector). No program waits on another
(CUDA-graph safe).
Costs on the H200: BENCHMARKS.md, top-k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_common import launch, next_power_of_2, wait_for_previous_grid, warp_threads

# Rows up to this many columns stay in registers; longer rows are split into segments of this size (or, where the
# segments' candidates would not be much fewer than the columns, streamed in blocks of this size).
MAX_BLOCK = 8192

# How rows are selected (`path_for`): bisection over each row's keys; the radix pre-filter spread over (row, segment)
# programs in two launches; the radix pre-filter in one program per row.
PATHS = ("bisect", "radix_split", "radix_row")
# What a program selects from (`MODE`): a row's columns, one segment of a row (writing candidate columns), or the
# candidate columns its row's segments wrote.
ROWS, SEGMENTS, CANDIDATES = 0, 1, 2
KEY_NEG_INF = tl.constexpr(0x007FFFFF)  # _order_key(-inf): every key of a real value is >= this one
EMPTY = tl.constexpr(-9223372036854775808)  # sort key of -1 entries: below every selected key
# Bins of the radix digit (`_radix_digit`): 128 for one program per row (its histogram is most of its work), 256
# where rows are split (the decode steps' own logits leave too many candidates in half-octave bins; BENCHMARKS.md)
RADIX_ROW_BINS = 128
RADIX_SPLIT_BINS = 256
# The split path with its bounds launch bins values by the row's window instead (`_window_digit`: 0 no column, 1
# below the window, 2..30 equal widths of it, 31 at or above it): `tl.histogram` costs a ballot per digit bit and a
# count per bin a lane holds, 8 ballots and 8 counts a column at 256 bins, 5 and 1 at 32. The window comes from a
# jittered stratified sample of RADIX_SAMPLE columns a row (`_row_window`): the sample's values ranked within
# WINDOW_SIGMAS binomial deviations (plus WINDOW_SLACK) of where the k-th largest value's rank falls, each widened
# to the sampled values of its radix bin of SAMPLE_BINS.
RADIX_WINDOW_BINS = 32
WINDOW_WIDTHS = tl.constexpr(29)
RADIX_SAMPLE = 512
SAMPLE_BINS = tl.constexpr(256)
WINDOW_SIGMAS = tl.constexpr(6.0)
WINDOW_SLACK = tl.constexpr(4.0)
WINDOW_EDGE = tl.constexpr(2.0**126)  # the window's ends clipped to +-this: its width stays finite
# A row's entries in the split path's per-row scratch (`row_stats`): its boundary bin, the columns above it and in
# it (the bounds launch), the window's low and high ends and its bins' scale (the window launch; fp32 bits).
ROW_STATS = tl.constexpr(8)
INTERPOLATION_STEPS = tl.constexpr(12)  # of the select's search (after a whole row's two guided trials), then it halves
# A whole row's search ends this many keys or fewer from the take-th at an end of its bracket by taking the keys off
# that end one reduction each (`_peel_end`), where counting trial bounds closes in a key at a time.
WHOLE_ROW_PEEL = tl.constexpr(2)
# the whole-row search interpolates on values within about two powers of two (2^23 keys each), on keys beyond
VALUE_SPAN_KEYS = tl.constexpr(1 << 24)
# Vectors of a thread the writes' prefix sum (`_prefix_sum`) takes in turn before the next thread's: one scan across
# the threads a group. Larger groups scan less, but spread a warp's stores over more memory sectors (a lane's next
# entry is a group's worth of its columns on): best on an H100, the select's 2, the compactions' 4 (BENCHMARKS.md,
# top-k, "The writes' scan thread by thread").
SELECT_SCAN_GROUP = tl.constexpr(2)
COMPACT_SCAN_GROUP = tl.constexpr(4)
# The split radix path: rows up to this many of 16K+ columns go through it. Boundary-bin candidates the radix paths
# keep at most (more: the row is selected from itself).
RADIX_MAX_ROWS = 128
RADIX_CAPACITY = 16384
# The split path's final select holds a row's candidates in a block of half the one sized for a whole row, at most
# this many, where they fit (a short row's in an engine's max_model_len-wide logits, a random row's at 8192 or 32768
# columns) rather than in the whole row's (BENCHMARKS.md, top-k: each count reduces the whole block).
RADIX_SMALL_BLOCK = 2048
# The radix path in one launch (`_radix_row_kernel`): rows from which it is used, candidates its select holds in
# registers, warps (its chunk: `radix_row_chunk`).
RADIX_ROW_MIN_ROWS = 256
RADIX_ROW_BLOCK = 512
RADIX_ROW_WARPS = 4
RADIX_SELECT_WARPS = 4  # the split path's compaction and final select (BENCHMARKS.md, top-k: 4 beat 1, 2, 8, 16)
RADIX_COMPACT_WARPS = 8  # its compaction alone, after a bounds launch (BENCHMARKS.md, top-k: 8 beat 4 and 16)
RADIX_HISTOGRAM_WARPS = 8  # the split path's histogram (BENCHMARKS.md, top-k: 8 beat 4)
RADIX_BOUNDS_WARPS = 4  # (not tuned: ~2 µs at 64 x 65536)
RADIX_WINDOW_WARPS = 4  # (not tuned: ~2.5 µs at 64 x 65536)
# Segments of 512 columns a split launch may have (`radix_sizes`: 8 x 8192 and 16 x 4096 faster at 512 than 1024,
# 16 x 8192 slower; BENCHMARKS.md, top-k).
RADIX_SHORT_SEGMENTS = 128
# The split path's segments a launch beyond which it runs its bounds and select launches (`radix_bounds`), and with
# lengths about as many compaction programs a launch, each taking several segments (`radix_programs`; BENCHMARKS.md,
# top-k).
RADIX_LAUNCH_PROGRAMS = 256
# The two-launch sort (sorted order of more survivors than one chunk): entries per chunk sorted in registers (512
# beat 256 and 1024 at 1-64 rows and in a causal prefill), and per program that places them (with one program per
# chunk the merge was a B=1 step's slowest kernel), twice as many from MERGE_MANY_ROWS rows (fewer programs where
# every SM is busy anyway; BENCHMARKS.md, top-k).
SORT_CHUNK = 512
MERGE_PART = 64
MERGE_MANY_ROWS = 512
# The merge's warps by rows (BENCHMARKS.md, top-k): 8 up to MERGE_FEW_ROWS (few programs, each searching with more
# threads), 2 up to MERGE_SOME_ROWS (more programs resident a multiprocessor), 4 beyond (a causal prefill: 2 is slower)
MERGE_FEW_ROWS = 16
MERGE_SOME_ROWS = 128
# The rank sort (`_rank_sort_kernel`: sorted order of up to RANK_SORT_MAX_ROWS rows on the split radix path, which
# writes the keys it needs): entries per program, entries compared per step, warps (BENCHMARKS.md, top-k).
RANK_SORT_MAX_ROWS = 4
RANK_PART = 16
RANK_BLOCK = 2048
RANK_WARPS = 4
# How the sorted order is made (`sort_for`), and the paths each way serves.
SORTS = {"in_kernel": ("bisect",), "ranks": ("radix_split",), "chunks": PATHS}


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
def _vector_positions(BLOCK: tl.constexpr):
    """Positions [0, BLOCK) as [BLOCK / 4, 4]: a thread holds 4 consecutive columns at a time, loaded as one vector,
    and the writes' prefix sum adds within them before it scans across threads (``_prefix_sum``)."""
    return tl.arange(0, BLOCK // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]


@triton.jit
def _vector_keys(src, pos, n_pos, n_readable):
    """Keys at positions ``pos`` of a row (0 from ``n_pos``), loaded up to ``n_readable`` (the row's end: whole
    vectors where it is a multiple of 16, as the launcher ensures for ``_vector_positions``)."""
    x = tl.load(src + pos, mask=pos < n_readable, other=float("-inf"))
    return tl.where(pos < n_pos, _order_key(x), 0)


@triton.jit
def _prefix_sum(x, VECTORS: tl.constexpr, THREADS: tl.constexpr, GROUP: tl.constexpr):
    """Inclusive prefix sum in scan order: a block's positions in order; with VECTORS (``_vector_positions``, where
    thread t of THREADS holds vectors t, t + THREADS, ...) GROUP of a thread's vectors in turn, then the same group
    of the next thread's, group after group: one scan across the threads (of their groups' totals) a group, not one
    a vector."""
    if VECTORS:
        if x.shape[0] > THREADS:
            REPS: tl.constexpr = x.shape[0] // THREADS
            G: tl.constexpr = GROUP if GROUP < REPS else REPS
            held = tl.reshape(x, (REPS // G, G, THREADS, 4))  # [group, vector in the group, thread, column]
            totals = tl.sum(held, axis=3)
            group_totals = tl.reshape(tl.sum(totals, axis=1), (REPS // G * THREADS,))  # by group, then thread
            groups_before = tl.reshape(tl.cumsum(group_totals, axis=0) - group_totals, (REPS // G, THREADS))
            before = groups_before[:, None, :] + tl.cumsum(totals, axis=1) - totals
            return tl.reshape(before[:, :, :, None] + tl.cumsum(held, axis=3), x.shape)
        else:
            totals = tl.sum(x, axis=1)
            return (tl.cumsum(totals, axis=0) - totals)[:, None] + tl.cumsum(x, axis=1)
    else:
        return tl.cumsum(x, axis=0)


@triton.jit
def _count_at_least(src, cand_keys, u0, pos, n_pos, bound, GATHER: tl.constexpr, BLOCK: tl.constexpr,
                    ONE_BLOCK: tl.constexpr):
    """Keys >= bound (> 0: positions without a column never count)."""
    if ONE_BLOCK:
        count = tl.sum(_flat((u0 >= bound).to(tl.int32)), axis=0)
    else:
        count = tl.zeros((), dtype=tl.int32)
        for start in range(0, n_pos, BLOCK):
            u = _position_keys(src, cand_keys, start + pos, n_pos, GATHER)
            count += tl.sum((u >= bound).to(tl.int32), axis=0)
    return count


@triton.jit
def _block_range(u):
    """(keys above -inf, the lowest key, the highest) of one block; keys 0 (no column) are neither counted nor the
    lowest. One CTA-wide reduction."""
    u = _flat(u)
    return tl.reduce(((u > KEY_NEG_INF).to(tl.int32), tl.where(u > 0, u, tl.full(u.shape, 0xFFFFFFFF, tl.uint32)), u),
                     0, _add_min_max)


@triton.jit
def _key_range(src, cand_keys, u0, pos, n_pos, GATHER: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """``_block_range`` of the keys at positions [0, n_pos)."""
    if ONE_BLOCK:
        count, lowest, highest = _block_range(u0)
    else:
        count = tl.zeros((), tl.int32)
        lowest = tl.full((), 0xFFFFFFFF, tl.uint32)
        highest = tl.zeros((), tl.uint32)
        for start in range(0, n_pos, BLOCK):
            block = _block_range(_position_keys(src, cand_keys, start + pos, n_pos, GATHER))
            count, lowest, highest = _add_min_max(count, lowest, highest, *block)
    return count, lowest, highest


@triton.jit
def _key_value(u):
    """The fp32 value of an order key (``_order_key`` inverted; key 0, below every value's, reads as NaN)."""
    signed = (u ^ 0x80000000).to(tl.int32, bitcast=True)
    return (signed ^ ((signed >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _flat(x):
    """x as one axis (no data moves: a thread's vectors are consecutive): a 1-D or ``_vector_positions`` block
    reduced whole."""
    return tl.reshape(x, (x.numel,))


@triton.jit
def _add_min_max(count_a, lowest_a, highest_a, count_b, lowest_b, highest_b):
    return count_a + count_b, tl.minimum(lowest_a, lowest_b), tl.maximum(highest_a, highest_b)


@triton.jit
def _add_three(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _block_moments(u):
    """(keys above -inf, the sum and the sum of squares of the finite values) of one block of keys, in one CTA-wide
    reduction."""
    u = _flat(u)
    x = _key_value(u)
    x = tl.where(tl.abs(x) < float("inf"), x, 0.0)
    return tl.reduce(((u > KEY_NEG_INF).to(tl.int32), x, x * x), 0, _add_three)


@triton.jit
def _key_moments(src, cand_keys, u0, pos, n_pos, GATHER: tl.constexpr, BLOCK: tl.constexpr,
                 ONE_BLOCK: tl.constexpr):
    """``_block_moments`` of the keys at positions [0, n_pos)."""
    if ONE_BLOCK:
        count, total, squares = _block_moments(u0)
    else:
        count = tl.zeros((), tl.int32)
        total = tl.zeros((), tl.float32)
        squares = tl.zeros((), tl.float32)
        for start in range(0, n_pos, BLOCK):
            block = _block_moments(_position_keys(src, cand_keys, start + pos, n_pos, GATHER))
            count, total, squares = _add_three(count, total, squares, *block)
    return count, total, squares


@triton.jit
def _block_split(u, trial):
    """(keys >= trial, the lowest of them, the highest key below trial) of one block, in one CTA-wide reduction."""
    u = _flat(u)
    at = u >= trial
    return tl.reduce((at.to(tl.int32), tl.where(at, u, tl.full(u.shape, 0xFFFFFFFF, tl.uint32)),
                      tl.where(at, tl.zeros_like(u), u)), 0, _add_min_max)


@triton.jit
def _split_at(src, cand_keys, u0, pos, n_pos, trial, GATHER: tl.constexpr, BLOCK: tl.constexpr,
              ONE_BLOCK: tl.constexpr):
    """``_block_split`` of the keys at positions [0, n_pos)."""
    if ONE_BLOCK:
        count, lowest, highest = _block_split(u0, trial)
    else:
        count = tl.zeros((), tl.int32)
        lowest = tl.full((), 0xFFFFFFFF, tl.uint32)
        highest = tl.zeros((), tl.uint32)
        for start in range(0, n_pos, BLOCK):
            block = _block_split(_position_keys(src, cand_keys, start + pos, n_pos, GATHER), trial)
            count, lowest, highest = _add_min_max(count, lowest, highest, *block)
    return count, lowest, highest


@triton.jit
def _lowest_count(low_a, n_a, low_b, n_b):
    low = tl.minimum(low_a, low_b)
    return low, tl.where(low_a == low, n_a, 0) + tl.where(low_b == low, n_b, 0)


@triton.jit
def _block_lowest(u, lo, top, flip):
    """(the lowest of the keys in [lo, top], each xor ``flip``, how many positions hold it) of one block, in one
    CTA-wide reduction (lo > 0: positions without a column are never in it)."""
    u = _flat(u)
    inside = (u >= lo) & (u <= top)
    return tl.reduce((tl.where(inside, u ^ flip, tl.full(u.shape, 0xFFFFFFFF, tl.uint32)), inside.to(tl.int32)), 0,
                     _lowest_count)


@triton.jit
def _key_lowest(src, cand_keys, u0, pos, n_pos, lo, top, flip, GATHER: tl.constexpr, BLOCK: tl.constexpr,
                ONE_BLOCK: tl.constexpr):
    """``_block_lowest`` of the keys at positions [0, n_pos)."""
    if ONE_BLOCK:
        lowest, n_lowest = _block_lowest(u0, lo, top, flip)
    else:
        lowest = tl.full((), 0xFFFFFFFF, tl.uint32)
        n_lowest = tl.zeros((), tl.int32)
        for start in range(0, n_pos, BLOCK):
            block = _block_lowest(_position_keys(src, cand_keys, start + pos, n_pos, GATHER), lo, top, flip)
            lowest, n_lowest = _lowest_count(lowest, n_lowest, *block)
    return lowest, n_lowest


@triton.jit
def _near_end(at_bound, above_bound, take, keys):
    """Whether a search's bracket is at most ``keys`` keys from the take-th at an end: take + 1 .. take + keys keys at
    or above its low end, or take - keys .. take - 1 above its high end (``_peel_end`` then ends it)."""
    return (((at_bound - take >= 1) & (at_bound - take <= keys))
            | ((take - above_bound >= 1) & (take - above_bound <= keys)))


@triton.jit
def _peel_end(src, cand_keys, u0, pos, n_pos, lo, hi, at_bound, above_bound, take, GATHER: tl.constexpr,
              BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """One reduction of a search near its end (``_near_end``), where counting trial bounds would close in a key at a
    time (a launch waits for its slowest row): the key at the end of the bracket [lo, hi) nearer the take-th (its
    lowest, or its highest as the lowest of the keys' complements) and how many positions hold it; its keys leave
    the bracket, or it is the take-th key (ties, or exactly take at or above it). Returns (lo, hi, at_bound,
    above_bound) as the search keeps them: one key from the take-th at an end, this ends it."""
    at_low = at_bound - take <= take - above_bound
    flip = tl.where(at_low, 0, 0xFFFFFFFF).to(tl.uint32)
    end, n_end = _key_lowest(src, cand_keys, u0, pos, n_pos, lo.to(tl.uint32), (hi - 1).to(tl.uint32), flip, GATHER,
                             BLOCK, ONE_BLOCK)
    end = (end ^ flip).to(tl.int64) & 0xFFFFFFFF
    leaves = tl.where(at_low, at_bound - n_end >= take, above_bound + n_end < take)
    new_lo = tl.where(at_low & leaves, end + 1, tl.where(leaves, lo, end))
    new_hi = tl.where(leaves, tl.where(at_low, hi, end), end + 1)
    new_at_bound = tl.where(at_low, tl.where(leaves, at_bound - n_end, at_bound),
                            tl.where(leaves, at_bound, above_bound + n_end))
    new_above_bound = tl.where(at_low, tl.where(leaves, above_bound, at_bound - n_end),
                               tl.where(leaves, above_bound + n_end, above_bound))
    return new_lo, new_hi, new_at_bound, new_above_bound


@triton.jit
def _upper_normal_quantile(p):
    """z with P(Z > z) = p for a standard normal Z, p in (0, 1) (Abramowitz and Stegun 26.2.23, |error| < 4.5e-4)."""
    tail = tl.maximum(tl.minimum(p, 1.0 - p), 1e-30)
    t = tl.sqrt(-2.0 * tl.log(tail))
    z = t - (2.515517 + t * (0.802853 + t * 0.010328)) / (1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308)))
    return tl.where(p > 0.5, -z, z)


@triton.jit
def _row_length(lengths, row, n_cols, HAS_LENGTHS: tl.constexpr):
    """Columns of ``row`` taking part: ``lengths[row]`` clamped to [0, n_cols], or all."""
    length = n_cols
    if HAS_LENGTHS:
        length = tl.minimum(tl.maximum(tl.load(lengths + row).to(tl.int32), 0), n_cols)
    return length


@triton.jit
def _row_shift(offset, row, HAS_OFFSET: tl.constexpr):
    """What the row's columns are written minus: ``offset[row]``, or 0."""
    shift_cols = tl.zeros((), dtype=tl.int64)
    if HAS_OFFSET:
        shift_cols = tl.load(offset + row).to(tl.int64)
    return shift_cols


@triton.jit
def _lanes(x):
    """The 4 columns of a ``_vector_positions`` block as 4 blocks of one column each (no data moves)."""
    even, odd = tl.split(tl.reshape(x, (x.shape[0], 2, 2)))
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _scattered_store(ptr, value, mask, VECTORS: tl.constexpr):
    """``tl.store(ptr, value, mask=mask)`` to addresses not known to be consecutive; a ``_vector_positions`` block a
    column at a time. Stored whole, newer Tritons (3.9) first move each thread's 4 columns to 4 threads through
    shared memory, a barrier a step; Triton 3.6 compiles both forms alike (BENCHMARKS.md, top-k, "Scattered
    stores a column at a time")."""
    if VECTORS:
        p0, p1, p2, p3 = _lanes(ptr)
        v0, v1, v2, v3 = _lanes(value)
        m0, m1, m2, m3 = _lanes(mask)
        tl.store(p0, v0, mask=m0)
        tl.store(p1, v1, mask=m1)
        tl.store(p2, v2, mask=m2)
        tl.store(p3, v3, mask=m3)
    else:
        tl.store(ptr, value, mask=mask)


@triton.jit
def _select(src, cand_keys, cand_cols, n_pos, take, dst, keys_dst, col_base, shift_cols, GATHER: tl.constexpr,
            COUNT_VALID: tl.constexpr, WRITE_KEYS: tl.constexpr, NEG1: tl.constexpr, BLOCK: tl.constexpr,
            ONE_BLOCK: tl.constexpr, ONE_BIN: tl.constexpr = False, n_readable=0, VECTORS: tl.constexpr = False,
            THREADS: tl.constexpr = 0):
    """Writes the ``take`` largest keys among positions [0, n_pos) (the columns of ``src``, or with GATHER the
    candidates listed in ``cand_cols``/``cand_keys``; with COUNT_VALID some have no column, key 0) to ``dst``, the
    keys above the k-th first, then its first ties, each group in the prefix sum's order (``_prefix_sum``); as ``col
    + col_base - shift_cols``, with WRITE_KEYS their keys to ``keys_dst``. NEG1 takes no -inf: returns how many it
    wrote (``take``, or with NEG1 at most the finite ones), the caller pads the rest with -1. ONE_BIN: the keys are
    one radix bin's, close together, so the search starts from their range (one pass) and interpolates; else from
    the values' mean and deviation (one pass), then interpolates. VECTORS (a row's columns in one block, its first
    ``n_readable`` readable): the block held as ``_vector_positions`` over THREADS threads."""
    if VECTORS:
        pos = _vector_positions(BLOCK)
        u0 = _vector_keys(src, pos, n_pos, n_readable)
    else:
        pos = tl.arange(0, BLOCK)
        u0 = _position_keys(src, cand_keys, pos, n_pos, GATHER)
    if ONE_BLOCK and GATHER:
        cols0 = _columns(cand_cols, pos, n_pos, GATHER)  # loaded with the keys, not after the search

    # A search for the take-th largest key over a bracket [lo, hi): count(key >= lo) = at_bound >= take and
    # count(key >= hi) = above_bound < take. It is over when at_bound == take (the keys >= lo are the ones wanted) or
    # hi == lo + 1 (lo, the bound, is the take-th key; above_bound of the keys are above it). With fewer than `take`
    # values above -inf it is over at once: the -inf entries are the ties at the bound; take = 0 starts at the
    # highest key: nothing is above it, and no tie is needed.
    n_valid = n_pos
    if COUNT_VALID:
        n_valid = _count_at_least(src, cand_keys, u0, pos, n_pos, 1, GATHER, BLOCK, ONE_BLOCK)
    if ONE_BIN:
        n_finite, lowest, highest = _key_range(src, cand_keys, u0, pos, n_pos, GATHER, BLOCK, ONE_BLOCK)
    else:
        n_finite, total, squares = _key_moments(src, cand_keys, u0, pos, n_pos, GATHER, BLOCK, ONE_BLOCK)
    searching = (take > 0) & (n_finite >= take)
    settled = tl.where(take == 0, 0xFFFFFFFF, KEY_NEG_INF).to(tl.uint32)  # the bound where no search runs
    above_bound = tl.where(n_finite < take, n_finite, 0)
    if ONE_BIN:
        # One radix bin's keys, close together: from their range, each trial where the counts at the bracket's two
        # ends put the take-th key (regula falsi), halving after INTERPOLATION_STEPS (ties); one key from the take-th
        # at an end of the bracket, one reduction ends it (`_peel_end`, below).
        lo = tl.where(searching, tl.maximum(lowest, KEY_NEG_INF + 1), settled).to(tl.uint32)
        width = (highest - lo).to(tl.int64) & 0xFFFFFFFF  # (a window's bin may span more than 2^31 keys)
        width += 1
        at_bound = tl.where(searching, n_finite, n_valid)
        go = searching & (at_bound != take) & (width > 1) & ~_near_end(at_bound, above_bound, take, 1)
        step = 0
        while go:
            if step < INTERPOLATION_STEPS:
                share = tl.fdiv((at_bound - take).to(tl.float32), (at_bound - above_bound).to(tl.float32),
                                ieee_rounding=False)
                offset = (width.to(tl.float32) * share).to(tl.int64)
            else:
                offset = width >> 1
            offset = tl.minimum(tl.maximum(offset, 1), width - 1)
            trial = lo + offset.to(tl.uint32)
            count = _count_at_least(src, cand_keys, u0, pos, n_pos, trial, GATHER, BLOCK, ONE_BLOCK)
            raised = count >= take
            lo = tl.where(raised, trial, lo)
            width = tl.where(raised, width - offset, offset)
            at_bound = tl.where(raised, count, at_bound)
            above_bound = tl.where(raised, above_bound, count)
            go = (at_bound != take) & (width > 1) & ~_near_end(at_bound, above_bound, take, 1)
            step += 1
        lo = lo.to(tl.int64) & 0xFFFFFFFF
        hi = lo + width
    else:
        # A whole row's keys: the bracket starts as all keys above -inf. The first trial is where a normal
        # distribution of the row's mean and deviation puts the take-th value, the second a Newton step from it with
        # that distribution's density; then, while an end of the bracket is still the row's, a secant through the last
        # two trials' values and counts (aimed half a count past take), else regula falsi on the ends' values (an end
        # that stays twice weighs half: the Illinois rule), halving after INTERPOLATION_STEPS. Values, not keys (a
        # key's step in value doubles at every power of two), where the values lie within VALUE_SPAN_KEYS keys of each
        # other; keys beyond (rows over many powers of ten). A trial that found no key between itself and the end it
        # moved (ties, or values far apart) makes the next count also find the row's keys next to its trial, moving
        # the bracket's end onto them, so that a tied take-th key closes in a trial from each side; the other counts
        # only count.
        lo = tl.where(searching, KEY_NEG_INF + 1, settled).to(tl.int64) & 0xFFFFFFFF
        hi = tl.full((), 1 << 32, tl.int64)
        at_bound = tl.where(searching, n_finite, n_valid)
        n_stats = tl.maximum(n_finite, 1).to(tl.float32)  # (the guesses are only used where n_finite >= take > 0)
        mean = tl.fdiv(total, n_stats, ieee_rounding=False)
        deviation = tl.sqrt(tl.maximum(tl.fdiv(squares, n_stats, ieee_rounding=False) - mean * mean, 1e-30))
        z = _upper_normal_quantile(tl.fdiv(take.to(tl.float32), n_stats, ieee_rounding=False))
        guess = mean + deviation * z
        density = n_stats * 0.3989422804014327 * tl.exp(-0.5 * z * z) / deviation  # counts per unit of value
        go = searching & (at_bound != take) & ~_near_end(at_bound, above_bound, take, WHOLE_ROW_PEEL)
        excess_lo = (at_bound - take).to(tl.float32)  # the counts' distances from take at the ends, as weighed
        excess_hi = (above_bound - take).to(tl.float32)
        kept = tl.zeros((), tl.int32)  # which end the last trial moved: 1 lo, -1 hi
        snap = tl.zeros((), tl.int1)
        last_value = guess  # the last two trials' values and counts, for the secant
        last_count = at_bound
        prev_value = tl.zeros((), tl.float32)  # (not last's: compiled, a loop carries only the names whose value its
        prev_count = tl.zeros((), tl.int32)  # body changes as Triton first reads it; `prev = last` would not change)
        step = 0
        while go:
            if step < 2:
                trial = _order_key(guess).to(tl.int64) & 0xFFFFFFFF
            elif step < INTERPOLATION_STEPS + 2:
                share = tl.fdiv(excess_lo, excess_lo - excess_hi, ieee_rounding=False)
                trial = lo + ((hi - lo).to(tl.float32) * share).to(tl.int64)  # (keys: values too far apart, or flat)
                if (hi == 1 << 32) | (lo == KEY_NEG_INF + 1):  # an end is the row's: the secant
                    apart = tl.abs(_order_key(last_value).to(tl.int64) - _order_key(prev_value).to(tl.int64))
                    if (last_count != prev_count) & (apart < VALUE_SPAN_KEYS):
                        aim = take.to(tl.float32) + tl.where(last_count >= take, -0.5, 0.5)
                        value = last_value + (aim - last_count.to(tl.float32)) * tl.fdiv(
                            last_value - prev_value, (last_count - prev_count).to(tl.float32), ieee_rounding=False)
                        trial = _order_key(value).to(tl.int64) & 0xFFFFFFFF
                elif hi - lo < VALUE_SPAN_KEYS:
                    low_value = _key_value(lo.to(tl.uint32))
                    value = low_value + (_key_value(hi.to(tl.uint32)) - low_value) * share
                    trial = _order_key(value).to(tl.int64) & 0xFFFFFFFF
            else:
                trial = lo + ((hi - lo) >> 1)
            trial = tl.minimum(tl.maximum(trial, lo + 1), hi - 1)
            if snap:
                count, above_lowest, below_highest = _split_at(src, cand_keys, u0, pos, n_pos, trial.to(tl.uint32),
                                                               GATHER, BLOCK, ONE_BLOCK)
                new_lo = above_lowest.to(tl.int64) & 0xFFFFFFFF
                new_hi = (below_highest.to(tl.int64) & 0xFFFFFFFF) + 1
            else:
                count = _count_at_least(src, cand_keys, u0, pos, n_pos, trial.to(tl.uint32), GATHER, BLOCK,
                                        ONE_BLOCK)
                new_lo = trial
                new_hi = trial
            guess += ((count - take).to(tl.float32) + 0.5) / density  # (used by the second trial only)
            prev_value = last_value
            prev_count = last_count
            last_value = _key_value(trial.to(tl.uint32))
            last_count = count
            raised = count >= take
            snap = tl.where(raised, count == at_bound, count == above_bound)
            lo = tl.where(raised, new_lo, lo)
            hi = tl.where(raised, hi, new_hi)
            at_bound = tl.where(raised, count, at_bound)
            above_bound = tl.where(raised, above_bound, count)
            excess = (count - take).to(tl.float32)
            excess_lo = tl.where(raised, excess, tl.where(kept < 0, 0.5 * excess_lo, excess_lo))
            excess_hi = tl.where(raised, tl.where(kept > 0, 0.5 * excess_hi, excess_hi), excess)
            kept = tl.where(raised, 1, -1)
            go = (at_bound != take) & (hi - lo > 1) & ~_near_end(at_bound, above_bound, take, WHOLE_ROW_PEEL)
            step += 1
    # Either search ends near an end of its bracket [lo, hi) or done: at most 1 (one bin) or WHOLE_ROW_PEEL peels,
    # each bringing the nearer end a key closer, or ending it.
    peeling = searching & (at_bound != take) & (hi - lo > 1)
    while peeling:
        lo, hi, at_bound, above_bound = _peel_end(src, cand_keys, u0, pos, n_pos, lo, hi, at_bound, above_bound, take,
                                                  GATHER, BLOCK, ONE_BLOCK)
        peeling = (at_bound != take) & (hi - lo > 1)
    bound = lo.to(tl.uint32)

    # exact: the keys >= bound are the ones wanted; else bound is the k-th key and `need` of its ties are taken. Keys
    # above `above_from` are taken, and ties are keys equal to `tie_key` (1: no key, as with exact). With NEG1 -inf
    # is never taken: its -1 entries come after the rest (`_fill`, from the count returned).
    exact = at_bound == take
    need = tl.where(exact, 0, take - above_bound)
    n_above = take - need
    above_from = tl.where(exact, bound - 1, bound)  # (bound >= KEY_NEG_INF > 0: no key 0 is ever taken)
    tie_key = tl.where(exact, 1, bound).to(tl.uint32)
    written = take
    if NEG1:
        above_from = tl.maximum(above_from, KEY_NEG_INF)
        tie_key = tl.where(bound == KEY_NEG_INF, 1, tie_key).to(tl.uint32)
        written = tl.minimum(take, n_finite)
    above_seen = tl.zeros((), dtype=tl.int32)
    ties_seen = tl.zeros((), dtype=tl.int32)
    for start in range(0, n_pos, BLOCK):
        if GATHER:
            if ONE_BLOCK:
                col = cols0
            else:
                col = _columns(cand_cols, start + pos, n_pos, GATHER)
        else:
            col = start + pos  # (positions from n_pos have key 0: never taken)
        if ONE_BLOCK:
            u = u0
        else:
            u = _position_keys(src, cand_keys, start + pos, n_pos, GATHER)
        is_above = u > above_from
        is_tie = u == tie_key
        ranks = _prefix_sum(is_above.to(tl.int32) + (is_tie.to(tl.int32) << 16), VECTORS, THREADS, SELECT_SCAN_GROUP)
        above_rank = above_seen + (ranks & 0xFFFF) - 1
        tie_rank = ties_seen + (ranks >> 16) - 1
        slot = tl.where(is_above, above_rank, n_above + tie_rank)
        index = col + (col_base - shift_cols).to(tl.int32)  # (int32 wraps as the int32 result would)
        # (the sum of the two masks: the interpreter's `|` of these masks is not a boolean)
        chosen = (is_above.to(tl.int32) + (is_tie & (tie_rank < need)).to(tl.int32)) > 0
        _scattered_store(dst + slot, index.to(tl.int32), chosen, VECTORS)
        if WRITE_KEYS:
            _scattered_store(keys_dst + slot, u.to(tl.int32, bitcast=True), chosen, VECTORS)
        if not ONE_BLOCK:  # (one block: no next block to count for)
            above_seen += tl.sum(is_above.to(tl.int32), axis=0)
            ties_seen += tl.sum(is_tie.to(tl.int32), axis=0)
    return written


@triton.jit
def _fill(dst, keys_dst, written, k, length, shift_cols, PAD_COLUMNS: tl.constexpr, WRITE_KEYS: tl.constexpr,
          BLOCK: tl.constexpr):
    """Slots [written, k) that the select left (fewer than k columns take part, or with the masked idiom fewer than
    k finite values): -1, or with PAD_COLUMNS distinct columns past the row's length (k <= N, and they read as
    -inf); with WRITE_KEYS key 0 beside them."""
    pos = tl.arange(0, BLOCK)
    for start in range(written, k, BLOCK):
        slot = start + pos
        fill = tl.full((BLOCK,), -1, tl.int64)
        if PAD_COLUMNS:
            fill = length + (slot - written).to(tl.int64) - shift_cols
        tl.store(dst + slot, fill.to(tl.int32), mask=slot < k)
        if WRITE_KEYS:
            tl.store(keys_dst + slot, tl.zeros((BLOCK,), tl.int32), mask=slot < k)


@triton.jit
def _packed_key(u, low):
    """int64 ordered by the uint32 key ``u``, then by ``low`` (non-negative, below 2^32), under a signed compare."""
    return ((u ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64) << 32) | low


@triton.jit
def _sort_keys(dst, src, slots, k, length, shift_cols, PAD_COLUMNS: tl.constexpr):
    """The entries at ``slots`` of a row's k as int64 sort keys, (value key, index) packed so that descending order
    is torch's; -1 entries (-inf values, missing columns) and the lanes past k get ``EMPTY``, below every other."""
    index = tl.load(dst + slots, mask=slots < k, other=-1)
    marker = slots >= k
    if not PAD_COLUMNS:
        marker |= index == -1
    col = index.to(tl.int64) + shift_cols
    u = tl.maximum(_keys(src, tl.where((col >= 0) & (col < length), col, -1)), KEY_NEG_INF)  # past it: -inf
    return tl.where(marker, EMPTY, _packed_key(u, index.to(tl.int64) & 0xFFFFFFFF))


@triton.jit
def _sort_row(dst, src, k, length, shift_cols, PAD_COLUMNS: tl.constexpr, K_POW2: tl.constexpr):
    """Descending value order of a row's k entries: sorted by (key, index) in registers, -1 entries last."""
    tl.debug_barrier()
    slots = tl.arange(0, K_POW2)
    packed = tl.sort(_sort_keys(dst, src, slots, k, length, shift_cols, PAD_COLUMNS), descending=True)
    tl.debug_barrier()
    tl.store(dst + slots, tl.where(packed == EMPTY, -1, (packed & 0xFFFFFFFF).to(tl.int32)), mask=slots < k)


@triton.jit
def _sorted_slots(k, length, PAD_COLUMNS: tl.constexpr):
    """Slots of a row's k that the sort has to order: all, or with the neg1 pad those below the row's take (the
    slots from there hold -1, where the sort would leave them: a causal prefill's first k rows, short contexts)."""
    if PAD_COLUMNS:
        return k
    return tl.minimum(k, length)


@triton.jit
def _sort_chunks_kernel(logits, lengths, offset, out, sorted_chunks, n_cols, stride_row, k, n_chunks,
                        HAS_LENGTHS: tl.constexpr, HAS_OFFSET: tl.constexpr, PAD_COLUMNS: tl.constexpr,
                        CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, c): entries [c*CHUNK, (c+1)*CHUNK) of the row's k as sort keys, sorted descending, to
    ``sorted_chunks[row, c]``; nothing for a chunk past the slots to sort (``_sorted_slots``)."""
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    length = _row_length(lengths, row, n_cols, HAS_LENGTHS)
    if chunk * CHUNK < _sorted_slots(k, length, PAD_COLUMNS):
        shift_cols = _row_shift(offset, row, HAS_OFFSET)
        slots = chunk * CHUNK + tl.arange(0, CHUNK)
        packed = _sort_keys(out + row * k, logits + row * stride_row, slots, k, length, shift_cols, PAD_COLUMNS)
        tl.store(sorted_chunks + (row * n_chunks + chunk) * CHUNK + tl.arange(0, CHUNK),
                 tl.sort(packed, descending=True))


@triton.jit
def _merge_chunks_kernel(sorted_chunks, lengths, out, n_cols, k, n_chunks, HAS_LENGTHS: tl.constexpr,
                         PAD_COLUMNS: tl.constexpr, CHUNK: tl.constexpr, PART: tl.constexpr,
                         CHUNKS_POW2: tl.constexpr, SEARCH_STEPS: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, c, p): each entry of part p (PART entries) of sorted chunk c goes to its rank in the row, its
    position in c plus, per other chunk, the entries above it there (a binary search; equal keys, the -1 entries,
    count as above in earlier chunks); the ranks are a permutation of the row's slots. Chunks past the slots to sort
    (all -1, ``_sorted_slots``) are neither placed (their ranks are their own slots) nor searched (nothing in them is
    above any entry). (Parts: more programs, each with fewer searches in flight, where there are few rows.)"""
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    n_sorted = _sorted_slots(k, _row_length(lengths, row, n_cols, HAS_LENGTHS), PAD_COLUMNS)
    if chunk * CHUNK < n_sorted:
        base = sorted_chunks + row * n_chunks * CHUNK
        pos = tl.program_id(2) * PART + tl.arange(0, PART)
        mine = tl.load(base + chunk * CHUNK + pos)
        other = tl.arange(0, CHUNKS_POW2)
        searched = (other * CHUNK < n_sorted) & (other != chunk)
        lo = tl.zeros((PART, CHUNKS_POW2), tl.int32)
        hi = tl.where(searched, CHUNK, 0)[None, :] + lo
        for _ in tl.static_range(SEARCH_STEPS):  # the prefix of chunk `other` above `mine`: its length in [0, CHUNK]
            mid = (lo + hi) >> 1
            x = tl.load(base + other[None, :] * CHUNK + tl.minimum(mid, CHUNK - 1), mask=searched[None, :], other=0)
            above = tl.where(other[None, :] < chunk, x >= mine[:, None], x > mine[:, None]) & (mid < hi)
            lo = tl.where(above, mid + 1, lo)
            hi = tl.where(above, hi, mid)
        rank = pos + tl.sum(lo, axis=1)
        tl.store(out + row * k + rank, tl.where(mine == EMPTY, -1, (mine & 0xFFFFFFFF).to(tl.int32)),
                 mask=rank < k)


@triton.jit
def _rank_sort_kernel(selected, selected_keys, out, k, PART: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Program (row, p): each of part p's PART entries of the row's k in ``selected`` goes to its rank in ``out``,
    the number of the row's entries with a larger key or an equal key at an earlier slot (a permutation of the
    slots), counted against all k. Keys as the select wrote them beside the entries (-1 entries: -inf's key or 0,
    below every value's). One launch of contiguous loads, no merge's dependent searches, but k * k compares per row:
    for few rows (``RANK_SORT_MAX_ROWS``)."""
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    slots = tl.program_id(1) * PART + tl.arange(0, PART)
    mine = _rank_keys(selected_keys + row * k, slots, k)
    rank = tl.zeros((PART,), tl.int32)
    for start in range(0, k, BLOCK):
        other = _rank_keys(selected_keys + row * k, start + tl.arange(0, BLOCK), k)
        rank += tl.sum((other[None, :] > mine[:, None]).to(tl.int32), axis=1)
    tl.store(out + row * k + rank, tl.load(selected + row * k + slots, mask=slots < k), mask=slots < k)


@triton.jit
def _rank_keys(keys, slots, k):
    """Distinct int64 sort keys of the entries at ``slots``: (key, earlier slot first) packed; ``EMPTY`` past k."""
    u = tl.load(keys + slots, mask=slots < k, other=0).to(tl.uint32, bitcast=True)
    return tl.where(slots < k, _packed_key(u, (0x7FFFFFFF - slots).to(tl.int64)), EMPTY)


@triton.jit
def _topk_indices_kernel(logits, lengths, offset, cand, cand_keys, out, n_cols, stride_row, k, n_segments,
                         HAS_LENGTHS: tl.constexpr, HAS_OFFSET: tl.constexpr, MODE: tl.constexpr,
                         PAD_COLUMNS: tl.constexpr, SORTED: tl.constexpr, BLOCK: tl.constexpr,
                         ONE_BLOCK: tl.constexpr, K_POW2: tl.constexpr, VECTORS: tl.constexpr,
                         THREADS: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    src = logits + row * stride_row
    length = _row_length(lengths, row, n_cols, HAS_LENGTHS)
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
    if MODE == 2:  # CANDIDATES: the columns this row's segments wrote
        n_pos = n_segments * k
    shift_cols = _row_shift(offset, row, HAS_OFFSET and MODE != 1)
    written = _select(src, cand_keys + row * n_segments * k, cand + row * n_segments * k, n_pos, take, dst, keys_dst,
                      col_base, shift_cols, MODE == 2, MODE == 2, MODE == 1, MODE != 1 and not PAD_COLUMNS, BLOCK,
                      ONE_BLOCK, False, n_cols - col_base, VECTORS, THREADS)
    _fill(dst, keys_dst, written, k, length, shift_cols, PAD_COLUMNS and MODE != 1, MODE == 1, BLOCK)
    if SORTED:
        _sort_row(dst, src, k, length, shift_cols, PAD_COLUMNS, K_POW2)


@triton.jit
def _radix_digit(x, BINS: tl.constexpr):
    """Radix bin of x in [0, BINS), monotone in ``_order_key``'s order: the top log2(BINS) bits of the 16-bit order
    key of x rounded to fp16 (128 bins: half an octave each, 256: a quarter). -inf and values under -65504 fall in
    the lowest bin holding a value (1 of 128, 3 of 256), NaN in the last; the bins below hold no value: the kernels
    put positions without a column in bin 0. ``tl.histogram`` costs a ballot per digit bit and a count per bin."""
    h = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    key = h ^ ((h >> 15) & 0x7FFF)  # signed, ordered like the fp16 values
    key = tl.where(x != x, 0x7FFF, key)
    return ((key + 0x8000) * BINS) >> 16


@triton.jit
def _window_digit(x, low, high, scale):
    """Bin of x among ``RADIX_WINDOW_BINS``, monotone in x (each step of the float math rounds monotonically): 1
    below the window [low, high), 2 + floor((x - low) * scale) in it (``scale``: WINDOW_WIDTHS over its width), 31
    at or above high and for NaN; bin 0 is left to positions without a column. (``_row_window`` keeps its ends
    finite and scale * width <= WINDOW_WIDTHS, so the product inside is finite.)"""
    inside = (x >= low) & (x < high)
    t = tl.minimum(tl.where(inside, (x - low) * scale, 0.0), WINDOW_WIDTHS - 1.0)
    return tl.where((x >= high) | (x != x), WINDOW_WIDTHS + 2, tl.where(inside, 2 + t.to(tl.int32), 1))


@triton.jit
def _digit(x, valid, low, high, scale, BINS: tl.constexpr, WINDOW: tl.constexpr):
    """The bin of each value x (0 where not ``valid``: no column): by the row's window (``_window_digit``) with
    WINDOW, else its radix digit."""
    if WINDOW:
        digit = _window_digit(x, low, high, scale)
    else:
        digit = _radix_digit(x, BINS)
    return tl.where(valid, digit, 0)


@triton.jit
def _stored_window(row_stats, row, WINDOW: tl.constexpr):
    """(low, high, scale) of the row's window, as the window launch wrote them (zeros, unread, without WINDOW)."""
    if not WINDOW:
        return 0.0, 0.0, 0.0
    stats = row_stats + row * ROW_STATS
    return (tl.load(stats + 4).to(tl.float32, bitcast=True), tl.load(stats + 5).to(tl.float32, bitcast=True),
            tl.load(stats + 6).to(tl.float32, bitcast=True))


@triton.jit
def _row_values(src, col, length):
    """The row's values at columns ``col``, those below ``length`` (0 past it)."""
    return tl.load(src + col, mask=col < length, other=0.0)


@triton.jit
def _digit_counts(src, col, length, n_cols, low, high, scale, BINS: tl.constexpr, WINDOW: tl.constexpr = False):
    """How many of the row's columns ``col`` (those below ``length``) fall in each bin (``_digit``). (Loaded up to
    the row's end, ``n_cols``: whole vectors where that is a multiple of 16, as a length would not be.)"""
    x = _row_values(src, col, n_cols)
    return tl.histogram(_digit(x, col < length, low, high, scale, BINS, WINDOW), BINS)


@triton.jit
def _at_least(counts):
    """Per radix bin, the columns in it or above, from the columns in each."""
    return tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts


@triton.jit
def _boundary_bin(at_least, take, BINS: tl.constexpr):
    """From the count of a row's columns in each radix bin or above: its boundary bin b (the bin of its take-th
    largest value; >= 1 where take >= 1, bin 0 holding no value), the columns above b, and those in b."""
    b = tl.sum((at_least >= take).to(tl.int32), axis=0) - 1
    above, in_bin = _around_bin(at_least, b, BINS)
    return b, above, in_bin


@triton.jit
def _around_bin(at_least, b, BINS: tl.constexpr):
    """From the count of columns in each radix bin or above: those above bin b (none above the last), those in b."""
    bins = tl.arange(0, BINS)
    above = tl.sum(tl.where(bins == b + 1, at_least, 0), axis=0)
    return above, tl.sum(tl.where(bins == b, at_least, 0), axis=0) - above


@triton.jit
def _compact(x, col, length, b, dst, dst_keys, above_before, cand_cols, cand_keys, cand_before, capacity, shift_cols,
             low, high, scale, WRITE_KEYS: tl.constexpr, BINS: tl.constexpr, THREADS: tl.constexpr,
             WINDOW: tl.constexpr = False):
    """Of the row's columns ``col`` (their values ``x``; those from ``length`` take no part): those above boundary bin
    b (``_digit``) to ``dst`` after ``above_before`` entries (as column minus ``shift_cols``; with WRITE_KEYS their
    keys to ``dst_keys``), those in b to the candidates after ``cand_before`` (columns and keys, up to
    ``capacity``); returns how many of each there were. ``col`` is ``_vector_positions`` over THREADS threads,
    scanned in groups of COMPACT_SCAN_GROUP of a thread's vectors (``_prefix_sum``)."""
    digit = _digit(x, col < length, low, high, scale, BINS, WINDOW)
    is_above = digit > b
    is_cand = digit == b
    key = _order_key(x).to(tl.int32, bitcast=True)
    ranks = _prefix_sum(is_above.to(tl.int32) + (is_cand.to(tl.int32) << 16), True, THREADS, COMPACT_SCAN_GROUP)
    above_slot = above_before + (ranks & 0xFFFF) - 1
    _scattered_store(dst + above_slot, col - shift_cols.to(tl.int32), is_above, True)
    if WRITE_KEYS:
        _scattered_store(dst_keys + above_slot, key, is_above, True)
    cand_slot = cand_before + (ranks >> 16) - 1
    keep = is_cand & (cand_slot < capacity)
    _scattered_store(cand_cols + cand_slot, col, keep, True)
    _scattered_store(cand_keys + cand_slot, key, keep, True)
    return tl.sum(_flat(is_above.to(tl.int32)), axis=0), tl.sum(_flat(is_cand.to(tl.int32)), axis=0)


@triton.jit
def _take_all(src, col, length, dst, dst_keys, shift_cols, NEG1: tl.constexpr, WRITE_KEYS: tl.constexpr):
    """A row of at most k columns takes them all, with no histogram or select: its columns ``col`` (those below
    ``length``) to their own slots, as column minus ``shift_cols`` (-1 for -inf with NEG1; with WRITE_KEYS their
    keys beside them)."""
    valid = col < length
    x = _row_values(src, col, length)
    index = col - shift_cols.to(tl.int32)
    if NEG1:
        index = tl.where(x == float("-inf"), -1, index)
    tl.store(dst + col, index, mask=valid)
    if WRITE_KEYS:
        tl.store(dst_keys + col, _order_key(x).to(tl.int32, bitcast=True), mask=valid)


@triton.jit
def _row_window(src, length, k, SAMPLE: tl.constexpr, BINS: tl.constexpr):
    """(low, high, scale) of a row's window (``_window_digit``): a value range that holds its k-th largest value
    (else the boundary bin is the one below or above it: still exact, only slower) but few of its other values. From
    SAMPLE columns, one at a hashed offset in each of SAMPLE equal strata of the row (a sorted row is sampled as
    evenly as a random one): the number of sampled values at or above the k-th is binomial (SAMPLE, k / length)
    whatever the values are, so the window runs from the sample's (expected + margin)-th largest value to its
    (expected - margin)-th (at least its largest), margin WINDOW_SIGMAS deviations plus WINDOW_SLACK, each widened
    to the sampled values of its radix bin (ranks found by a histogram, not a sort)."""
    stratum = tl.arange(0, SAMPLE)
    offset = (stratum.to(tl.uint32) * 2654435761) >> 16  # a fixed pseudo-random offset in [0, 65536)
    x = tl.load(src + (stratum.to(tl.int64) * length + (offset.to(tl.int64) * length >> 16)) // SAMPLE)
    digit = _radix_digit(x, BINS)
    at_least = _at_least(tl.histogram(digit, BINS))
    share = k / length.to(tl.float32)
    expected = share * SAMPLE
    margin = WINDOW_SIGMAS * tl.sqrt(expected * (1.0 - share)) + WINDOW_SLACK
    high_bin = tl.sum((at_least >= tl.maximum(expected - margin, 1.0)).to(tl.int32), axis=0) - 1
    low_bin = tl.sum((at_least >= tl.minimum(expected + margin, SAMPLE)).to(tl.int32), axis=0) - 1
    key = _order_key(x)
    low = _key_value(tl.min(tl.where(digit >= low_bin, key, 0xFFFFFFFF), axis=0))
    high = _key_value(tl.max(tl.where(digit <= high_bin, key, 0), axis=0))
    low = tl.where(low > -WINDOW_EDGE, low, -WINDOW_EDGE)  # (-inf, NaN: the clipped end)
    high = tl.where(high < WINDOW_EDGE, high, WINDOW_EDGE)
    return low, high, tl.full((), WINDOW_WIDTHS, tl.float32) / tl.maximum(high - low, 1e-30)


@triton.jit
def _radix_window_kernel(logits, lengths, row_stats, n_cols, stride_row, k, HAS_LENGTHS: tl.constexpr,
                         SAMPLE: tl.constexpr, PDL: tl.constexpr = False):
    """Program per row, first of the split path's launches where it bins by window: the row's window
    (``_row_window``) to ``row_stats[row, 4:7]``. Nothing for a row of at most k columns (it takes them all)."""
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    length = _row_length(lengths, row, n_cols, HAS_LENGTHS)
    if length > k:
        low, high, scale = _row_window(logits + row * stride_row, length, k, SAMPLE, SAMPLE_BINS)
        stats = row_stats + row * ROW_STATS
        tl.store(stats + 4, low.to(tl.int32, bitcast=True))
        tl.store(stats + 5, high.to(tl.int32, bitcast=True))
        tl.store(stats + 6, scale.to(tl.int32, bitcast=True))


@triton.jit
def _radix_histogram_kernel(logits, lengths, hist, arrivals, row_stats, n_cols, stride_row, n_segments, k,
                            HAS_LENGTHS: tl.constexpr, SEGMENT: tl.constexpr, BINS: tl.constexpr,
                            SEVERAL_SEGMENTS: tl.constexpr, WINDOW: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, p): for each bin (``_digit``: with WINDOW by the row's window in ``row_stats``), how many of
    segment s's columns are in that bin or above, to ``hist[row, s]``, for s = p (with SEVERAL_SEGMENTS: s = p, p +
    P, ... for P programs a row); segments past the row's length, as in an engine's max_model_len-wide rows, have no
    columns, and a row of at most k columns takes them all: nothing is counted or read for them. Program (row, 0)
    zeroes the row's arrival count for the compaction launch."""
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    program = tl.program_id(1)
    length = _row_length(lengths, row, n_cols, HAS_LENGTHS)
    src = logits + row * stride_row
    hist_row = hist + row * n_segments * BINS
    low, high, scale = _stored_window(row_stats, row, WINDOW)  # (not written, nor used, for a row of <= k columns)
    if SEVERAL_SEGMENTS:
        if length > k:
            for segment in range(program, tl.cdiv(length, SEGMENT), tl.num_programs(1)):
                _segment_counts(src, hist_row, segment, length, n_cols, low, high, scale, SEGMENT, BINS, WINDOW)
    elif (program * SEGMENT < length) & (length > k):
        _segment_counts(src, hist_row, program, length, n_cols, low, high, scale, SEGMENT, BINS, WINDOW)
    if program == 0:
        tl.store(arrivals + row, 0)


@triton.jit
def _segment_counts(src, hist_row, segment, length, n_cols, low, high, scale, SEGMENT: tl.constexpr,
                    BINS: tl.constexpr, WINDOW: tl.constexpr):
    """Segment ``segment``'s count of columns at or above each bin, to its row of ``hist_row``."""
    at_least = _at_least(_digit_counts(src, segment * SEGMENT + tl.arange(0, SEGMENT), length, n_cols, low, high,
                                       scale, BINS, WINDOW))
    tl.store(hist_row + segment * BINS + tl.arange(0, BINS), at_least)


@triton.jit
def _row_counts(hist_row, used, before, SEGMENTS_BLOCK: tl.constexpr, BINS: tl.constexpr):
    """Per radix bin, how many of a row's columns are in it or above: in its first ``used`` segments (those holding
    its columns), and in its segments before segment ``before`` (one pass over the counts)."""
    bins = tl.arange(0, BINS)
    total = tl.zeros((BINS,), tl.int32)
    earlier = tl.zeros((BINS,), tl.int32)
    for s0 in range(0, used, SEGMENTS_BLOCK):
        s = s0 + tl.arange(0, SEGMENTS_BLOCK)
        counts = tl.load(hist_row + s[:, None] * BINS + bins[None, :], mask=s[:, None] < used, other=0)
        total += tl.sum(counts, axis=0)
        earlier += tl.sum(tl.where(s[:, None] < before, counts, 0), axis=0)
    return total, earlier


@triton.jit
def _radix_bounds_kernel(lengths, hist, row_stats, before, n_cols, n_segments, k, HAS_LENGTHS: tl.constexpr,
                         SEGMENT: tl.constexpr, SEGMENTS_BLOCK: tl.constexpr, BINS: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Program per row, between the histogram and the compaction where a row's segments are many: its boundary bin b,
    the columns above b and in it to ``row_stats[row, 0:3]``, and per segment those above b and in b in the segments
    before it to ``before[row, s]``; so a compaction program reads b and two counts a segment, not its row's counts
    of every segment (at 64 x 65536, 64 KB a program). Nothing for a row of at most k columns (it takes them all)."""
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    length = _row_length(lengths, row, n_cols, HAS_LENGTHS)
    if length > k:
        used = tl.cdiv(length, SEGMENT)
        hist_row = hist + row * n_segments * BINS
        total, _ = _row_counts(hist_row, used, 0, SEGMENTS_BLOCK, BINS)
        b, above, in_bin = _boundary_bin(total, tl.minimum(k, length), BINS)
        stats = row_stats + row * ROW_STATS
        tl.store(stats, b)
        tl.store(stats + 1, above)
        tl.store(stats + 2, in_bin)
        above_seen = tl.zeros((), tl.int32)
        in_bin_seen = tl.zeros((), tl.int32)
        used_next = tl.where(b + 1 < BINS, used, 0)  # (no bin above the last)
        for s0 in range(0, used, SEGMENTS_BLOCK):
            s = s0 + tl.arange(0, SEGMENTS_BLOCK)
            at_b = tl.load(hist_row + s * BINS + b, mask=s < used, other=0)
            above_s = tl.load(hist_row + s * BINS + b + 1, mask=s < used_next, other=0)
            in_bin_s = at_b - above_s
            dst = before + (row * n_segments + s) * 2
            tl.store(dst, above_seen + tl.cumsum(above_s, axis=0) - above_s, mask=s < used)
            tl.store(dst + 1, in_bin_seen + tl.cumsum(in_bin_s, axis=0) - in_bin_s, mask=s < used)
            above_seen += tl.sum(above_s, axis=0)
            in_bin_seen += tl.sum(in_bin_s, axis=0)


@triton.jit
def _radix_compact_kernel(logits, lengths, offset, hist, row_stats, before, arrivals, cand_cols, cand_keys, out,
                          out_keys, n_cols, stride_row, k, n_segments, capacity, HAS_LENGTHS: tl.constexpr,
                          HAS_OFFSET: tl.constexpr, PAD_COLUMNS: tl.constexpr, WRITE_KEYS: tl.constexpr,
                          SEGMENT: tl.constexpr, SEGMENTS_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                          SMALL_BLOCK: tl.constexpr, BINS: tl.constexpr, BOUNDS: tl.constexpr,
                          WINDOW: tl.constexpr, THREADS: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, p) of P a row, for its segments s = p, p + P, ...: segment s's columns above the row's boundary
    bin b (the bin of its k-th largest value) go straight to the output (after those of the segments before it), its
    columns in b are appended to the row's candidates (columns and keys, up to ``capacity``). A row of at most k
    columns takes them all (``_take_all``). With WRITE_KEYS every output entry's key goes to ``out_keys`` (for the
    rank sort). With BOUNDS, b and the counts before s come from ``_radix_bounds_kernel``'s launch, and
    ``_radix_select_kernel``'s selects the rest (this kernel then holds no candidates in registers: few registers,
    many programs an SM); the bins are the row's window's with WINDOW. Else (one segment a program) each program
    finds them in the counts of its row's segments, and the row's last program to arrive (no program waits on
    another: CUDA-graph safe) selects the rest of the top k among the candidates, then pads."""
    wait_for_previous_grid(PDL)
    row, src, length, take, dst, shift_cols = _row_start(tl.program_id(0), logits, lengths, offset, out, n_cols,
                                                         stride_row, k, HAS_LENGTHS, HAS_OFFSET)
    program = tl.program_id(1)
    programs = tl.num_programs(1)
    row_cols = cand_cols + row * capacity
    row_keys = cand_keys + row * capacity
    dst_keys = out_keys + row * k
    used = tl.cdiv(length, SEGMENT)  # segments holding the row's columns: the others read and move nothing
    if length <= k:  # the row's columns are its top k, each to its own slot
        for segment in range(program, used, programs):
            _take_all(src, segment * SEGMENT + tl.arange(0, SEGMENT), length, dst, dst_keys, shift_cols,
                      not PAD_COLUMNS, WRITE_KEYS)
    if BOUNDS:
        if length > k:
            b = tl.load(row_stats + row * ROW_STATS)
            low, high, scale = _stored_window(row_stats, row, WINDOW)
            for segment in range(program, used, programs):
                col = segment * SEGMENT + _vector_positions(SEGMENT)
                counts_before = before + (row * n_segments + segment) * 2
                _compact(_row_values(src, col, n_cols), col, length, b, dst, dst_keys, tl.load(counts_before),
                         row_cols, row_keys, tl.load(counts_before + 1), capacity, shift_cols, low, high, scale,
                         WRITE_KEYS, BINS, THREADS, WINDOW)
    else:
        hist_row = hist + row * n_segments * BINS
        above_total = tl.zeros((), tl.int32)
        in_bin_total = tl.zeros((), tl.int32)
        if (length > k) & (program < used):
            col = program * SEGMENT + _vector_positions(SEGMENT)
            x = _row_values(src, col, n_cols)  # (before the counts: the two loads overlap)
            total, earlier = _row_counts(hist_row, used, program, SEGMENTS_BLOCK, BINS)
            b, above_total, in_bin_total = _boundary_bin(total, take, BINS)
            above_before, in_bin_before = _around_bin(earlier, b, BINS)
            _compact(x, col, length, b, dst, dst_keys, above_before, row_cols, row_keys, in_bin_before, capacity,
                     shift_cols, 0.0, 0.0, 0.0, WRITE_KEYS, BINS, THREADS)
        # Arrival: a release after every thread's stores (the barrier), an acquire before the last program's loads.
        tl.debug_barrier()
        if tl.atomic_add(arrivals + row, 1, sem="acq_rel", scope="gpu") == programs - 1:
            written = take
            if length > k:
                if program >= used:  # (a program past the row's columns counted nothing above)
                    total, _ = _row_counts(hist_row, used, 0, SEGMENTS_BLOCK, BINS)
                    _, above_total, in_bin_total = _boundary_bin(total, take, BINS)
                written = _select_candidates(src, row_cols, row_keys, in_bin_total, above_total, take, dst, dst_keys,
                                             length, shift_cols, capacity, PAD_COLUMNS, WRITE_KEYS, BLOCK, SMALL_BLOCK)
            _fill(dst, dst_keys, written, k, length, shift_cols, PAD_COLUMNS, WRITE_KEYS, BLOCK)


@triton.jit
def _radix_select_kernel(logits, lengths, offset, row_stats, cand_cols, cand_keys, out, out_keys, n_cols, stride_row, k,
                         capacity, HAS_LENGTHS: tl.constexpr, HAS_OFFSET: tl.constexpr, PAD_COLUMNS: tl.constexpr,
                         WRITE_KEYS: tl.constexpr, BLOCK: tl.constexpr, SMALL_BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Program per row, after the compaction where the split path has its bounds launch: the rest of the row's top k
    among its boundary bin's candidates, then the padding."""
    wait_for_previous_grid(PDL)
    row, src, length, take, dst, shift_cols = _row_start(tl.program_id(0), logits, lengths, offset, out, n_cols,
                                                         stride_row, k, HAS_LENGTHS, HAS_OFFSET)
    dst_keys = out_keys + row * k
    written = take
    if length > k:
        stats = row_stats + row * ROW_STATS
        written = _select_candidates(src, cand_cols + row * capacity, cand_keys + row * capacity, tl.load(stats + 2),
                                     tl.load(stats + 1), take, dst, dst_keys, length, shift_cols, capacity,
                                     PAD_COLUMNS, WRITE_KEYS, BLOCK, SMALL_BLOCK)
    _fill(dst, dst_keys, written, k, length, shift_cols, PAD_COLUMNS, WRITE_KEYS, BLOCK)


@triton.jit
def _select_candidates(src, row_cols, row_keys, n_cand, above, take, dst, dst_keys, length, shift_cols, capacity,
                       PAD_COLUMNS: tl.constexpr, WRITE_KEYS: tl.constexpr, BLOCK: tl.constexpr,
                       SMALL_BLOCK: tl.constexpr):
    """The rest of a row's top k after its ``above`` columns above the boundary bin, among the bin's ``n_cand``
    candidates (held in registers: in a block of SMALL_BLOCK where they are that few, as a short row's in an engine's
    wide logits, else up to BLOCK; streamed up to ``capacity``; past that, the whole top k from the row itself);
    with WRITE_KEYS their keys to ``dst_keys``. Returns how many of the row's slots hold entries (``_select``)."""
    if (SMALL_BLOCK < BLOCK) and (n_cand <= tl.minimum(SMALL_BLOCK, capacity)):  # a short row's few candidates
        written = above + _select(src, row_keys, row_cols, n_cand, take - above, dst + above, dst_keys + above, 0,
                                  shift_cols, True, False, WRITE_KEYS, not PAD_COLUMNS, SMALL_BLOCK, True, True)
    elif n_cand <= tl.minimum(BLOCK, capacity):
        written = above + _select(src, row_keys, row_cols, n_cand, take - above, dst + above, dst_keys + above, 0,
                                  shift_cols, True, False, WRITE_KEYS, not PAD_COLUMNS, BLOCK, True, True)
    elif n_cand <= capacity:
        written = above + _select(src, row_keys, row_cols, n_cand, take - above, dst + above, dst_keys + above, 0,
                                  shift_cols, True, False, WRITE_KEYS, not PAD_COLUMNS, BLOCK, False, True)
    else:  # the candidates overflowed their buffer
        written = _select(src, row_keys, row_cols, length, take, dst, dst_keys, 0, shift_cols, False, False,
                          WRITE_KEYS, not PAD_COLUMNS, BLOCK, False)
    return written


@triton.jit
def _row_start(row, logits, lengths, offset, out, n_cols, stride_row, k, HAS_LENGTHS: tl.constexpr,
               HAS_OFFSET: tl.constexpr):
    """A per-row program's (row, its logits, length, how many it takes, its output row, column shift)."""
    row = row.to(tl.int64)
    length = _row_length(lengths, row, n_cols, HAS_LENGTHS)
    return (row, logits + row * stride_row, length, tl.minimum(k, length), out + row * k,
            _row_shift(offset, row, HAS_OFFSET))


@triton.jit
def _radix_row_kernel(logits, lengths, offset, cand_cols, cand_keys, out, n_cols, stride_row, k, capacity,
                      HAS_LENGTHS: tl.constexpr, HAS_OFFSET: tl.constexpr, PAD_COLUMNS: tl.constexpr,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr, THREADS: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Program per row, the radix path in one launch: the digit histogram of the row (in chunks of CHUNK columns),
    its boundary bin, the columns above it to the output and those in it to the candidates, the rest of the top k
    among those (a row of at most k columns: all of them, ``_take_all``), the padding. Programs take the rows last
    first: a causal prefill's longest rows start first, its shortest fill the last wave."""
    wait_for_previous_grid(PDL)
    row, src, length, take, dst, shift_cols = _row_start(tl.num_programs(0) - 1 - tl.program_id(0), logits, lengths,
                                                         offset, out, n_cols, stride_row, k, HAS_LENGTHS, HAS_OFFSET)
    row_cols = cand_cols + row * capacity
    row_keys = cand_keys + row * capacity
    pos = tl.arange(0, CHUNK)
    written = take
    if length <= k:
        for start in range(0, length, CHUNK):
            _take_all(src, start + pos, length, dst, dst, shift_cols, not PAD_COLUMNS, False)
    else:
        counts = tl.zeros((BINS,), tl.int32)
        for start in range(0, length, CHUNK):
            counts += _digit_counts(src, start + pos, length, n_cols, 0.0, 0.0, 0.0, BINS)
        b, above, n_cand = _boundary_bin(_at_least(counts), take, BINS)
        above_seen = tl.zeros((), tl.int32)
        cand_seen = tl.zeros((), tl.int32)
        vector_pos = _vector_positions(CHUNK)
        for start in range(0, length, CHUNK):
            col = start + vector_pos
            n_above, n_in_bin = _compact(_row_values(src, col, n_cols), col, length, b, dst, dst, above_seen, row_cols,
                                         row_keys, cand_seen, capacity, shift_cols, 0.0, 0.0, 0.0, False, BINS,
                                         THREADS)
            above_seen += n_above
            cand_seen += n_in_bin
        tl.debug_barrier()  # the candidates written by every thread of the program
        written = _select_candidates(src, row_cols, row_keys, n_cand, above, take, dst, dst, length, shift_cols,
                                     capacity, PAD_COLUMNS, False, BLOCK, BLOCK)
    _fill(dst, out, written, k, length, shift_cols, PAD_COLUMNS, False, BLOCK)


def block_for(n_cols: int) -> int:
    """Columns held in registers for rows of ``n_cols``: the whole row up to ``MAX_BLOCK``."""
    return min(max(next_power_of_2(n_cols), 128), MAX_BLOCK)


def segments_for(n_cols: int, k: int, block: int) -> int:
    """Segments of ``block`` columns a row of ``n_cols`` is split into (1: not split, the row is held or streamed by
    one program): only where the segments' candidates, ``k`` each, are at most half the columns."""
    segments = -(-n_cols // block)
    return segments if segments > 1 and 2 * segments * k <= n_cols else 1


def vectors_for(logits) -> bool:
    """Whether a row held in one block is held as vectors of 4 columns (``_vector_positions``; BENCHMARKS.md, top-k),
    or as one column a thread, positions a lane apart: only where Triton can make its loads whole vectors, a width
    and row stride that are multiples of 16 elements and a start aligned to 16 bytes (what it specialises on)."""
    return logits.shape[1] % 16 == 0 and logits.stride(0) % 16 == 0 and logits.data_ptr() % 16 == 0


def warps_for(rows: int, block: int, sort_in_kernel: bool) -> int:
    """Warps per program: fewer where many rows fill the GPU anyway or the block is small; more for the in-register
    sort (BENCHMARKS.md, top-k warps)."""
    if rows >= 1024 or block <= 1024:
        return 4
    return 16 if sort_in_kernel else 8


def sort_for(rows: int, k: int, path: str, sort_chunk: int = SORT_CHUNK) -> str:
    """How the sorted order is made (``SORTS``; BENCHMARKS.md, top-k): by the bisection kernel in registers up to
    one chunk of survivors (the chunk sort beat its in-register sort of 2048 pairs at 64 rows); by ranks on the
    split radix path up to ``RANK_SORT_MAX_ROWS`` rows; else by chunks (at 2048+ rows also faster than a batched
    torch sort after the kernel)."""
    if path == "bisect" and k <= sort_chunk:
        return "in_kernel"
    if path == "radix_split" and rows <= RANK_SORT_MAX_ROWS:
        return "ranks"
    return "chunks"


def path_for(rows: int, n_cols: int, k: int) -> str:
    """Which path selects (``PATHS``; measured crossovers: BENCHMARKS.md, top-k): few long rows spread over many
    programs (``radix_split``: <= 16 rows of 4K+ columns, <= 128 of 16K+; at 64 x 8192 it is faster alone but its
    extra launches made the decode step slower); 256+ rows one program each (``radix_row``); the other batches, and
    rows of which more than half the columns are taken, by bisection."""
    if 2 * k > n_cols:
        return "bisect"
    if (rows <= 16 and n_cols >= 4096) or (rows <= RADIX_MAX_ROWS and n_cols >= 16384):
        return "radix_split"
    return "radix_row" if rows >= RADIX_ROW_MIN_ROWS else "bisect"


def radix_row_chunk(rows: int, ragged: bool) -> int:
    """Columns per step of the one-launch radix path's histogram and compaction: 1024 for 2048+ rows with lengths
    (``ragged``, as a causal prefill's), else 2048 (fewer steps per row: faster on rows of one width, as rows without
    lengths are; BENCHMARKS.md, top-k)."""
    return 1024 if ragged and rows >= 2048 else 2048


def radix_capacity(n_cols: int) -> int:
    """Boundary-bin candidates kept per row: a quarter of its columns (the scratch is then half the logits' bytes;
    a random row's bin holds ~1/32 of them with 256 bins, ~1/16 with 128), at most ``RADIX_CAPACITY``."""
    return min(RADIX_CAPACITY, max(n_cols // 4, 1))


def radix_sizes(rows: int, n_cols: int) -> tuple[int, int]:
    """(columns per segment of the histogram and compaction launches, candidates the final select holds in
    registers): about 256 segments per launch, of 1024 to 4096 columns, or of 512 where that makes at most
    ``RADIX_SHORT_SEGMENTS`` a launch and 16 a row (a compaction program reads its row's counts of every segment);
    and a block for the ~1/16 of a row of similar values that one quarter-octave bin may hold (random rows: ~1/32;
    the indexer's own logits at ctx 32768: 1/22; BENCHMARKS.md, top-k)."""
    segment = min(max(1 << max(rows * n_cols // 256, 1).bit_length() - 1, 1024), 4096)
    short_segments = -(-n_cols // 512)  # a row's, of 512 columns
    if short_segments <= 16 and rows * short_segments <= RADIX_SHORT_SEGMENTS:
        segment = 512
    return segment, min(max(next_power_of_2(n_cols // 16), 1024), 4096)


def radix_bounds(rows: int, segments: int) -> bool:
    """Whether the split path runs ``_radix_bounds_kernel`` between its histogram and its compaction: where a launch
    has more than ``RADIX_LAUNCH_PROGRAMS`` segments, so that its compaction programs do not each read their row's
    counts of every segment (BENCHMARKS.md, top-k)."""
    return rows * segments > RADIX_LAUNCH_PROGRAMS


def radix_window(bounds: bool, ragged: bool) -> bool:
    """Whether the split path bins by each row's window (``_row_window``; its own launch) rather than by the radix
    digit: with its bounds launch (many long rows) and without lengths. With lengths the host does not know how many
    columns a row has, and an engine's rows are mostly far shorter than its logits are wide: at 64 rows of 65536
    with ~8192 columns the launch cost more than the cheaper histogram saved (BENCHMARKS.md, top-k)."""
    return bounds and not ragged


def radix_programs(rows: int, segments: int, ragged: bool, bounds: bool) -> int:
    """The split path's compaction programs a row: one a segment, but with lengths (``ragged``) and bounds about
    ``RADIX_LAUNCH_PROGRAMS`` in all, each taking every programs-th segment (an engine's max_model_len-wide rows
    leave most segments without columns, and a program that starts only to exit costs as much as a short one)."""
    return min(segments, max(RADIX_LAUNCH_PROGRAMS // rows, 1)) if ragged and bounds else segments


def topk_indices(logits, k, lengths, offset, pad="neg1", sorted=False, out=None, block=None, num_warps=None,
                 path=None, segment=None, capacity=None, sort=None, sort_chunk=None, chunk=None, programs=None,
                 bounds=None, window=None):
    """``[R, k]`` int32 per the op contract (see ``nsa.topk_indices``); ``block`` (a power of two) overrides the
    columns held in registers, so tests reach the split and streamed paths at small sizes; ``num_warps`` overrides
    the warps of the path's main kernel (the benchmark's sweep); ``path`` (one of ``PATHS``) forces a path,
    ``segment``, ``capacity`` and ``chunk`` the radix paths' sizes, ``sort`` (one of ``SORTS``, on its paths) how
    the sorted order is made, ``sort_chunk`` the chunk sort's chunk, ``programs`` the split path's compaction
    programs a row (each taking every programs-th segment; default ``radix_programs``; fewer than the segments need
    ``bounds``), ``bounds`` whether its bounds launch runs (default ``radix_bounds``), ``window`` whether it bins by
    each row's window (default ``radix_window``; needs ``bounds``)."""
    rows, n_cols = logits.shape
    path = path or path_for(rows, n_cols, k)
    sort_chunk = sort_chunk or SORT_CHUNK
    sort = (sort or sort_for(rows, k, path, sort_chunk)) if sorted else None
    if sort is not None and path not in SORTS.get(sort, ()):
        ways = [way for way, paths in SORTS.items() if path in paths]
        raise ValueError(f"sort={sort!r}: the {path!r} path makes {ways}")
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int32, device=logits.device)
    if rows == 0 or k == 0:
        return out
    lengths_arg = lengths if lengths is not None else logits
    offset_arg = offset if offset is not None else logits
    flags = dict(HAS_LENGTHS=lengths is not None, HAS_OFFSET=offset is not None, PAD_COLUMNS=pad == "column")
    capacity = min(capacity or radix_capacity(n_cols), n_cols)
    if path == "bisect":
        _rows_topk(logits, k, lengths_arg, offset_arg, out, dict(flags, K_POW2=next_power_of_2(k)),
                   sort == "in_kernel", block or block_for(n_cols), num_warps)
    elif path == "radix_split":
        default_segment, default_block = radix_sizes(rows, n_cols)
        # the rank sort reads the selected entries and their keys from one buffer each, and writes `out`
        selected, keys = (torch.empty_like(out), torch.empty_like(out)) if sort == "ranks" else (out, None)
        _radix_topk(logits, k, lengths_arg, offset_arg, selected, keys, flags, block or default_block,
                    segment or default_segment, capacity, num_warps, programs, bounds, window)
        if sort == "ranks":
            _sort_by_ranks(selected, keys, out)
    else:
        _radix_row_topk(logits, k, lengths_arg, offset_arg, out, flags,
                        chunk or radix_row_chunk(rows, flags["HAS_LENGTHS"]), block or RADIX_ROW_BLOCK, capacity,
                        num_warps)
    if sort == "chunks":
        _sort_by_chunks(logits, k, lengths_arg, offset_arg, out, flags, sort_chunk)
    return out


def _rows_topk(logits, k, lengths, offset, out, flags, sort_in_kernel, block, num_warps):
    """One program per row (rows longer than ``block``: per segment, then per row among the segments' top k)."""
    rows, n_cols = logits.shape
    segments = segments_for(n_cols, k, block)
    warps = num_warps or warps_for(rows, block, sort_in_kernel)
    flags = dict(flags, BLOCK=block, num_warps=warps, THREADS=warps * warp_threads())
    vectors = vectors_for(logits)
    if segments == 1:
        launch(_topk_indices_kernel, (rows,), logits, lengths, offset, out, out, out, n_cols, logits.stride(0), k, 1,
               MODE=ROWS, SORTED=sort_in_kernel, ONE_BLOCK=n_cols <= block,
               VECTORS=vectors and n_cols <= block, **flags)
    else:
        cand = torch.empty(rows, segments, k, dtype=torch.int32, device=logits.device)
        cand_keys = torch.empty(rows, segments, k, dtype=torch.int32, device=logits.device)  # uint32 keys' bits
        launch(_topk_indices_kernel, (rows, segments), logits, lengths, offset, cand, cand_keys, out, n_cols,
               logits.stride(0), k, segments, MODE=SEGMENTS, SORTED=False, ONE_BLOCK=True, VECTORS=vectors,
               **flags)
        launch(_topk_indices_kernel, (rows,), logits, lengths, offset, cand, cand_keys, out, n_cols, logits.stride(0),
               k, segments, MODE=CANDIDATES, SORTED=sort_in_kernel, ONE_BLOCK=segments * k <= block,
               VECTORS=False, **flags)


def _radix_topk(logits, k, lengths, offset, out, out_keys, flags, block, segment, capacity, num_warps, programs,
                bounds, window):
    """Two launches over (row, program), or four with ``bounds``, five with ``window``: each row's window (a
    program a row); a histogram of the radix digit, or with ``window`` of the window's bins (a program a segment,
    or with lengths ``programs`` a row); with ``bounds`` each row's boundary bin and its segments' counts before them
    (a program a row); the columns above the boundary bin to the output and those in it to the candidates
    (``programs`` a row, each taking every programs-th segment); the rest selected among the candidates, by the
    row's last compaction program to arrive, or with ``bounds`` by a launch of a program a row. With ``out_keys``
    every output entry's key is written there too."""
    rows, n_cols = logits.shape
    segments = -(-n_cols // segment)
    ragged = flags["HAS_LENGTHS"]
    if bounds is None:
        bounds = radix_bounds(rows, segments) or (programs or segments) < segments or bool(window)
    programs = min(programs or radix_programs(rows, segments, ragged, bounds), segments)
    if programs < segments and not bounds:
        raise ValueError(f"programs={programs} of {segments} segments a row: needs bounds")
    window = radix_window(bounds, ragged) if window is None else window
    if window and not bounds:
        raise ValueError("window=True needs bounds")
    bins = RADIX_WINDOW_BINS if window else RADIX_SPLIT_BINS
    hist = torch.empty(rows, segments, bins, dtype=torch.int32, device=logits.device)
    arrivals = torch.empty(rows, dtype=torch.int32, device=logits.device)  # zeroed by the histogram launch
    cand_cols = torch.empty(rows, capacity, dtype=torch.int32, device=logits.device)
    cand_keys = torch.empty(rows, capacity, dtype=torch.int32, device=logits.device)  # uint32 keys' bits
    stride = logits.stride(0)
    segments_block = min(16, next_power_of_2(segments))
    hist_programs = programs if ragged else segments
    row_stats = before = hist  # (not read without bounds)
    if bounds:
        row_stats = torch.empty(rows, ROW_STATS.value, dtype=torch.int32, device=logits.device)
        before = torch.empty(rows, segments, 2, dtype=torch.int32, device=logits.device)
    if window:
        launch(_radix_window_kernel, (rows,), logits, lengths, row_stats, n_cols, stride, k, HAS_LENGTHS=ragged,
               SAMPLE=RADIX_SAMPLE, num_warps=RADIX_WINDOW_WARPS)
    launch(_radix_histogram_kernel, (rows, hist_programs), logits, lengths, hist, arrivals, row_stats, n_cols, stride,
           segments, k, HAS_LENGTHS=ragged, SEGMENT=segment, BINS=bins, SEVERAL_SEGMENTS=hist_programs < segments,
           WINDOW=window, num_warps=RADIX_HISTOGRAM_WARPS)
    if bounds:
        launch(_radix_bounds_kernel, (rows,), lengths, hist, row_stats, before, n_cols, segments, k,
               HAS_LENGTHS=ragged, SEGMENT=segment, SEGMENTS_BLOCK=segments_block, BINS=bins,
               num_warps=RADIX_BOUNDS_WARPS)
    out_keys = out if out_keys is None else out_keys
    select_sizes = dict(BLOCK=block, SMALL_BLOCK=min(RADIX_SMALL_BLOCK, block // 2))
    warps = num_warps or (RADIX_COMPACT_WARPS if bounds else RADIX_SELECT_WARPS)
    launch(_radix_compact_kernel, (rows, programs), logits, lengths, offset, hist, row_stats, before, arrivals,
           cand_cols, cand_keys, out, out_keys, n_cols, stride, k, segments, capacity, WRITE_KEYS=out_keys is not out,
           SEGMENT=segment, SEGMENTS_BLOCK=segments_block, BINS=bins, BOUNDS=bounds, WINDOW=window, num_warps=warps,
           THREADS=warps * warp_threads(), **select_sizes, **flags)
    if bounds:
        launch(_radix_select_kernel, (rows,), logits, lengths, offset, row_stats, cand_cols, cand_keys, out, out_keys,
               n_cols, stride, k, capacity, WRITE_KEYS=out_keys is not out, num_warps=RADIX_SELECT_WARPS,
               **select_sizes, **flags)


def _radix_row_topk(logits, k, lengths, offset, out, flags, chunk, block, capacity, num_warps):
    """One launch, one program per row: the radix path's histogram, compaction and final select."""
    rows, n_cols = logits.shape
    cand_cols = torch.empty(rows, capacity, dtype=torch.int32, device=logits.device)
    cand_keys = torch.empty(rows, capacity, dtype=torch.int32, device=logits.device)  # uint32 keys' bits
    warps = num_warps or RADIX_ROW_WARPS
    launch(_radix_row_kernel, (rows,), logits, lengths, offset, cand_cols, cand_keys, out, n_cols, logits.stride(0), k,
           capacity, CHUNK=max(min(chunk, next_power_of_2(n_cols)), 4), BLOCK=block, BINS=RADIX_ROW_BINS,
           num_warps=warps, THREADS=warps * warp_threads(), **flags)


def _sort_by_ranks(selected, keys, out):
    """Descending value order of each row's k entries in ``selected`` (their keys in ``keys``), to ``out``: one
    launch over (row, part of ``RANK_PART`` entries), each entry placed at its rank among all k."""
    rows, k = out.shape
    part = min(RANK_PART, next_power_of_2(k))
    launch(_rank_sort_kernel, (rows, -(-k // part)), selected, keys, out, k, PART=part,
           BLOCK=min(RANK_BLOCK, next_power_of_2(k)), num_warps=RANK_WARPS)


def _sort_by_chunks(logits, k, lengths, offset, out, flags, chunk):
    """Descending value order of each row's k entries in two launches over (row, chunk of ``chunk`` entries): each
    chunk sorted in registers, then each entry written at its rank among all chunks."""
    rows, n_cols = logits.shape
    chunk = min(chunk, next_power_of_2(k))
    n_chunks = -(-k // chunk)
    sorted_chunks = torch.empty(rows, n_chunks, chunk, dtype=torch.int64, device=logits.device)
    launch(_sort_chunks_kernel, (rows, n_chunks), logits, lengths, offset, out, sorted_chunks, n_cols, logits.stride(0),
           k, n_chunks, CHUNK=chunk, num_warps=4, **flags)
    part = min(chunk, MERGE_PART if rows < MERGE_MANY_ROWS else 2 * MERGE_PART)
    launch(_merge_chunks_kernel, (rows, n_chunks, chunk // part), sorted_chunks, lengths, out, n_cols, k, n_chunks,
           HAS_LENGTHS=flags["HAS_LENGTHS"], PAD_COLUMNS=flags["PAD_COLUMNS"], CHUNK=chunk, PART=part,
           CHUNKS_POW2=next_power_of_2(n_chunks), SEARCH_STEPS=chunk.bit_length(),
           num_warps=8 if rows <= MERGE_FEW_ROWS else 2 if rows <= MERGE_SOME_ROWS else 4)
