"""``nsa.head_gate_gemm``: split-K partials of the indexer's head-gate GEMM ``x [M, K] bf16 @ weight [N, K]^T``.

An fp32 weight enters as two bf16 halves (``hi + lo``, ~16 bits of W) split in registers, or rounded to bf16, so
the fp32 weight is read once and no bf16 copy is written. The caller sums the partials (in the order it chooses).
aiter has no kernel for it: Triton on GPUs, the reference elsewhere.
"""

from __future__ import annotations

import torch

from .._common import check, check_devices, describe, nsa_op, once_per_signature, triton_or_reference


@once_per_signature
def _validate(x, weight, splits, round_weight) -> None:
    check("x", x, (None, None), (torch.bfloat16,), "[M, K]")
    k = x.shape[1]
    check("weight", weight, (None, k), (torch.float32, torch.bfloat16), f"[N, K={k}]")
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    if round_weight and weight.dtype != torch.float32:
        raise ValueError(f"round_weight needs a float32 weight (a bfloat16 one is used as is), got {describe(weight)}")
    check_devices(x=x, weight=weight)


@nsa_op("head_gate_gemm")
def head_gate_gemm(x: torch.Tensor, weight: torch.Tensor, splits: int, round_weight: bool) -> torch.Tensor:
    """Split-K partial products ``[splits, M, N]`` fp32 of ``x [M, K] bf16 @ weight [N, K]^T``; their sum over dim 0
    is the GEMM. An fp32 weight enters as ``hi + lo`` (two bf16 halves, ~16 bits of W) or, with ``round_weight``, as
    ``bf16(W)``; the chunking and numerics are ``reference.head_gate_gemm``'s."""
    _validate(x, weight, splits, round_weight)
    return triton_or_reference("head_gate_gemm", x.device)(x, weight, splits, round_weight)


@head_gate_gemm.register_fake
def _(x, weight, splits, round_weight):
    _validate(x, weight, splits, round_weight)
    return x.new_empty((splits, x.shape[0], weight.shape[0]), dtype=torch.float32)
