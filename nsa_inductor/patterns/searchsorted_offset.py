"""Gives ``searchsorted`` a sorted sequence that starts at its own storage's first element (a torch 2.11 fix).

Matches ``torch.searchsorted(seq, x)`` where ``seq`` is a view at a nonzero storage offset (see ``search`` below).
Rewrites to ``torch.searchsorted(seq.clone(), x)``: exact on every torch version (the clone holds the same elements).
Never: a sorted sequence at offset 0 (left alone).
Why: torch 2.11's Triton lowering of ``searchsorted`` reads the sequence from its buffer's start, ignoring the
view's offset: ``cu_seqlens[1:]`` was searched as ``cu_seqlens`` (every prefill token one sequence late).
"""

from __future__ import annotations

import torch
import torch.fx

from .base import GraphPass, NearMiss, PassContext
from .fx_utils import describe, insert_call, is_op, tensor_val

aten = torch.ops.aten


def search(cu_seqlens: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """The eager idiom (the prefill's token -> sequence map)."""
    return torch.searchsorted(cu_seqlens[1:], token, right=True)


def replacement(cu_seqlens: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    return torch.searchsorted(cu_seqlens[1:].clone(), token, right=True)


def _at_offset_zero(sorted_seq: torch.fx.Node) -> bool:
    fake = tensor_val(sorted_seq)
    offset = fake.storage_offset() if fake is not None else None
    return isinstance(offset, int) and offset == 0


class SearchsortedOffset(GraphPass):
    name = "searchsorted_offset"

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext | None):
        return [n for n in graph.nodes if is_op(n, aten.searchsorted.Tensor, aten.searchsorted.Scalar)
                and not _at_offset_zero(n.args[0])]

    def rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node, ctx: PassContext | None) -> None:
        sorted_seq = node.args[0]
        if tensor_val(sorted_seq) is None:
            raise NearMiss(f"no fake value on the sorted sequence {describe(sorted_seq)}")
        with graph.inserting_before(node):
            copy = insert_call(graph, aten.clone.default, (sorted_seq,))
        node.replace_input_with(sorted_seq, copy)
