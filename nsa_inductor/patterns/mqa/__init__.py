"""The MQA-logits rewrites: plain-torch masked ``Σ_h w * relu(q·k) * k_scale`` logits, proven by probing
(``probe.py``, ``proofs.py``), become ``nsa.paged_mqa_logits`` (decode, ``paged.py``) or ``nsa.mqa_logits``
(prefill, ``ragged.py``). Both passes share one analysis per candidate; a near miss whose family cannot be told is
reported by both. The layout is the guard's format with the K cache's own page size (:func:`graph_cache_layout`).
A third pass, ``slot_gather.py``, puts the prefill op's K, where the model gathered it from the cache through maps
given as inputs, on ``nsa.gather_k_slots``."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch.fx

from ...capability import LayoutDecision, cache_layout
from ...layout import KCacheLayout
from ..base import GraphPass, NearMiss, PassContext
from ..fx_utils import fixed_shape, insert_call, reshape, tensor_val
from .proofs import Match, analyze, cache_values, candidates, summed_partials, weight_leaves


def graph_cache_layout(leaves: set[torch.fx.Node], decision: LayoutDecision) -> KCacheLayout:
    """The guard's format with the page size of the graph's K cache (its uint8 input, when one row size is shared by
    all of them; a symbolic shape is fixed to this compile's, with a guard); a contradicting cache shape is a near
    miss."""
    shapes = [fixed_shape(n) for n in leaves if n.op == "placeholder"]
    rows = {shape[1] if len(shape) == 2 else None for shape in shapes}
    if len(rows) != 1:
        return decision.layout
    try:
        return cache_layout(decision, shapes[0])
    except ValueError as e:
        raise NearMiss(str(e)) from None


class MqaLogitsPass(GraphPass):
    """candidates -> :func:`analyze` -> ``rewrite_match`` for the matches of this pass's ``family``."""

    family: str = ""

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext) -> Iterator[tuple]:
        leaves = cache_values(graph)
        for sum_node, where in candidates(graph):
            yield sum_node, where, leaves

    def anchor(self, candidate: tuple) -> torch.fx.Node:
        sum_node, where, _ = candidate
        return where if where is not None else sum_node

    def reported(self, candidate: Any, miss: NearMiss) -> bool:
        return miss.family in (None, self.family)

    def rewrite(self, graph: torch.fx.Graph, candidate: tuple, ctx: PassContext) -> None:
        sum_node, where, leaves = candidate
        layout = graph_cache_layout(leaves, ctx.decision)
        m = analyze(sum_node, where, layout, leaves)
        if m.family != self.family:
            raise NearMiss(f"{m.family} MQA logits", m.family)  # the other pass's match
        self.rewrite_match(graph, m, layout)

    def rewrite_match(self, graph: torch.fx.Graph, m: Match, layout) -> None:
        raise NotImplementedError

    @staticmethod
    def head_weights(graph: torch.fx.Graph, m: Match) -> torch.fx.Node:
        """The op's ``[rows, H]`` weights: the product of the proven weight factors and of the number factors."""
        weights = reshape(graph, m.weights[0], [-1, m.heads])
        for factor in m.weights[1:]:
            weights = insert_call(graph, torch.ops.aten.mul.Tensor, (weights, reshape(graph, factor, [-1, m.heads])))
        if m.weight_scale == 1.0:
            return weights
        return insert_call(graph, torch.ops.aten.mul.Tensor, (weights, m.weight_scale))

    @staticmethod
    def head_weight_factors(graph: torch.fx.Graph, m: Match) -> tuple[torch.fx.Node, torch.fx.Node | None, float]:
        """``(weights, second factor or None, number)`` whose product is the weights, for an op that computes them
        itself (no kernel of their own): each proven factor split into the leaves of its own mul tree
        (:func:`weight_leaves`); one leaf that is a sum of split-K partials (the head gate's) goes first, as the
        partials ``[S, rows, H]``; a third tensor factor and more are multiplied here."""
        leaves, scale = [], m.weight_scale
        for factor in m.weights:
            tensors, numbers = weight_leaves(factor)
            leaves += tensors
            scale *= math.prod(numbers, start=1.0)
        sums = [summed_partials(leaf) for leaf in leaves]
        if any(p is not None for p in sums):
            i = next(i for i, p in enumerate(sums) if p is not None)
            first = reshape(graph, sums[i], [tensor_val(sums[i]).shape[0], -1, m.heads])
            rest = [reshape(graph, leaf, [-1, m.heads]) for leaf in leaves[:i] + leaves[i + 1:]]
        else:
            first, *rest = [reshape(graph, leaf, [-1, m.heads]) for leaf in leaves]
        for extra in rest[1:]:
            rest[0] = insert_call(graph, torch.ops.aten.mul.Tensor, (rest[0], extra))
        return first, rest[0] if rest else None, scale
