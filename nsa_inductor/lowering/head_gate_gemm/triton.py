"""Triton kernel of ``nsa.head_gate_gemm``: one program per [BLOCK_M, BLOCK_N] output tile and K chunk."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._triton_common import interpreted, round_to_bf16
from .._triton_common import cdiv
from .reference import HEAD_GATE_K_ALIGN, head_gate_chunk


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
            acc = _dot_bf16(acc, x, round_to_bf16(w - hi), ON_GPU)
        elif WEIGHT == "round":
            acc = _dot_bf16(acc, x, round_to_bf16(w), ON_GPU)
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


@functools.lru_cache(maxsize=1024)  # per shape; a config is built once
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
    grid = (cdiv(rows, cfg.block_m), cdiv(n, cfg.block_n), splits)
    kernel = _head_gate_gemm_kernel
    kernel[grid](x, weight, out, rows, n, k, head_gate_chunk(k, splits), *x.stride(), *weight.stride(), WEIGHT=mode,
                 ON_GPU=not interpreted(kernel), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                 BLOCK_K=HEAD_GATE_K_ALIGN, num_warps=4, num_stages=cfg.num_stages)
    return out
