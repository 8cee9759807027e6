"""``nsa.checks``: device-side asserts on the index arguments of every ``nsa`` op in the graph (docs/indices.md).

By default an out-of-range id is masked (a slot past the cache writes nothing, an unreadable page reads as -inf /
zero): memory-safe, but silent where eager raises. With ``options={"nsa.checks": True}`` this pass, run after the
rewrites, adds before each op::

    torch._assert_async((slot_mapping < num_slots).all(), "nsa.checks: slot_mapping ...")          # quant_cache_store
    torch._assert_async(((-P <= bt) & (bt < P) | beyond_context).all(), "nsa.checks: block_table ...")  # logits, gather
    torch._assert_async((cu[0] == 0) & (cu[1:] >= cu[:-1]).all(), "nsa.checks: cu_seqlens ...")     # gather_k

Each is a small reduction over an index tensor and an assert that raises on the device (a CUDA device-side assert,
a ``RuntimeError`` on the CPU) without a host synchronisation, naming the argument. It changes no result.
"""

from __future__ import annotations

import torch
import torch.fx

from .base import GraphPass, PassContext
from .fx_utils import aten, arg, insert_call, is_op, prims, val

_STORE = torch.ops.nsa.quant_cache_store.default
# The store as the rewrite inserts it (v1) and as AOTAutograd functionalizes a call the user wrote (v2).
_FUNCTIONALIZED = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)


class IndexChecks(GraphPass):
    name = "index_checks"

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext):
        for node in list(graph.nodes):
            if is_op(node, *_FUNCTIONALIZED) and node.args[0] is _STORE:
                yield node
            elif is_op(node, torch.ops.nsa.paged_mqa_logits.default, torch.ops.nsa.gather_k.default):
                yield node

    def rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node, ctx: PassContext) -> torch.fx.Node:
        with graph.inserting_before(node):
            if is_op(node, *_FUNCTIONALIZED):
                _check_slots(graph, node.kwargs["slot_mapping"], _cache_pages(node), node.kwargs["page_size"])
            elif is_op(node, torch.ops.nsa.paged_mqa_logits.default):
                cache, lens, table = arg(node, 1, "cache"), arg(node, 3, "context_lens"), arg(node, 4, "block_table")
                _check_pages(graph, table, lens, cache, arg(node, 6, "page_size"), "context_lens")
            else:
                cache, table, cu = arg(node, 0, "cache"), arg(node, 1, "block_table"), arg(node, 2, "cu_seqlens")
                _check_cu_seqlens(graph, cu)
                ends = insert_call(graph, aten.slice.Tensor, (cu, 0, 1))
                starts = insert_call(graph, aten.slice.Tensor, (cu, 0, 0, -1))
                lens = insert_call(graph, aten.sub.Tensor, (ends, starts))
                _check_pages(graph, table, lens, cache, arg(node, 3, "page_size"), "cu_seqlens")
        return node


def _assert(graph: torch.fx.Graph, bad: torch.fx.Node, message: str) -> None:
    """Assert no element of ``bad`` is set (``not any``: Inductor lowers ``any``, not ``all``)."""
    none = insert_call(graph, aten.logical_not.default, (insert_call(graph, aten.any.default, (bad,)),))
    insert_call(graph, aten._assert_async.msg, (none, f"nsa.checks: {message}"))


def _cache_pages(store: torch.fx.Node):
    """Pages of the cache a functionalized store writes (v2 names a base tensor and, for a view of it, its size)."""
    kwargs = store.kwargs
    if "cache" in kwargs:
        return val(kwargs["cache"]).shape[0]
    if "_cache_size" in kwargs:
        return kwargs["_cache_size"][0]
    return val(kwargs["_all_bases"][kwargs["_cache_base_index"]]).shape[0]


def _check_slots(graph: torch.fx.Graph, slots: torch.fx.Node, num_pages, page_size: int) -> None:
    num_slots = num_pages * page_size
    _assert(graph, insert_call(graph, aten.ge.Scalar, (slots, num_slots)),
            f"slot_mapping holds a slot >= {num_slots}, past the K cache ({num_pages} pages of {page_size}); "
            f"negative slots are padding")


def _check_pages(graph: torch.fx.Graph, table: torch.fx.Node, lens: torch.fx.Node, cache: torch.fx.Node,
                 page_size: int, lens_name: str) -> None:
    """Every page a sequence's tokens sit on is readable (``[-num_pages, num_pages)``), and within the table."""
    num_pages = val(cache).shape[0]
    below = insert_call(graph, aten.lt.Scalar, (table, -num_pages))
    above = insert_call(graph, aten.ge.Scalar, (table, num_pages))
    unreadable = insert_call(graph, aten.logical_or.default, (below, above))
    pages = insert_call(graph, aten.div.Tensor_mode, (insert_call(graph, aten.add.Tensor, (lens, page_size - 1)),
                                                      page_size), {"rounding_mode": "floor"})
    max_pages = val(table).shape[1]
    width = max_pages if isinstance(max_pages, int) else insert_call(graph, aten.sym_size.int, (table, 1))
    column = insert_call(graph, prims.iota.default, (width,),
                         dict(start=0, step=1, dtype=torch.int64, device=val(table).device, requires_grad=False),
                         table)
    used = insert_call(graph, aten.lt.Tensor, (insert_call(graph, aten.unsqueeze.default, (column, 0)),
                                               insert_call(graph, aten.unsqueeze.default, (pages, 1))))
    _assert(graph, insert_call(graph, aten.logical_and.default, (unreadable, used)),
            f"block_table holds a page id outside [-{num_pages}, {num_pages}) (the K cache's pages) where a "
            f"sequence's tokens are ({lens_name})")
    _assert(graph, insert_call(graph, aten.gt.Scalar, (pages, width)),
            f"{lens_name} gives a sequence more tokens than its block_table row holds ({max_pages} pages of "
            f"{page_size})")


def _check_cu_seqlens(graph: torch.fx.Graph, cu: torch.fx.Node) -> None:
    first = insert_call(graph, aten.slice.Tensor, (cu, 0, 0, 1))
    _assert(graph, insert_call(graph, aten.ne.Scalar, (first, 0)), "cu_seqlens[0] is not 0")
    ends = insert_call(graph, aten.slice.Tensor, (cu, 0, 1))
    starts = insert_call(graph, aten.slice.Tensor, (cu, 0, 0, -1))
    _assert(graph, insert_call(graph, aten.lt.Tensor, (ends, starts)), "cu_seqlens decreases")
