"""``nsa.wk_gate_gemm``: the indexer's two projections of the hidden state ``x [M, K] bf16`` in one launch, as
split-K partials: the head gate ``x @ gate_weight^T`` (fp32 weight as bf16 hi + lo, or rounded, or a bf16 weight)
and the K projection ``x @ k_weight^T`` (bf16 weight). The caller sums each set of partials (pointwise adds that
Inductor fuses into the consumers) and rounds the K sum to bf16 as the bf16 GEMM it replaces does.

The split counts are the caller's (the pass bakes them into the graph: ``SPLITS`` in patterns/wk_gate_gemm.py), the
tiles the launcher's (``CONFIGS`` in triton.py); ``benchmarks/kernels.py --only xgemm`` sweeps both. aiter has no
kernel for it: Triton on GPUs, the reference elsewhere.
"""

from __future__ import annotations

import torch

from .._common import check, check_devices, describe, nsa_op, once_per_signature, triton_or_reference
from .._streams import check_stream, on_stream


@once_per_signature
def _validate(x, gate_weight, k_weight, gate_splits, k_splits, round_weight, stream) -> None:
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
    check_stream(stream)


@nsa_op("wk_gate_gemm")
def wk_gate_gemm(x: torch.Tensor, gate_weight: torch.Tensor, k_weight: torch.Tensor, gate_splits: int,
                 k_splits: int, round_weight: bool, stream: str = "current") -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate partials [gate_splits, M, Ng], k partials [k_splits, M, Nk])`` fp32: each is
    ``nsa.head_gate_gemm``'s split-K partials of its product (same chunks, same weight handling). ``stream``: where
    it runs on CUDA (``"fork"``, ``"side"``: the device's second stream, lowering/_streams.py; a reader on the
    current stream must join it first)."""
    _validate(x, gate_weight, k_weight, gate_splits, k_splits, round_weight, stream)
    return on_stream(stream, triton_or_reference("wk_gate_gemm", x.device), x, gate_weight, k_weight, gate_splits,
                     k_splits, round_weight)


@wk_gate_gemm.register_fake
def _(x, gate_weight, k_weight, gate_splits, k_splits, round_weight, stream="current"):
    _validate(x, gate_weight, k_weight, gate_splits, k_splits, round_weight, stream)
    rows = x.shape[0]
    return (x.new_empty((gate_splits, rows, gate_weight.shape[0]), dtype=torch.float32),
            x.new_empty((k_splits, rows, k_weight.shape[0]), dtype=torch.float32))
