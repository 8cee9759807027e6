"""K rounded to bf16 just for the store -> the store rounds it as it loads it.

Eager idiom (``Indexer.store_k``: LayerNorm in fp32, then the K cache's bf16 rows)::

    k = self.k_norm(self.wk(x).float()).to(torch.bfloat16)   # an fp32 tensor rounded for the rows below
    ... RoPE, rotation, act_quant, cache write                 # nsa.quant_cache_store(k=k, ...) after the passes above

Matches the ``k`` of an ``nsa.quant_cache_store`` that is ``convert_element_type(y, bf16)`` of an fp32 ``y`` of the
same shape, read by nothing else. Rewrites to the store reading ``y`` with ``round_k=True``: the kernel rounds each
value to bf16 (nearest even, as the cast) before its prologues, and Inductor's cast kernel goes.
Never: another dtype, a cast that something else reads too.
"""

from __future__ import annotations

import torch
import torch.fx

from .base import GraphPass, NearMiss, PassContext
from .fx_utils import describe, is_op, is_store, live_users, prims, same_shape, val


class StoreInputRounding(GraphPass):
    name = "store_input_rounding"

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext):
        for node in list(graph.nodes):
            if is_store(node) and not node.kwargs.get("round_k", False):
                yield node

    def rewrite(self, graph: torch.fx.Graph, anchor: torch.fx.Node, ctx: PassContext) -> torch.fx.Node:
        k = anchor.kwargs["k"]
        if not is_op(k, prims.convert_element_type.default) or val(k).dtype != torch.bfloat16:
            raise NearMiss(f"the stored k {describe(k)} is not a bf16 cast")
        y = k.args[0]
        if val(y).dtype != torch.float32 or not same_shape(y, k):
            raise NearMiss(f"the stored k is cast from {val(y).dtype}, not from float32 of its shape")
        readers = live_users(k)
        if readers != [anchor]:
            raise NearMiss(f"the bf16 k is also read by {describe([u for u in readers if u is not anchor][0])}")
        anchor.kwargs = {**anchor.kwargs, "k": y, "round_k": True}
        return anchor

    def finish(self, graph: torch.fx.Graph, rewritten: list[torch.fx.Node]) -> None:
        graph.eliminate_dead_code()
