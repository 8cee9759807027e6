"""Triton kernel of ``nsa.wk_gate_gemm``: one launch, one program per output tile and K chunk of either product."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._triton_common import launch, wait_for_previous_grid
from ..head_gate_gemm.reference import head_gate_chunk
from ..head_gate_gemm.triton import split_k_tile, weight_mode


@dataclass(frozen=True)
class WkGateConfig:
    """Tiles of ``nsa.wk_gate_gemm`` for up to ``max_rows`` rows of x: a ``block_m`` x ``gate_block_n`` (gate) or
    ``block_m`` x ``k_block_n`` (K projection) output tile of one K chunk per program, ``block_k`` columns of K per
    loop step."""

    max_rows: int
    block_m: int
    gate_block_n: int
    k_block_n: int
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4


# DeepSeek-V3.2 on an H200 (K = 7168, gate [64, K] fp32, wk [128, K] bf16): decode is bound by load latency (the
# previous head-gate kernel spent ~0.6 µs per K step), so decode tiles take long K steps and ~100 programs pull the
# 3.6 MB of weights. The best of the H200 sweep (``benchmarks/kernels.py --only xgemm``; BENCHMARKS.md, wk_gate_gemm);
# one row: the FMA tile of ``split_k_tile`` with the probe's best tiles (BENCHMARKS.md "wk and gate for one row").
CONFIGS = (
    WkGateConfig(1, block_m=1, gate_block_n=8, k_block_n=16, block_k=64, num_warps=8, num_stages=3),
    WkGateConfig(64, block_m=16, gate_block_n=32, k_block_n=64, block_k=128, num_stages=3),
    WkGateConfig(512, block_m=64, gate_block_n=16, k_block_n=32, block_k=128, num_stages=3),
    WkGateConfig(1 << 62, block_m=128, gate_block_n=64, k_block_n=64, num_warps=8, num_stages=3),
)


def config_for(rows: int) -> WkGateConfig:
    """The first bucket of ``CONFIGS`` holding ``rows``."""
    return next(c for c in CONFIGS if rows <= c.max_rows)


@triton.jit
def _wk_gate_gemm_kernel(x_ptr, gate_w_ptr, k_w_ptr, gate_out_ptr, k_out_ptr, m, gate_n, k_n, k, gate_chunk,
                         k_chunk, gate_programs, stride_xm, stride_xk, stride_gn, stride_gk, stride_kn, stride_kk,
                         GATE_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
                         GATE_BLOCK_N: tl.constexpr, K_BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Grid (row tiles, gate programs + k programs). Work item ``w`` of a product is column tile ``w % tiles`` of
    chunk ``w // tiles``: neighbouring programs read the same slice of x (from L2 after the first)."""
    wait_for_previous_grid(PDL)
    pid_m = tl.program_id(0)
    work = tl.program_id(1)
    if work < gate_programs:
        tiles = tl.cdiv(gate_n, GATE_BLOCK_N)
        split_k_tile(x_ptr, gate_w_ptr, gate_out_ptr, pid_m, work % tiles, work // tiles, m, gate_n, k, gate_chunk,
                     stride_xm, stride_xk, stride_gn, stride_gk, GATE_WEIGHT, BLOCK_M, GATE_BLOCK_N, BLOCK_K)
    else:
        work -= gate_programs
        tiles = tl.cdiv(k_n, K_BLOCK_N)
        split_k_tile(x_ptr, k_w_ptr, k_out_ptr, pid_m, work % tiles, work // tiles, m, k_n, k, k_chunk,
                     stride_xm, stride_xk, stride_kn, stride_kk, "bf16", BLOCK_M, K_BLOCK_N, BLOCK_K)


def wk_gate_gemm(x, gate_weight, k_weight, gate_splits, k_splits, round_weight, out=None,
                 config: WkGateConfig | None = None):
    """``(gate partials, k partials)`` as the reference computes them, every element written (empty chunks as
    zeros). Any strides (frozen weights arrive as transposed views). ``config``: default ``config_for(M)``."""
    rows, k = x.shape
    gate_n, k_n = gate_weight.shape[0], k_weight.shape[0]
    if out is None:
        out = (torch.empty(gate_splits, rows, gate_n, dtype=torch.float32, device=x.device),
               torch.empty(k_splits, rows, k_n, dtype=torch.float32, device=x.device))
    if rows == 0 or gate_n == 0 and k_n == 0:
        return out
    cfg = config or config_for(rows)
    gate_programs = triton.cdiv(gate_n, cfg.gate_block_n) * gate_splits
    k_programs = triton.cdiv(k_n, cfg.k_block_n) * k_splits
    grid = (triton.cdiv(rows, cfg.block_m), gate_programs + k_programs)
    launch(_wk_gate_gemm_kernel, grid, x, gate_weight, k_weight, *out, rows, gate_n, k_n, k,
           head_gate_chunk(k, gate_splits), head_gate_chunk(k, k_splits), gate_programs, *x.stride(),
           *gate_weight.stride(), *k_weight.stride(), GATE_WEIGHT=weight_mode(gate_weight, round_weight),
           BLOCK_M=cfg.block_m, GATE_BLOCK_N=cfg.gate_block_n, K_BLOCK_N=cfg.k_block_n, BLOCK_K=cfg.block_k,
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
