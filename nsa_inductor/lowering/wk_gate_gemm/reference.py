"""Torch reference of ``nsa.wk_gate_gemm``: the two products as ``nsa.head_gate_gemm``'s reference computes each
(any device, static shapes). Inputs are assumed validated."""

from __future__ import annotations

import torch

from ..head_gate_gemm.reference import head_gate_gemm


def wk_gate_gemm(x: torch.Tensor, gate_weight: torch.Tensor, k_weight: torch.Tensor, gate_splits: int,
                 k_splits: int, round_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return head_gate_gemm(x, gate_weight, gate_splits, round_weight), head_gate_gemm(x, k_weight, k_splits, False)
