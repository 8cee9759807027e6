"""Triton kernel of ``nsa.mqa_logits``: a BLOCK_M x BLOCK_N output tile per program, looping over heads."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._triton_common import cdiv, launch, wait_for_previous_grid


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
    WRITE_MASKED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``out[t, n] = k_scale[n] * sum_h w[t,h] * relu(q8[t,h] . k8[n])`` on one tile, -inf outside [ks, ke).

    k_scale > 0 is factored out of the head sum (exact in real arithmetic) to save one multiply per score.
    Tiles outside every row's window only store -inf (without WRITE_MASKED, not those at or past every row's ke:
    a causal prefill's upper triangle). Key tiles are the fast grid axis, so programs running at the
    same time share their q rows (all heads: BLOCK_M * H * 128 bytes) in L2.
    """
    wait_for_previous_grid(PDL)
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
    dst = out_ptr + rows[:, None].to(tl.int64) * num_keys + cols[None, :]
    if WRITE_MASKED:
        tl.store(dst, logits, mask=row_ok[:, None] & col_ok[None, :])
    elif tl.max(ke, axis=0) > n0:  # (a row of the tile is read this far: rows past the tokens have ke 0)
        tl.store(dst, logits, mask=row_ok[:, None] & col_ok[None, :])


def mqa_logits(q_fp8, k_fp8, k_scale, weights, ks, ke, write_masked=True, out=None,
               config: RaggedConfig | None = None):
    """Prefill logits ``[T, N]`` fp32, every element written (-inf outside ``[ks[t], ke[t])``; with ``write_masked``
    False, not the tiles at or past every one of their rows' ``ke``)."""
    cfg = config or RAGGED_CONFIG
    tokens, heads, _ = q_fp8.shape
    num_keys = k_fp8.shape[0]
    if out is None:
        out = torch.empty(tokens, num_keys, dtype=torch.float32, device=q_fp8.device)
    if tokens == 0 or num_keys == 0:
        return out
    launch(_mqa_logits_kernel, (cdiv(num_keys, cfg.block_n), cdiv(tokens, cfg.block_m)), q_fp8, k_fp8, k_scale, weights,
           ks, ke, out, tokens, num_keys, heads, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, WRITE_MASKED=write_masked,
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
