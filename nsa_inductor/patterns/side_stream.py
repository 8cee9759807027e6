"""The K side of a decode step on a second CUDA stream, overlapping the q side.

Graph shape (after ``wk_gate_gemm``, ``split_k_prologue`` and ``paged_mqa_logits``; the eager step it comes from is
``Indexer.decode``: ``store_k(x, ...)``, then ``project_q(q_lora, ...)``, then the logits)::

    gate_p, k_p = nsa.wk_gate_gemm(x, gate_w, wk_w, ...)          # K side: reads x and weights
    nsa.quant_cache_store(k=k_p, cache=cache, ..., k_split_sum=True)  # K side: writes the cache
    q8, q_scale = nsa.rotate_act_quant(q_lora @ wq_b^T, ...)       # q side: reads neither
    logits = nsa.paged_mqa_logits(q8, cache, gate_p, ...)          # reads both sides

Matches an ``nsa.wk_gate_gemm`` whose gate partials only ``nsa.paged_mqa_logits`` reads and whose k partials only
``nsa.quant_cache_store`` reads, that logits op reading the cache the store writes, and nothing else in the graph
reading that cache or writing anything the two K-side ops read. Rewrites to the same ops with ``stream="fork"`` on
the GEMM, ``stream="side"`` on the store (``"fork"`` where it reads a value some kernel makes) and
``join_side_stream=True`` on the logits op (lowering/_streams.py): the K side's launches run beside the q side's;
the logits op waits for them. Values and bytes are unchanged.
Never: a K-side output read by an op that does not join (an Inductor kernel summing the partials, a second reader),
the cache read or written elsewhere, an input of the K side written in the graph (it could change under the side
stream's read).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .base import GraphPass, NearMiss, PassContext
from .fx_utils import VIEW_OPS, aten, describe, is_op, is_store, live_users, set_arg, tensor_val, view_chain

_VIEWS = (*VIEW_OPS, aten.select.int, aten.slice.Tensor, aten.permute.default, aten.expand.default,
          aten.as_strided.default)
_FUNCTIONALIZED = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)


def _stored_cache(node: torch.fx.Node) -> torch.fx.Node | None:
    """The cache an ``nsa.quant_cache_store`` writes: as a pass inserted it (``auto_functionalized``), or as a user's
    own call of the op came through Dynamo (``auto_functionalized_v2``: the cache among its bases); else None."""
    if is_store(node):
        return node.kwargs["cache"]
    if (node.op == "call_function" and node.target is torch.ops.higher_order.auto_functionalized_v2
            and node.args[0] is torch.ops.nsa.quant_cache_store.default):
        return node.kwargs["_all_bases"][node.kwargs["_cache_base_index"]]
    return None


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The ops that read ``node``'s elements, through views of it (reshapes of a contiguous value: no kernel)."""
    readers = []
    for user in live_users(node):
        if is_op(user, *VIEW_OPS) and user.args[0] is node and tensor_val(node).is_contiguous():
            readers += _readers(user)
        else:
            readers.append(user)
    return readers


def _is_epilogue_copy(node: torch.fx.Node, cache: torch.fx.Node, stored: list[torch.fx.Node]) -> bool:
    """``copy_(cache, cache as the store wrote it)``: functionalization's write-back, which Inductor drops for the
    reinplaced store (``cache_copies`` in the report)."""
    return is_op(node, aten.copy_.default) and node.args[0] is cache and node.args[1] in stored


def _mutates(node: torch.fx.Node) -> bool:
    """Whether ``node`` may write one of its tensor arguments (in place, or a functionalized mutation)."""
    if node.op != "call_function":
        return False
    if node.target in _FUNCTIONALIZED or is_op(node, aten.copy_.default):
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _graph_input(node: torch.fx.Node) -> bool:
    """A graph input or a view of one: no kernel makes it."""
    return view_chain(node, _VIEWS)[0].op in ("placeholder", "get_attr")


class SideStream(GraphPass):
    name = "side_stream"

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext | None):
        return list(graph.find_nodes(op="call_function", target=torch.ops.nsa.wk_gate_gemm.default))

    def rewrite(self, graph: torch.fx.Graph, gemm: torch.fx.Node, ctx: PassContext | None) -> torch.fx.Node:
        outputs = {u.args[1]: u for u in gemm.users if u.target is operator.getitem}
        if len(outputs) != len(gemm.users) or set(outputs) != {0, 1}:
            raise NearMiss(f"the outputs of {describe(gemm)} are not read as its two partial sets")
        gate, k = outputs[0], outputs[1]
        readers = live_users(k)
        if len(readers) != 1 or _stored_cache(readers[0]) is None or readers[0].kwargs.get("k") is not k:
            raise NearMiss(f"the k partials {describe(k)} are not read by one nsa.quant_cache_store alone (is their "
                           f"sum still an Inductor kernel?)")
        store = readers[0]
        readers = _readers(gate)
        if len(readers) != 1 or not is_op(readers[0], torch.ops.nsa.paged_mqa_logits.default):
            raise NearMiss(f"the gate partials {describe(gate)} are not read by one nsa.paged_mqa_logits alone")
        logits = readers[0]
        cache = _stored_cache(store)
        stored = [u for u in store.users if u.target is operator.getitem]  # the cache as written, functionalized
        if logits.args[1] is not cache and logits.args[1] not in stored:
            raise NearMiss(f"{describe(logits)} does not read the cache {describe(cache)} that {describe(store)} "
                           f"writes")
        for value in (cache, *stored):
            others = [u for u in live_users(value) if u not in (store, logits) and u.op != "output"
                      and not _is_epilogue_copy(u, cache, stored)]
            if others:
                raise NearMiss(f"the cache {describe(value)} is also used by {describe(others[0])}")
        side = {gemm, store}
        inputs = [a for n in side for a in (*n.args, *n.kwargs.values()) if isinstance(a, torch.fx.Node)
                  and a not in outputs.values() and a is not cache]
        for value in {v for a in inputs for v in (a, view_chain(a, _VIEWS)[0])}:  # (a view's base written too)
            writers = [u for u in value.users if u not in side and _mutates(u)
                       and not _is_epilogue_copy(u, cache, stored)]
            if writers:
                raise NearMiss(f"{describe(value)}, read by the K side, is written by {describe(writers[0])}")
        # The store follows the GEMM on the side stream without a second fork where everything else it reads is a
        # graph input (ready at the GEMM's fork): on the GPU Inductor queues it after the q side.
        store_stream = "side" if all(_graph_input(a) for a in inputs if a in store.all_input_nodes) else "fork"
        set_arg(gemm, "stream", "fork")
        store.kwargs = {**store.kwargs, "stream": store_stream}  # (a functionalized call: every argument a keyword)
        set_arg(logits, "join_side_stream", True)
        return gemm
