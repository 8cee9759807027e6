"""fp32 head-gate GEMM with casts -> one bf16-input GEMM with fp32 output."""

from __future__ import annotations

import torch.fx

from ..pass_manager import PassContext, PassResult


class HeadGateGemm:
    name = "head_gate_gemm"

    def __call__(self, graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
        return PassResult()


PASS = HeadGateGemm()
