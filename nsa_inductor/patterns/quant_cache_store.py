"""act_quant followed by the K-cache store -> nsa.quant_cache_store."""

from __future__ import annotations

import torch.fx

from ..pass_manager import PassContext, PassResult


class QuantCacheStore:
    name = "quant_cache_store"

    def __call__(self, graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
        return PassResult()


PASS = QuantCacheStore()
