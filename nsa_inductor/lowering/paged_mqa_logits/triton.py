"""Triton kernel of ``nsa.paged_mqa_logits``: program (b, c) writes a CHUNK of columns of sequence b's rows.

Small batches split their context into finer chunks so that the GPU has enough programs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._triton_common import (cdiv, launch, next_power_of_2, scale_offsets, value_offsets, wait_for_previous_grid,
                              wrapped_index)


@dataclass(frozen=True)
class PagedConfig:
    """Tiling of the paged logits kernel: CHUNK tokens per program, BLOCK_N tokens per fp8 dot."""

    chunk: int = 1024
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.chunk % self.block_n:
            raise ValueError(f"PagedConfig.chunk ({self.chunk}) must be a multiple of block_n ({self.block_n})")


PAGED_CONFIG = PagedConfig()
PAGED_MIN_PROGRAMS = 256  # about two waves on an H200 (132 SMs): small batches split their context finer


@functools.lru_cache(maxsize=1024)  # per shape; a config is built once
def _default_paged_config(batch: int, max_len: int) -> PagedConfig:
    chunk = PAGED_CONFIG.chunk
    while chunk > PAGED_CONFIG.block_n and batch * cdiv(max_len, chunk) < PAGED_MIN_PROGRAMS:
        chunk //= 2
    return PagedConfig(chunk, PAGED_CONFIG.block_n, PAGED_CONFIG.num_warps, PAGED_CONFIG.num_stages)


@triton.jit
def _paged_mqa_logits_kernel(
    q_ptr,
    values_ptr,
    scales_ptr,
    w_ptr,
    w_factor_ptr,
    w_scale,
    ctx_ptr,
    bt_ptr,
    out_ptr,
    next_n,
    heads,
    max_len,
    bt_stride,
    max_pages,
    num_pages,
    PAGE_SIZE: tl.constexpr,
    PRESHUFFLE: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    W_SPLITS: tl.constexpr,
    NEXT_N: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WRITE_MASKED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (b, c) writes columns [c*CHUNK, (c+1)*CHUNK) of the next_n rows of sequence b.

    Per BLOCK_N keys: ``scores[s, (j,h)] = k8[s] . q8[b,j,h]`` in one fp8 dot (keys are the M side, so the head
    sum is a reduction along the dot's N side: mostly within a thread), then
    ``logit[s, j] = k_scale[s] * sum_h w[j,h] * relu(scores)``: a scale is positive, so it leaves the relu and the
    head sum (one multiply per key, not per head; the same bits as scaling first for power-of-two ue8m0 scales);
    chunks wholly past the context only store -inf (nothing without WRITE_MASKED: they are never read), and keys on
    an unreadable page (docs/indices.md) are -inf, never loaded.
    """
    wait_for_previous_grid(PDL)
    b = tl.program_id(0)
    start = tl.program_id(1) * CHUNK
    ctx = tl.load(ctx_ptr + b)
    jj = tl.arange(0, NEXT_N)
    out_row = (b * next_n + jj).to(tl.int64) * max_len
    row_ok = jj < next_n
    if start >= ctx:
        if WRITE_MASKED:
            for n0 in range(start, start + CHUNK, BLOCK_N):
                s = n0 + tl.arange(0, BLOCK_N)
                tl.store(out_ptr + out_row[None, :] + s[:, None],
                         tl.full([BLOCK_N, NEXT_N], float("-inf"), tl.float32),
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
        for split in tl.static_range(1, W_SPLITS):  # split-K partials of the weights, added left to right
            w += tl.load(w_ptr + split * (tl.num_programs(0) * next_n * heads) + q_rows, mask=m_ok, other=0.0)
        if HAS_FACTOR:  # the head weights as the model computes them, e.g. gates * q_scale * c
            w = w * tl.load(w_factor_ptr + q_rows, mask=m_ok, other=0.0)
        w = w * w_scale
        limit = ctx - next_n + jj
        visible_end = tl.minimum(start + CHUNK, ctx)
        for n0 in tl.range(start, visible_end, BLOCK_N):
            s = n0 + tl.arange(0, BLOCK_N)
            page_col = s // PAGE_SIZE
            in_table = (s < ctx) & (page_col < max_pages)
            page = tl.load(bt_ptr + b.to(tl.int64) * bt_stride + page_col, mask=in_table, other=0)
            page, load_ok = wrapped_index(page, in_table, num_pages)
            pos = s % PAGE_SIZE
            k = tl.load(values_ptr + value_offsets(page[:, None], pos[:, None], d[None, :], PAGE_SIZE, PRESHUFFLE),
                        mask=load_ok[:, None], other=0.0)
            k_scale = tl.load(scales_ptr + scale_offsets(page, pos, PAGE_SIZE), mask=load_ok, other=0.0)
            scores = tl.maximum(tl.dot(k, tl.trans(q)), 0.0) * w[None, :]
            if NEXT_N == 1:
                logits = tl.sum(scores, axis=1)[:, None]
            else:
                logits = tl.sum(tl.reshape(scores, [BLOCK_N, NEXT_N, HEADS_PAD]), axis=2)
            logits = logits * k_scale[:, None]
            logits = tl.where((s[:, None] <= limit[None, :]) & load_ok[:, None], logits, float("-inf"))
            tl.store(out_ptr + out_row[None, :] + s[:, None], logits, mask=(s[:, None] < max_len) & row_ok[None, :])
        if WRITE_MASKED:
            first_hidden = start + tl.cdiv(visible_end - start, BLOCK_N) * BLOCK_N
            for n0 in range(first_hidden, start + CHUNK, BLOCK_N):
                s = n0 + tl.arange(0, BLOCK_N)
                tl.store(out_ptr + out_row[None, :] + s[:, None],
                         tl.full([BLOCK_N, NEXT_N], float("-inf"), tl.float32),
                         mask=(s[:, None] < max_len) & row_ok[None, :])


def paged_mqa_logits(q_fp8, cache, weights, context_lens, block_table, max_len, page_size, preshuffle,
                     weights_factor=None, weight_scale=1.0, write_masked=True, out=None,
                     config: PagedConfig | None = None):
    """Decode logits ``[B*next_n, max_len]`` fp32, every element written (-inf where masked; with ``write_masked``
    False, not the blocks of columns past a row's context)."""
    batch, next_n, heads, _ = q_fp8.shape
    cfg = config or _default_paged_config(batch, max_len)
    if out is None:
        out = torch.empty(batch * next_n, max_len, dtype=torch.float32, device=q_fp8.device)
    if batch == 0 or max_len == 0:
        return out
    launch(_paged_mqa_logits_kernel, (batch, cdiv(max_len, cfg.chunk)), q_fp8, cache.view(q_fp8.dtype),
           cache.view(torch.float32), weights, weights if weights_factor is None else weights_factor, weight_scale,
           context_lens, block_table, out, next_n, heads, max_len, block_table.stride(0), block_table.shape[1],
           cache.shape[0], PAGE_SIZE=page_size, PRESHUFFLE=preshuffle, HAS_FACTOR=weights_factor is not None,
           W_SPLITS=weights.shape[0] if weights.dim() == 3 else 1, NEXT_N=next_power_of_2(next_n),
           HEADS_PAD=max(16, next_power_of_2(heads)), CHUNK=cfg.chunk, BLOCK_N=cfg.block_n,
           WRITE_MASKED=write_masked, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
