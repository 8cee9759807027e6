"""``nsa.wk_gate_gemm``: the indexer's two projections of the hidden state ``x [M, K] bf16`` in one launch, as
split-K partials: the head gate ``x @ gate_weight^T`` (fp32 weight as bf16 hi + lo, or rounded, or a bf16 weight)
and the K projection ``x @ k_weight^T`` (bf16 weight). The caller sums each set of partials (pointwise adds that
Inductor fuses into the consumers) and rounds the K sum to bf16 as the bf16 GEMM it replaces does.

``TILINGS`` is the one table to tune (``benchmarks/kernels.py --only xgemm`` sweeps it): per row bucket, the split
counts the pass bakes into the graph and the tiles the launcher uses. aiter has no kernel for it: Triton on GPUs,
the reference elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._common import check, check_devices, describe, triton_or_reference


@dataclass(frozen=True)
class WkGateTiling:
    """How ``nsa.wk_gate_gemm`` cuts the work for up to ``max_rows`` rows of x.

    ``gate_splits`` / ``k_splits``: K chunks of each product (chosen by the pass at compile time: each partial is one
    more read in the kernel that consumes the sum, and the gate's consumer also computes the q scales).
    ``block_m`` x ``gate_block_n`` / ``k_block_n``: the output tile of one program; ``block_k``: columns of K per
    loop step. Each program computes one tile of one chunk of one product; x is read from HBM once and from L2 by
    each column tile.
    """

    max_rows: int
    gate_splits: int
    k_splits: int
    block_m: int
    gate_block_n: int
    k_block_n: int
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4


# DeepSeek-V3.2 on an H200 (K = 7168, gate [64, K] fp32, wk [128, K] bf16): decode needs ~100 programs to pull the
# 3.6 MB of weights at speed. Starting points for the GPU sweep, not measured optima.
TILINGS = (
    WkGateTiling(16, gate_splits=8, k_splits=16, block_m=16, gate_block_n=16, k_block_n=32),
    WkGateTiling(64, gate_splits=8, k_splits=16, block_m=64, gate_block_n=16, k_block_n=32, num_stages=3),
    WkGateTiling(512, gate_splits=4, k_splits=8, block_m=64, gate_block_n=32, k_block_n=64, num_stages=3),
    WkGateTiling(1 << 62, gate_splits=2, k_splits=2, block_m=128, gate_block_n=64, k_block_n=64, num_warps=8,
                 num_stages=3),
)


def tiling_for(rows: int | None) -> WkGateTiling:
    """The first bucket holding ``rows``; ``None`` (a symbolic token count, e.g. dynamic prefill) takes the last."""
    if rows is not None:
        for tiling in TILINGS:
            if rows <= tiling.max_rows:
                return tiling
    return TILINGS[-1]


def _validate(x, gate_weight, k_weight, gate_splits, k_splits, round_weight) -> None:
    check("x", x, (None, None), (torch.bfloat16,), "[M, K]")
    k = x.shape[1]
    check("gate_weight", gate_weight, (None, k), (torch.float32, torch.bfloat16), f"[N, K={k}]")
    check("k_weight", k_weight, (None, k), (torch.bfloat16,), f"[N, K={k}]")
    for name, splits in (("gate_splits", gate_splits), ("k_splits", k_splits)):
        if splits < 1:
            raise ValueError(f"{name} must be >= 1, got {splits}")
    if round_weight and gate_weight.dtype != torch.float32:
        raise ValueError(f"round_weight needs a float32 gate_weight (a bfloat16 one is used as is), got "
                         f"{describe(gate_weight)}")
    check_devices(x=x, gate_weight=gate_weight, k_weight=k_weight)


@torch.library.custom_op("nsa::wk_gate_gemm", mutates_args=())
def wk_gate_gemm(x: torch.Tensor, gate_weight: torch.Tensor, k_weight: torch.Tensor, gate_splits: int,
                 k_splits: int, round_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate partials [gate_splits, M, Ng], k partials [k_splits, M, Nk])`` fp32: each is
    ``nsa.head_gate_gemm``'s split-K partials of its product (same chunks, same weight handling)."""
    _validate(x, gate_weight, k_weight, gate_splits, k_splits, round_weight)
    return triton_or_reference("wk_gate_gemm", x.device)(x, gate_weight, k_weight, gate_splits, k_splits,
                                                         round_weight)


@wk_gate_gemm.register_fake
def _(x, gate_weight, k_weight, gate_splits, k_splits, round_weight):
    _validate(x, gate_weight, k_weight, gate_splits, k_splits, round_weight)
    rows = x.shape[0]
    return (x.new_empty((gate_splits, rows, gate_weight.shape[0]), dtype=torch.float32),
            x.new_empty((k_splits, rows, k_weight.shape[0]), dtype=torch.float32))
