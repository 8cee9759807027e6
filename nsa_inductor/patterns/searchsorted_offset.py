"""Gives ``searchsorted`` a sorted sequence that starts at its own storage's first element.

Eager spelling (the prefill's token -> sequence map)::

    seq = torch.searchsorted(cu_seqlens[1:], token, right=True)

Inductor's Triton lowering of ``searchsorted`` in torch 2.11 reads the sorted sequence from its buffer's start and
ignores a view's storage offset: measured on the H200, ``cu_seqlens[1:]`` is searched as ``cu_seqlens``, every
token lands one sequence late (top-k offsets wrong in every prefill row), and the last sequence's tokens index past
``cu_seqlens`` (a device-side assert under default Inductor). The pass puts an ``aten.clone`` between the view and
``searchsorted``; Inductor lowers it to a small copy into a fresh buffer (offset 0), which the search then reads.
Exact on every torch version: the clone holds the same elements. A view whose offset is 0 is left alone.
"""

from __future__ import annotations

import torch
import torch.fx

from ..pass_manager import PassContext, PassResult
from .graph_utils import describe, insert_call, is_op, tensor_val

aten = torch.ops.aten


def _offset_is_zero(view: torch.Tensor) -> bool:
    offset = view.storage_offset()
    return isinstance(offset, int) and offset == 0


class SearchsortedOffset:
    name = "searchsorted_offset"

    def __call__(self, graph: torch.fx.Graph, ctx: PassContext | None = None) -> PassResult:
        result = PassResult()
        for node in list(graph.nodes):
            if not is_op(node, aten.searchsorted.Tensor, aten.searchsorted.Scalar):
                continue
            sorted_seq = node.args[0]
            fake = tensor_val(sorted_seq)
            if fake is None:
                result.miss(node, f"no fake value on the sorted sequence {describe(sorted_seq)}")
                continue
            if _offset_is_zero(fake):
                continue
            with graph.inserting_before(node):
                copy = insert_call(graph, aten.clone.default, (sorted_seq,))
            node.replace_input_with(sorted_seq, copy)
            result.matched += 1
        return result


PASS = SearchsortedOffset()
