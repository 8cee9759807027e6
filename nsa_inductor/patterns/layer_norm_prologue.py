"""The LayerNorm of the K rows the store reads -> the store normalises them as it loads them.

Eager idiom (``Indexer.store_k``: the key projection normalised in fp32, then rounded for the cache)::

    k = self.k_norm(self.wk(x).float()).to(torch.bfloat16)   # nn.LayerNorm(128), weight and bias, fp32
    ... RoPE, rotation, act_quant, cache write                 # nsa.quant_cache_store(k=LN out, round_k=True, ...)

Matches the ``k`` of an ``nsa.quant_cache_store`` with ``round_k`` (``store_input_rounding`` ran) that is output 0 of
``aten.native_layer_norm(y, [128], weight, bias, eps)`` (left undecomposed by ``nsa.eager_layer_norm``) of an fp32
``y`` with fp32 weight and bias, whose outputs nothing else reads. Rewrites to the store reading ``y`` with
``ln_weight``, ``ln_bias`` and ``ln_eps``: the kernel normalises each row in the order of ATen's CUDA kernel, and
ATen's LayerNorm launch goes.
Never: another normalised shape, a LayerNorm without weight or bias, its mean or rstd read elsewhere.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..layout import HEAD_DIM
from .base import GraphPass, NearMiss, PassContext
from .fx_utils import aten, arg, describe, is_op, is_store, live_users, val


class LayerNormPrologue(GraphPass):
    name = "layer_norm_prologue"

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext):
        for node in list(graph.nodes):
            if is_store(node) and node.kwargs.get("round_k", False) and node.kwargs.get("ln_weight") is None:
                yield node

    def rewrite(self, graph: torch.fx.Graph, anchor: torch.fx.Node, ctx: PassContext) -> torch.fx.Node:
        k = anchor.kwargs["k"]
        if not (is_op(k, operator.getitem) and k.args[1] == 0 and is_op(k.args[0], aten.native_layer_norm.default)):
            raise NearMiss(f"the stored k {describe(k)} is not a LayerNorm's output")
        norm = k.args[0]
        y, shape, weight, bias, eps = (arg(norm, i, n) for i, n in enumerate(
            ("input", "normalized_shape", "weight", "bias", "eps")))
        if list(shape) != [HEAD_DIM]:
            raise NearMiss(f"the LayerNorm normalises {list(shape)}, not [{HEAD_DIM}]")
        if weight is None or bias is None:
            raise NearMiss("the LayerNorm has no weight or no bias")
        if any(val(t).dtype != torch.float32 for t in (y, weight, bias)):
            raise NearMiss("the LayerNorm's input, weight and bias are not all float32")
        readers = [u for u in live_users(norm) if u is not k] + [u for u in live_users(k) if u is not anchor]
        if readers:
            raise NearMiss(f"the LayerNorm's outputs are also read by {describe(readers[0])}")
        anchor.kwargs = {**anchor.kwargs, "k": y, "ln_weight": weight, "ln_bias": bias, "ln_eps": float(eps)}
        return anchor

    def finish(self, graph: torch.fx.Graph, rewritten: list[torch.fx.Node]) -> None:
        graph.eliminate_dead_code()
