"""plain-torch paged (decode) MQA logits -> nsa.paged_mqa_logits."""

from __future__ import annotations

import torch.fx

from ..pass_manager import PassContext, PassResult


class PagedMqaLogits:
    name = "paged_mqa_logits"

    def __call__(self, graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
        return PassResult()


PASS = PagedMqaLogits()
