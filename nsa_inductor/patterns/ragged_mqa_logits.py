"""plain-torch ragged causal (prefill) MQA logits -> nsa.mqa_logits."""

from __future__ import annotations

import torch.fx

from ..pass_manager import PassContext, PassResult


class RaggedMqaLogits:
    name = "ragged_mqa_logits"

    def __call__(self, graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
        return PassResult()


PASS = RaggedMqaLogits()
