"""Triton kernel of ``nsa.head_gate_gemm``: one program per [BLOCK_M, BLOCK_N] output tile and K chunk."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._triton_common import cdiv, dot_bf16, launch, round_to_bf16, split_bf16, wait_for_previous_grid
from .reference import HEAD_GATE_K_ALIGN, head_gate_chunk


@triton.jit
def split_k_tile(x_ptr, w_ptr, out_ptr, pid_m, pid_n, split, m, n, k, chunk, stride_xm, stride_xk, stride_wn,
                 stride_wk, WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """``out[split, rows, cols] = x[rows, chunk split] @ w[cols, chunk split]^T`` for output tile (pid_m, pid_n) of
    ``out [splits, m, n]``, accumulated in fp32. ``WEIGHT``: "bf16" (used as is), "round" (fp32 rounded to bf16) or
    "split" (fp32 as hi + lo: hi = W with its low 16 bits cleared, lo = bf16(W - hi)). The fp32 weight is read once
    and split in registers: no bf16 copy of it is ever written.

    Tiles of 16+ rows multiply with bf16 dots (hi and lo: two dots into one accumulator). A one-row tile (B=1
    decode, where a dot would waste 15 of its 16 rows) multiplies in fp32 FMA arithmetic: the same weight values
    (``hi + lo`` is exact in fp32), products summed per column in a tree (BENCHMARKS.md "wk and gate for one row")."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = split * chunk
    k_end = tl.minimum(k_begin + chunk, k)
    row_ok = rows < m
    col_ok = cols < n
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    if BLOCK_M == 1:
        products = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # per column and lane, summed after the loop
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_end
        x = tl.load(x_rows + kk[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :] * stride_wk, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_M == 1:
            if WEIGHT == "split":
                hi, lo = split_bf16(w)
                w = hi + lo
            elif WEIGHT == "round":
                w = round_to_bf16(w)
            products += w.to(tl.float32) * x.to(tl.float32)
        elif WEIGHT == "split":
            hi, lo = split_bf16(w)
            acc = dot_bf16(acc, x, tl.trans(hi))
            acc = dot_bf16(acc, x, tl.trans(lo))
        elif WEIGHT == "round":
            acc = dot_bf16(acc, x, tl.trans(round_to_bf16(w)))
        else:
            acc = dot_bf16(acc, x, tl.trans(w))
    if BLOCK_M == 1:
        acc = (tl.sum(products, axis=1) + 0.0)[None, :]  # +0.0: an all-zero sum is +0, as a dot's
    out = out_ptr + split.to(tl.int64) * m * n + rows[:, None].to(tl.int64) * n + cols[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _head_gate_gemm_kernel(x_ptr, w_ptr, out_ptr, m, n, k, chunk, stride_xm, stride_xk, stride_wn, stride_wk,
                           WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PDL: tl.constexpr = False):
    """One [BLOCK_M, BLOCK_N] output tile of one K chunk per program: grid (row tiles, column tiles, splits)."""
    wait_for_previous_grid(PDL)
    split_k_tile(x_ptr, w_ptr, out_ptr, tl.program_id(0), tl.program_id(1), tl.program_id(2), m, n, k, chunk,
                 stride_xm, stride_xk, stride_wn, stride_wk, WEIGHT, BLOCK_M, BLOCK_N, BLOCK_K)


@dataclass(frozen=True)
class HeadGateConfig:
    """Tiling of the head-gate GEMM: a BLOCK_M x BLOCK_N output tile of one K chunk per program."""

    block_m: int
    block_n: int
    num_stages: int


@functools.lru_cache(maxsize=1024)  # per shape; a config is built once
def _default_head_gate_config(rows: int) -> HeadGateConfig:
    """Decode has few rows: small tiles give the 1.8 MB weight read enough programs (it is latency-bound); up to 512
    rows 16 x 32 tiles, which beat one row's FMA tile, 32 x 16 and 64 x 16 with the weight read from HBM in a CUDA
    graph (BENCHMARKS.md, head-gate GEMM alone; "The head gate at 128-512 rows"). Prefill's rows take every
    column in a tile, so x is read once: 32-row tiles up to 2048 rows, then 128 (BENCHMARKS.md "The head gate's tiles
    at prefill")."""
    if rows <= 512:
        return HeadGateConfig(16, 32, 4)
    if rows <= 2048:
        return HeadGateConfig(32, 64, 4)
    return HeadGateConfig(128, 64, 4 if rows <= 4096 else 3)


def weight_mode(weight: torch.Tensor, round_weight: bool) -> str:
    """``split_k_tile``'s ``WEIGHT`` for this weight: "bf16" (a bf16 weight), "round" or "split" (an fp32 one)."""
    return "bf16" if weight.dtype == torch.bfloat16 else "round" if round_weight else "split"


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
    mode = weight_mode(weight, round_weight)
    grid = (cdiv(rows, cfg.block_m), cdiv(n, cfg.block_n), splits)
    launch(_head_gate_gemm_kernel, grid, x, weight, out, rows, n, k, head_gate_chunk(k, splits), *x.stride(),
           *weight.stride(), WEIGHT=mode, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=HEAD_GATE_K_ALIGN,
           num_warps=4, num_stages=cfg.num_stages)
    return out
