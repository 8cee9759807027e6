"""Triton kernels of ``nsa.batched_mqa_logits``, two tilings of one sum.

Few query rows a batch entry (decode): one dot scores every head of 1-2 rows against a block of keys (the keys as
its M, so that the head sum runs along each thread's row of the tile; or the heads) and the head sum is a reduction
of the tile; a program walks a chunk of keys with q in registers.
Many rows (prefill): a tile's M is 64 rows of one head, the heads a loop that accumulates ``relu(dot) * w`` in
place, as ``nsa.mqa_logits`` does.
With a mask, both read only the keys (and rows) a tile keeps somewhere: masked loads issue no memory reads, and a
prefill tile the mask drops whole (a causal mask's upper half) runs no head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._triton_common import cdiv, dot_upcast, launch, next_power_of_2, wait_for_previous_grid
from . import reference


@dataclass(frozen=True)
class BatchedConfig:
    """``rows_in_m``: the prefill tiling (``block_m`` rows a tile); else the decode one (``chunk`` keys a program, the
    keys or the heads as the dot's M: ``keys_in_m``)."""

    rows_in_m: bool
    keys_in_m: bool = True
    block_m: int = 64
    block_n: int = 128
    chunk: int = 1024
    num_warps: int = 4
    num_stages: int = 2


MAX_DIM = 256  # larger head dims (a tile of q and one of k no longer fit in registers) run the reference
ROWS_IN_M_FROM = 16  # query rows a batch entry from which the prefill tiling serves


def config_for(batch: int, tokens: int, keys: int) -> BatchedConfig:
    """The prefill tiling from ``ROWS_IN_M_FROM`` rows, else the decode one: chunks of 512 keys where they make at
    least 1024 programs (B=64 ctx 8192), else of 256 (B=1..8: more programs; the sweep in BENCHMARKS.md). Two stages:
    three exceed gfx942's 64 KB of shared memory."""
    if tokens >= ROWS_IN_M_FROM:
        return BatchedConfig(rows_in_m=True)
    return BatchedConfig(rows_in_m=False, chunk=512 if batch * tokens * cdiv(keys, 512) >= 1024 else 256)


@triton.jit
def _heads_in_m_kernel(q_ptr, k_ptr, w_ptr, scale_ptr, mask_ptr, out_ptr, tokens, keys, heads, scale,
                       mask_sb, mask_ss, mask_st, fill, ROWS: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                       DP: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SCALE_TENSOR: tl.constexpr,
                       HAS_MASK: tl.constexpr, KEYS_IN_M: tl.constexpr, PDL: tl.constexpr = False):
    """Rows ``s0 .. s0 + ROWS`` of batch entry b against keys ``[c * CHUNK, (c + 1) * CHUNK)``; ``KEYS_IN_M``: the
    keys are the dot's M (the head sum then runs along each thread's row of the tile), else the heads are."""
    wait_for_previous_grid(PDL)
    b = tl.program_id(2).to(tl.int64)
    s = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    h = tl.arange(0, HP)
    d = tl.arange(0, DP)
    d_ok = d < D
    row_ok = s < tokens
    rows = b * tokens + s  # rows of q [B * S, H, D] and of the output [B * S, T]
    rh_ok = row_ok[:, None] & (h < heads)[None, :]
    rh = rows[:, None] * heads + h[None, :]
    q = tl.load(q_ptr + rh[:, :, None] * D + d[None, None, :], mask=rh_ok[:, :, None] & d_ok[None, None, :],
                other=0.0)
    q = tl.reshape(q, [ROWS * HP, DP])  # one dot scores every head of the rows
    w = tl.load(w_ptr + rh, mask=rh_ok, other=0.0)
    scale_by = tl.load(scale_ptr) if SCALE_TENSOR else 1.0
    k_base = k_ptr + b * keys * D
    start = tl.program_id(0) * CHUNK
    end = tl.minimum(start + CHUNK, keys)
    if HAS_MASK:  # the chunk's keys from the first to the last any row keeps: the ones read
        mask_rows = mask_ptr + b * mask_sb + s.to(tl.int64) * mask_ss
        c = start + tl.arange(0, CHUNK)
        kept = tl.max(tl.load(mask_rows[None, :] + c[:, None] * mask_st, mask=(c < end)[:, None] & row_ok[None, :],
                              other=0).to(tl.int32), axis=1) > 0
        first = tl.min(tl.where(kept, c, end))
        last = tl.max(tl.where(kept, c, -1))
    for n0 in tl.range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        in_keys = n < keys
        read = ((n >= first) & (n <= last)) if HAS_MASK else in_keys
        k = tl.load(k_base + n[:, None] * D + d[None, :], mask=read[:, None] & d_ok[None, :], other=0.0)
        if HAS_MASK:  # keep [N, ROWS]: the scores the mask keeps
            keep = tl.load(mask_rows[None, :] + n[:, None] * mask_st, mask=in_keys[:, None] & row_ok[None, :],
                           other=0) != 0
        if KEYS_IN_M:
            scores = tl.maximum(dot_upcast(k, tl.trans(q)) * scale * scale_by, 0.0)  # relu(k.q * scale), [N, ROWS*HP]
            logits = tl.sum(tl.reshape(scores, [BLOCK_N, ROWS, HP]) * w[None, :, :], axis=2)
            if HAS_MASK:
                logits = tl.where(keep, logits, fill)
            tl.store(out_ptr + rows[None, :] * keys + n[:, None], logits, mask=row_ok[None, :] & in_keys[:, None])
        else:
            scores = tl.maximum(dot_upcast(q, tl.trans(k)) * scale * scale_by, 0.0)  # relu(q.k * scale), [ROWS*HP, N]
            logits = tl.sum(tl.reshape(scores, [ROWS, HP, BLOCK_N]) * w[:, :, None], axis=1)
            if HAS_MASK:
                logits = tl.where(tl.trans(keep), logits, fill)
            tl.store(out_ptr + rows[:, None] * keys + n[None, :], logits, mask=row_ok[:, None] & in_keys[None, :])


@triton.jit
def _rows_in_m_kernel(q_ptr, k_ptr, w_ptr, scale_ptr, mask_ptr, out_ptr, tokens, keys, heads, scale,
                      mask_sb, mask_ss, mask_st, fill, BLOCK_M: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                      BLOCK_N: tl.constexpr, SCALE_TENSOR: tl.constexpr, HAS_MASK: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Rows ``s0 .. s0 + BLOCK_M`` of batch entry b against one block of keys, the heads in a loop."""
    wait_for_previous_grid(PDL)
    b = tl.program_id(2).to(tl.int64)
    s = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, DP)
    d_ok = d < D
    row_ok = s < tokens
    in_keys = n < keys
    rows = b * tokens + s
    read_rows, read_keys, head_end = row_ok, in_keys, heads
    if HAS_MASK:  # rows and keys the mask keeps nowhere in the tile are not read; a tile it drops whole not computed
        mask_rows = mask_ptr + b * mask_sb + s.to(tl.int64) * mask_ss
        keep = tl.load(mask_rows[:, None] + n[None, :] * mask_st, mask=row_ok[:, None] & in_keys[None, :],
                       other=0).to(tl.int32)
        read_rows = row_ok & (tl.max(keep, axis=1) > 0)
        read_keys = in_keys & (tl.max(keep, axis=0) > 0)
        head_end = tl.where(tl.max(tl.max(keep, axis=1), axis=0) > 0, heads, 0)
    k = tl.load(k_ptr + (b * keys + n[:, None]) * D + d[None, :], mask=read_keys[:, None] & d_ok[None, :], other=0.0)
    k_t = tl.trans(k)
    scale_by = tl.load(scale_ptr) if SCALE_TENSOR else 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for h in tl.range(0, head_end):
        q = tl.load(q_ptr + (rows[:, None] * heads + h) * D + d[None, :], mask=read_rows[:, None] & d_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + rows * heads + h, mask=read_rows, other=0.0)
        acc += tl.maximum(dot_upcast(q, k_t) * scale * scale_by, 0.0) * w[:, None]
    if HAS_MASK:  # (loaded again, its addresses built again: held across the loop they would spill)
        mask_keys = mask_ptr + b * mask_sb + n * mask_st
        keep = tl.load(mask_keys[None, :] + s.to(tl.int64)[:, None] * mask_ss,
                       mask=read_rows[:, None] & read_keys[None, :], other=0)
        acc = tl.where(keep != 0, acc, fill)
    tl.store(out_ptr + rows[:, None] * keys + n[None, :], acc, mask=row_ok[:, None] & in_keys[None, :])


def batched_mqa_logits(q, k, weights, scale, scale_tensor=None, mask=None, fill=None,
                       config: BatchedConfig | None = None) -> torch.Tensor:
    batch, tokens, heads, dim = q.shape
    keys = k.shape[1]
    if dim > MAX_DIM:
        return reference.batched_mqa_logits(q, k, weights, scale, scale_tensor, mask, fill)
    out = torch.empty(batch, tokens, keys, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    fill = float("-inf") if fill is None else fill
    if heads == 0:
        return out.zero_() if mask is None else out.zero_().masked_fill_(~mask, fill)
    cfg = config or config_for(batch, tokens, keys)
    mask_args = (None, 0, 0, 0) if mask is None else (mask.view(torch.uint8), *mask.stride())
    args = (q, k, weights, scale_tensor, mask_args[0], out, tokens, keys, heads, scale, *mask_args[1:], fill)
    common = dict(SCALE_TENSOR=scale_tensor is not None, HAS_MASK=mask is not None, D=dim,
                  DP=max(16, next_power_of_2(dim)), BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    if cfg.rows_in_m:
        launch(_rows_in_m_kernel, (cdiv(keys, cfg.block_n), cdiv(tokens, cfg.block_m), batch), *args,
               BLOCK_M=cfg.block_m, **common)
    else:
        hp = next_power_of_2(heads)
        rows = min(next_power_of_2(tokens), max(1, 128 // hp)) if hp < 128 else 1
        rows = max(rows, cdiv(16, hp))  # (a dot's M is at least 16)
        launch(_heads_in_m_kernel, (cdiv(keys, cfg.chunk), cdiv(tokens, rows), batch), *args, ROWS=rows, HP=hp,
               CHUNK=cfg.chunk, KEYS_IN_M=cfg.keys_in_m, **common)
    return out
