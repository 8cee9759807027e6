"""``nsa.checks``: device-side asserts on the index arguments of every ``nsa`` op in the graph (docs/indices.md).

By default an out-of-range id is masked (a slot past the cache writes nothing, an unreadable page reads as -inf /
zero): memory-safe, but silent where eager raises. With ``options={"nsa.checks": True}`` this pass, run after the
rewrites, adds before each op::

    torch._assert_async((slot_mapping < num_slots).all(), "nsa.checks: slot_mapping ...")          # quant_cache_store
    torch._assert_async(((-P <= bt) & (bt < P) | beyond_context).all(), "nsa.checks: block_table ...")  # logits, gather
    torch._assert_async((cu[0] == 0) & (cu[1:] >= cu[:-1]).all(), "nsa.checks: cu_seqlens ...")     # gather_k
    torch._assert_async(~((slots < -S) | (slots >= S)).any(), "nsa.checks: positions ...")        # gather_k_slots

Each is a small reduction over an index tensor and an assert that raises on the device (a CUDA device-side assert,
a ``RuntimeError`` on the CPU) without a host synchronisation, naming the argument. It changes no result.
"""

from __future__ import annotations

import torch
import torch.fx

from ..index_contract import check_cu_seqlens, check_gather_ids, check_pages, check_slots
from .base import GraphPass, PassContext
from .fx_utils import aten, arg, insert_call, is_op, val

_STORE = torch.ops.nsa.quant_cache_store.default
# The store as the rewrite inserts it (v1) and as AOTAutograd functionalizes a call the user wrote (v2).
_FUNCTIONALIZED = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)


class IndexChecks(GraphPass):
    name = "index_checks"

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext):
        for node in list(graph.nodes):
            if is_op(node, *_FUNCTIONALIZED) and node.args[0] is _STORE:
                yield node
            elif is_op(node, torch.ops.nsa.paged_mqa_logits.default, torch.ops.nsa.gather_k.default,
                       torch.ops.nsa.gather_k_slots.default):
                yield node

    def rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node, ctx: PassContext) -> torch.fx.Node:
        def call(op, args, kwargs=None):
            return insert_call(graph, op, args, kwargs, like=node)

        with graph.inserting_before(node):
            if is_op(node, *_FUNCTIONALIZED):
                check_slots(call, node.kwargs["slot_mapping"], _cache_pages(node), node.kwargs["page_size"])
                return node
            if is_op(node, torch.ops.nsa.gather_k_slots.default):
                cache, table = arg(node, 0, "cache"), arg(node, 5, "block_table")
                sizes = () if table is None else [_size(call, table, dim) for dim in (0, 1)]
                check_gather_ids(call, arg(node, 1, "positions"), val(cache).shape[0], arg(node, 2, "page_size"),
                                 table, arg(node, 6, "seq_ids"), *sizes)
                return node
            if is_op(node, torch.ops.nsa.paged_mqa_logits.default):
                cache, lens, table = arg(node, 1, "cache"), arg(node, 3, "context_lens"), arg(node, 4, "block_table")
                page_size, lens_name = arg(node, 6, "page_size"), "context_lens"
            else:
                cache, table, cu = arg(node, 0, "cache"), arg(node, 1, "block_table"), arg(node, 2, "cu_seqlens")
                page_size, lens_name = arg(node, 3, "page_size"), "cu_seqlens"
                lens = check_cu_seqlens(call, cu)
            check_pages(call, table, lens, val(cache).shape[0], _size(call, table, 1), page_size, lens_name,
                        val(table).device)
        return node


def _size(call, tensor: torch.fx.Node, dim: int):
    """Size ``dim`` of ``tensor``: an int, or a ``sym_size`` node where it is symbolic."""
    size = val(tensor).shape[dim]
    return size if isinstance(size, int) else call(aten.sym_size.int, (tensor, dim))


def _cache_pages(store: torch.fx.Node):
    """Pages of the cache a functionalized store writes: v2 names a base tensor and, for a view of it, either the
    view's size (an ``as_strided`` view) or the rows of the base it slices (``cache[a:b]``)."""
    kwargs = store.kwargs
    if "cache" in kwargs:
        return val(kwargs["cache"]).shape[0]
    if "_cache_size" in kwargs:
        return kwargs["_cache_size"][0]
    if kwargs.get("_cache_slice_dim") == 0:
        return kwargs["_cache_slice_end"] - kwargs["_cache_slice_start"]
    return val(kwargs["_all_bases"][kwargs["_cache_base_index"]]).shape[0]
