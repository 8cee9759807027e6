"""full(-inf) logits buffers that are overwritten everywhere -> no fill."""

from __future__ import annotations

import torch.fx

from ..pass_manager import PassContext, PassResult


class EmptyLogitsBuffer:
    name = "empty_logits_buffer"

    def __call__(self, graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
        return PassResult()


PASS = EmptyLogitsBuffer()
