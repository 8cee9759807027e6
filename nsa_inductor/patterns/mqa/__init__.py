"""The MQA-logits rewrites: plain-torch masked ``Σ_h w * relu(q·k) * k_scale`` logits, proven by probing
(``probe.py``, ``proofs.py``), become ``nsa.paged_mqa_logits`` (decode, ``paged.py``) or ``nsa.mqa_logits``
(prefill, ``ragged.py``). Both passes share one analysis per candidate; a near miss whose family cannot be told is
reported by both."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.fx

from ..base import GraphPass, NearMiss, PassContext
from .proofs import Match, analyze, cache_values, candidates


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
        layout = ctx.decision.layout
        m = analyze(sum_node, where, layout, leaves)
        if m.family != self.family:
            raise NearMiss(f"{m.family} MQA logits", m.family)  # the other pass's match
        self.rewrite_match(graph, m, layout)

    def rewrite_match(self, graph: torch.fx.Graph, m: Match, layout) -> None:
        raise NotImplementedError
