"""Triton kernels for the ``nsa`` ops (NVIDIA and AMD GPUs; also run by the Triton interpreter in tests).

The cache is passed to the kernels twice: viewed as fp8 for the values and as fp32 for the scales, so byte offsets
of DESIGN §3 become element offsets (a scale's byte offset is always a multiple of 4). A token is 128 fp8 values
and a 4-byte scale: 132 bytes, 33 fp32 words; these sizes are literals in the kernels. Every launcher writes every
element of its outputs and never reads a device value on the host, so all of them are CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..layout import HEAD_DIM
from ..quant import AMAX_FLOOR, fp8_max
from .reference import HEAD_GATE_K_ALIGN, head_gate_chunk

_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)


def _interpreted(kernel) -> bool:
    """True under TRITON_INTERPRET=1, where kernels run in numpy on the host."""
    return not isinstance(kernel, triton.runtime.JITFunction)


@triton.jit
def _value_offsets(page, pos, d, PAGE_SIZE: tl.constexpr, PRESHUFFLE: tl.constexpr):
    """Byte offset of value ``d`` of position ``pos`` in ``page`` (DESIGN §3); inputs broadcast."""
    base = page.to(tl.int64) * (PAGE_SIZE * 132)
    if PRESHUFFLE:
        inner = (pos // 16) * 2048 + (d // 16) * 256 + (pos % 16) * 16 + d % 16
    else:
        inner = pos * 128 + d
    return base + inner


@triton.jit
def _scale_offsets(page, pos, PAGE_SIZE: tl.constexpr):
    """fp32-word offset of the scale of position ``pos`` in ``page``: after the page's ``PAGE_SIZE*128`` value bytes."""
    return page.to(tl.int64) * (PAGE_SIZE * 33) + PAGE_SIZE * 32 + pos


# ---------------------------------------------------------------------------------------------------------------
# quant + cache store
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _round_to_fp8_grid(y, sign_of, MIN_EXP: tl.constexpr, SIGNED_ZERO: tl.constexpr):
    """Round fp32 ``y`` (already within +-fmax) to the nearest e4m3 value, ties to even, still in fp32.

    The fp8 cast after it is then exact on every backend, so the bytes do not depend on how a backend rounds
    (the Triton interpreter's own cast truncates and drops carries). e4m3 keeps 3 mantissa bits: the grid step is
    ``2^(e-3)`` with ``e`` the exponent of ``y``, floored at the smallest normal exponent ``MIN_EXP``
    (subnormals). Adding and subtracting 1.5 * 2^23 rounds a float below 2^22 to an integer, ties to even.
    fnuz has no negative zero (its 0x80 is NaN), hence ``SIGNED_ZERO``. The sign comes from ``sign_of`` (the
    unscaled input: the scale is positive) and is set as a bit: a GPU clamp or negation may turn -0.0 into +0.0.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign_negative = sign_of.to(tl.int32, bitcast=True) < 0
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)
    r = ((tl.abs(y) * inv_step + 12582912.0) - 12582912.0) * step
    if SIGNED_ZERO:
        negative = sign_negative
    else:
        negative = sign_negative & (r > 0.0)
    return (r.to(tl.int32, bitcast=True) | (negative.to(tl.int32) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_bf16(x):
    """fp32 -> nearest bf16 (ties to even), kept in fp32, by integer arithmetic on the bits: the same on GPUs and
    in the interpreter, whose own bf16 cast rounds differently. NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@triton.jit
def _quant_store_kernel(
    k_ptr,
    stride_k,
    slot_ptr,
    values_ptr,
    scales_ptr,
    num_tokens,
    INPUT_SCALE: tl.constexpr,
    ROUND_TO: tl.constexpr,
    FMAX: tl.constexpr,
    INV_FMAX: tl.constexpr,
    UE8M0: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PRESHUFFLE: tl.constexpr,
    MIN_EXP: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
    ON_GPU: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """act_quant of BLOCK_T rows of ``k * INPUT_SCALE`` (rounded to ``ROUND_TO``: "bf16", "fp16" or ""), then the
    fp8 values and fp32 scale of each row go to its slot.

    Bit-identical to the torch reference on the same device: torch on a GPU computes ``amax / fmax`` as
    ``amax * (1/fmax)`` (scalar divisor) and log2/exp2 with the device math library (libdevice/ocml); on the host
    (interpreter) it divides exactly. ``x / scale`` is an IEEE division in both.
    """
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, 128)
    in_range = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=in_range, other=-1).to(tl.int64)
    x = tl.load(k_ptr + t[:, None].to(tl.int64) * stride_k + d[None, :], mask=in_range[:, None], other=0.0)
    x = x.to(tl.float32)
    if INPUT_SCALE != 1.0:
        x = x * INPUT_SCALE
    if ROUND_TO == "bf16":
        x = _round_to_bf16(x)
    elif ROUND_TO == "fp16":
        x = x.to(tl.float16).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), _AMAX_FLOOR)
    if ON_GPU:
        scale = amax * INV_FMAX
    else:
        scale = tl.math.div_rn(amax, FMAX)
    if UE8M0:
        if ON_GPU:
            scale = libdevice.exp2(tl.math.ceil(libdevice.log2(scale)))
        else:
            scale = tl.exp2(tl.math.ceil(tl.log2(scale)))
    y = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FMAX, FMAX)
    y = _round_to_fp8_grid(y, x, MIN_EXP, SIGNED_ZERO).to(values_ptr.dtype.element_ty)
    keep = slot >= 0
    page = slot // PAGE_SIZE
    pos = slot % PAGE_SIZE
    tl.store(values_ptr + _value_offsets(page[:, None], pos[:, None], d[None, :], PAGE_SIZE, PRESHUFFLE), y,
             mask=keep[:, None])
    tl.store(scales_ptr + _scale_offsets(page, pos, PAGE_SIZE), scale, mask=keep)


_ROUND_TO = {None: "", torch.bfloat16: "bf16", torch.float16: "fp16"}


def quant_cache_store(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype, input_scale=1.0,
                      input_dtype=None, block_t: int = 4):
    """One launch: quantize ``k [T,128]`` (after the input epilogue) and store it into ``cache`` at
    ``slot_mapping`` (negative = padding)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    fmax = fp8_max(fp8_dtype)
    kernel = _quant_store_kernel
    kernel[(triton.cdiv(num_tokens, block_t),)](
        k,
        k.stride(0),
        slot_mapping,
        cache.view(fp8_dtype),
        cache.view(torch.float32),
        num_tokens,
        INPUT_SCALE=float(input_scale),
        ROUND_TO=_ROUND_TO[input_dtype],
        FMAX=fmax,
        INV_FMAX=float(np.float32(1.0) / np.float32(fmax)),
        UE8M0=scale_fmt == "ue8m0",
        PAGE_SIZE=page_size,
        PRESHUFFLE=preshuffle,
        MIN_EXP=1 - (8 if fp8_dtype == torch.float8_e4m3fnuz else 7),
        SIGNED_ZERO=fp8_dtype == torch.float8_e4m3fn,
        ON_GPU=not _interpreted(kernel),
        BLOCK_T=block_t,
        num_warps=4,
    )


# ---------------------------------------------------------------------------------------------------------------
# gather K (prefill)
# ---------------------------------------------------------------------------------------------------------------


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
    PAGE_SIZE: tl.constexpr,
    PRESHUFFLE: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Copy BLOCK_R output rows (raw fp8 bytes + scale); rows past ``cu_seqlens[-1]`` get zeros."""
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
    valid = (rows < tl.load(cu_ptr + batch)) & (page_col < max_pages)
    page = tl.load(bt_ptr + seq.to(tl.int64) * bt_stride + page_col, mask=valid, other=0)
    in_page = pos % PAGE_SIZE
    k = tl.load(values_ptr + _value_offsets(page[:, None], in_page[:, None], d[None, :], PAGE_SIZE, PRESHUFFLE),
                mask=valid[:, None], other=0)
    scale = tl.load(scales_ptr + _scale_offsets(page, in_page, PAGE_SIZE), mask=valid, other=0.0)
    out_rows = rows < num_tokens
    tl.store(out_k_ptr + rows[:, None].to(tl.int64) * 128 + d[None, :], k, mask=out_rows[:, None])
    tl.store(out_scale_ptr + rows, scale, mask=out_rows)


def gather_k(cache, block_table, cu_seqlens, page_size, preshuffle, num_tokens, fp8_dtype, out=None,
             block_r: int = 16):
    """Contiguous ``(k_fp8 [num_tokens,128], k_scale [num_tokens])``; a byte copy, so any fp8 dtype works."""
    if out is None:
        out = (
            torch.empty(num_tokens, HEAD_DIM, dtype=fp8_dtype, device=cache.device),
            torch.empty(num_tokens, dtype=torch.float32, device=cache.device),
        )
    k_out, scale_out = out
    if num_tokens:
        batch = block_table.shape[0]
        _gather_k_kernel[(triton.cdiv(num_tokens, block_r),)](
            cache,
            cache.view(torch.float32),
            block_table,
            cu_seqlens,
            k_out.view(torch.uint8),
            scale_out,
            num_tokens,
            batch,
            block_table.stride(0),
            block_table.shape[1],
            PAGE_SIZE=page_size,
            PRESHUFFLE=preshuffle,
            SEARCH_STEPS=max(1, batch.bit_length()),
            BLOCK_R=block_r,
            num_warps=4,
        )
    return k_out, scale_out


# ---------------------------------------------------------------------------------------------------------------
# paged MQA logits (decode)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PagedConfig:
    """Tiling of the paged logits kernel: CHUNK tokens per program, BLOCK_N tokens per fp8 dot."""

    chunk: int = 1024
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.chunk % self.block_n:
            raise ValueError(f"PagedConfig.chunk ({self.chunk}) must be a multiple of block_n ({self.block_n})")


PAGED_CONFIG = PagedConfig()
PAGED_MIN_PROGRAMS = 256  # about two waves on an H200 (132 SMs): small batches split their context finer


def _default_paged_config(batch: int, max_len: int) -> PagedConfig:
    chunk = PAGED_CONFIG.chunk
    while chunk > PAGED_CONFIG.block_n and batch * triton.cdiv(max_len, chunk) < PAGED_MIN_PROGRAMS:
        chunk //= 2
    return PagedConfig(chunk, PAGED_CONFIG.block_n, PAGED_CONFIG.num_warps, PAGED_CONFIG.num_stages)


@triton.jit
def _paged_mqa_logits_kernel(
    q_ptr,
    values_ptr,
    scales_ptr,
    w_ptr,
    ctx_ptr,
    bt_ptr,
    out_ptr,
    next_n,
    heads,
    max_len,
    bt_stride,
    max_pages,
    PAGE_SIZE: tl.constexpr,
    PRESHUFFLE: tl.constexpr,
    NEXT_N: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program (b, c) writes columns [c*CHUNK, (c+1)*CHUNK) of the next_n rows of sequence b.

    Per BLOCK_N keys: ``scores[s, (j,h)] = k8[s] . q8[b,j,h]`` in one fp8 dot (keys are the M side, so the head
    sum is a reduction along the dot's N side: mostly within a thread), then
    ``logit[s, j] = sum_h w[j,h] * relu(scores * k_scale[s])``; chunks wholly past the context only store -inf.
    """
    b = tl.program_id(0)
    start = tl.program_id(1) * CHUNK
    ctx = tl.load(ctx_ptr + b)
    jj = tl.arange(0, NEXT_N)
    out_row = (b * next_n + jj).to(tl.int64) * max_len
    row_ok = jj < next_n
    if start >= ctx:
        for n0 in range(start, start + CHUNK, BLOCK_N):
            s = n0 + tl.arange(0, BLOCK_N)
            tl.store(out_ptr + out_row[None, :] + s[:, None], tl.full([BLOCK_N, NEXT_N], float("-inf"), tl.float32),
                     mask=(s[:, None] < max_len) & row_ok[None, :])
    else:
        m = tl.arange(0, NEXT_N * HEADS_PAD)
        j = m // HEADS_PAD
        h = m % HEADS_PAD
        m_ok = (j < next_n) & (h < heads)
        d = tl.arange(0, 128)
        q_rows = (b * next_n + j) * heads + h
        q = tl.load(q_ptr + q_rows[:, None].to(tl.int64) * 128 + d[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptr + q_rows, mask=m_ok, other=0.0)
        limit = ctx - next_n + jj
        visible_end = tl.minimum(start + CHUNK, ctx)
        for n0 in tl.range(start, visible_end, BLOCK_N):
            s = n0 + tl.arange(0, BLOCK_N)
            page_col = s // PAGE_SIZE
            load_ok = (s < ctx) & (page_col < max_pages)
            page = tl.load(bt_ptr + b.to(tl.int64) * bt_stride + page_col, mask=load_ok, other=0)
            pos = s % PAGE_SIZE
            k = tl.load(values_ptr + _value_offsets(page[:, None], pos[:, None], d[None, :], PAGE_SIZE, PRESHUFFLE),
                        mask=load_ok[:, None], other=0.0)
            k_scale = tl.load(scales_ptr + _scale_offsets(page, pos, PAGE_SIZE), mask=load_ok, other=0.0)
            scores = tl.dot(k, tl.trans(q))
            scores = tl.maximum(scores * k_scale[:, None], 0.0) * w[None, :]
            if NEXT_N == 1:
                logits = tl.sum(scores, axis=1)[:, None]
            else:
                logits = tl.sum(tl.reshape(scores, [BLOCK_N, NEXT_N, HEADS_PAD]), axis=2)
            logits = tl.where(s[:, None] <= limit[None, :], logits, float("-inf"))
            tl.store(out_ptr + out_row[None, :] + s[:, None], logits, mask=(s[:, None] < max_len) & row_ok[None, :])
        first_hidden = start + tl.cdiv(visible_end - start, BLOCK_N) * BLOCK_N
        for n0 in range(first_hidden, start + CHUNK, BLOCK_N):
            s = n0 + tl.arange(0, BLOCK_N)
            tl.store(out_ptr + out_row[None, :] + s[:, None], tl.full([BLOCK_N, NEXT_N], float("-inf"), tl.float32),
                     mask=(s[:, None] < max_len) & row_ok[None, :])


def paged_mqa_logits(q_fp8, cache, weights, context_lens, block_table, max_len, page_size, preshuffle, out=None,
                     config: PagedConfig | None = None):
    """Decode logits ``[B*next_n, max_len]`` fp32, every element written (-inf where masked)."""
    batch, next_n, heads, _ = q_fp8.shape
    cfg = config or _default_paged_config(batch, max_len)
    if out is None:
        out = torch.empty(batch * next_n, max_len, dtype=torch.float32, device=q_fp8.device)
    if batch == 0 or max_len == 0:
        return out
    _paged_mqa_logits_kernel[(batch, triton.cdiv(max_len, cfg.chunk))](
        q_fp8,
        cache.view(q_fp8.dtype),
        cache.view(torch.float32),
        weights,
        context_lens,
        block_table,
        out,
        next_n,
        heads,
        max_len,
        block_table.stride(0),
        block_table.shape[1],
        PAGE_SIZE=page_size,
        PRESHUFFLE=preshuffle,
        NEXT_N=triton.next_power_of_2(next_n),
        HEADS_PAD=max(16, triton.next_power_of_2(heads)),
        CHUNK=cfg.chunk,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# ragged MQA logits (prefill)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RaggedConfig:
    """Tiling of the ragged logits kernel: a BLOCK_M x BLOCK_N output tile per program, looping over heads."""

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3


RAGGED_CONFIG = RaggedConfig()


@triton.jit
def _mqa_logits_kernel(
    q_ptr,
    k_ptr,
    k_scale_ptr,
    w_ptr,
    ks_ptr,
    ke_ptr,
    out_ptr,
    num_tokens,
    num_keys,
    heads,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``out[t, n] = k_scale[n] * sum_h w[t,h] * relu(q8[t,h] . k8[n])`` on one tile, -inf outside [ks, ke).

    k_scale > 0 is factored out of the head sum (exact in real arithmetic) to save one multiply per score.
    Tiles outside every row's window only store -inf. Key tiles are the fast grid axis, so programs running at the
    same time share their q rows (all heads: BLOCK_M * H * 128 bytes) in L2.
    """
    n0 = tl.program_id(0) * BLOCK_N
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    row_ok = rows < num_tokens
    col_ok = cols < num_keys
    ks = tl.load(ks_ptr + rows, mask=row_ok, other=0)
    ke = tl.load(ke_ptr + rows, mask=row_ok, other=0)
    live = tl.max(((ks < n0 + BLOCK_N) & (ke > n0) & (ks < ke)).to(tl.int32), axis=0)
    if live > 0:
        d = tl.arange(0, 128)
        k = tl.load(k_ptr + cols[:, None].to(tl.int64) * 128 + d[None, :], mask=col_ok[:, None], other=0.0)
        k_t = tl.trans(k)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        q_base = q_ptr + rows[:, None].to(tl.int64) * heads * 128 + d[None, :]
        for h in tl.range(0, heads):
            q = tl.load(q_base + h * 128, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptr + rows.to(tl.int64) * heads + h, mask=row_ok, other=0.0)
            acc += tl.maximum(tl.dot(q, k_t), 0.0) * w[:, None]
        k_scale = tl.load(k_scale_ptr + cols, mask=col_ok, other=0.0)
        inside = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
        logits = tl.where(inside, acc * k_scale[None, :], float("-inf"))
    else:
        logits = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * num_keys + cols[None, :], logits,
             mask=row_ok[:, None] & col_ok[None, :])


def mqa_logits(q_fp8, k_fp8, k_scale, weights, ks, ke, out=None, config: RaggedConfig | None = None):
    """Prefill logits ``[T, N]`` fp32, every element written (-inf outside ``[ks[t], ke[t])``)."""
    cfg = config or RAGGED_CONFIG
    tokens, heads, _ = q_fp8.shape
    num_keys = k_fp8.shape[0]
    if out is None:
        out = torch.empty(tokens, num_keys, dtype=torch.float32, device=q_fp8.device)
    if tokens == 0 or num_keys == 0:
        return out
    _mqa_logits_kernel[(triton.cdiv(num_keys, cfg.block_n), triton.cdiv(tokens, cfg.block_m))](
        q_fp8,
        k_fp8,
        k_scale,
        weights,
        ks,
        ke,
        out,
        tokens,
        num_keys,
        heads,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


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


# ---------------------------------------------------------------------------------------------------------------
# head-gate GEMM
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _dot_bf16(acc, x, w, ON_GPU: tl.constexpr):
    """``acc + x @ w^T`` for operands whose values are bf16: a bf16 dot on GPUs; under the interpreter (its dot
    multiplies bf16 tiles as the integers they are stored in) an exact fp32 dot of the same values."""
    if ON_GPU:
        acc = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
    else:
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return acc


@triton.jit
def _head_gate_gemm_kernel(x_ptr, w_ptr, out_ptr, m, n, k, chunk, stride_xm, stride_xk, stride_wn, stride_wk,
                           WEIGHT: tl.constexpr, ON_GPU: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[s, rows, cols] = x[rows, chunk s] @ w[cols, chunk s]^T`` for one [BLOCK_M, BLOCK_N] tile of split ``s``,
    bf16 dots accumulated in fp32. ``WEIGHT``: "bf16" (used as is), "round" (fp32 rounded to bf16) or "split"
    (fp32 as hi + lo: hi = W with its low 16 bits cleared, lo = bf16(W - hi); two dots into one accumulator).
    The fp32 weight is read once and split in registers: no bf16 copy of it is ever written."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    k_begin = split * chunk
    k_end = tl.minimum(k_begin + chunk, k)
    row_ok = rows < m
    col_ok = cols < n
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_end
        x = tl.load(x_rows + kk[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :] * stride_wk, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if WEIGHT == "split":
            hi = (w.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
            acc = _dot_bf16(acc, x, hi, ON_GPU)
            acc = _dot_bf16(acc, x, _round_to_bf16(w - hi), ON_GPU)
        elif WEIGHT == "round":
            acc = _dot_bf16(acc, x, _round_to_bf16(w), ON_GPU)
        else:
            acc = _dot_bf16(acc, x, w, ON_GPU)
    out = out_ptr + split.to(tl.int64) * m * n + rows[:, None].to(tl.int64) * n + cols[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class HeadGateConfig:
    """Tiling of the head-gate GEMM: a BLOCK_M x BLOCK_N output tile of one K chunk per program."""

    block_m: int
    block_n: int
    num_stages: int


def _default_head_gate_config(rows: int) -> HeadGateConfig:
    """Decode has few rows: small tiles give the 1.8 MB weight read enough programs (it is latency-bound)."""
    block_m = 16 if rows <= 16 else 32 if rows <= 64 else 64
    block_n = 32 if rows > 512 else 16
    return HeadGateConfig(block_m, block_n, 3 if rows > 2048 else 4)


def head_gate_gemm(x, weight, splits, round_weight, out=None, config: HeadGateConfig | None = None):
    """Split-K partials ``[splits, M, N]`` fp32 of ``x @ weight^T``, every element written (empty chunks as zeros).

    Any strides: a frozen weight arrives as a transposed view of its folded ``W^T`` and is read in place, not copied
    on each call. One program per [BLOCK_M, BLOCK_N] output tile and K chunk.
    """
    rows, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
    if rows == 0 or n == 0:
        return out
    cfg = config or _default_head_gate_config(rows)
    mode = "bf16" if weight.dtype == torch.bfloat16 else "round" if round_weight else "split"
    grid = (triton.cdiv(rows, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    kernel = _head_gate_gemm_kernel
    kernel[grid](x, weight, out, rows, n, k, head_gate_chunk(k, splits), *x.stride(), *weight.stride(), WEIGHT=mode,
                 ON_GPU=not _interpreted(kernel), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                 BLOCK_K=HEAD_GATE_K_ALIGN, num_warps=4, num_stages=cfg.num_stages)
    return out
