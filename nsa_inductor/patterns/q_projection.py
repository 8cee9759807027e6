"""The q side's projection (wq_b) folded into the ``nsa.rotate_act_quant`` that reads it.

Eager idiom (``Indexer.project_q``, DeepSeek's and SGLang's reference)::

    q = F.linear(q_lora, wq_b.weight).view(T, H, 128)     # aten: mm(q_lora, permute(W, [1, 0])) + reshapes
    q_fp8, q_scale = act_quant(rotate_activation(rope(q)))  # already nsa.rotate_act_quant(q, H, ..., rope)

Matches an ``nsa.rotate_act_quant`` (after ``rotate_act_quant`` and ``rope_prologue``) whose ``x`` [T, H, 128] is,
through reshapes of a contiguous value, the bf16 ``mm(a, permute(W, [1, 0]))`` of a [T, K] ``a`` and a weight ``W``
[H * 128, K] that is a graph input or constant; the product and its reshapes read by nothing else.
Rewrites to ``nsa.rotate_act_quant(a, H, ..., weight=W)``: one kernel computes q in registers (split over K, the
last program of a head summing the partials), so q never reaches memory and a launch goes.
Never: a product read elsewhere, a weight computed in the graph, x of another shape (the op's outputs are [T, H,
128]), a token count that is not the product's rows.
Numerics: the product is summed in another order than cuBLAS's (docs/numerics.md); ``nsa.disable_passes`` with this
pass's name keeps eager's.
"""

from __future__ import annotations

import torch
import torch.fx

from ..layout import HEAD_DIM
from .base import GraphPass, NearMiss, PassContext
from .fx_utils import VIEW_OPS, aten, describe, is_op, live_users, sym_equal, tensor_val, view_chain

_WEIGHT_VIEWS = (*VIEW_OPS, aten.permute.default)


class QProjection(GraphPass):
    name = "q_projection"

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext):
        return [n for n in graph.find_nodes(op="call_function", target=torch.ops.nsa.rotate_act_quant.default)
                if n.kwargs.get("weight") is None]

    def rewrite(self, graph: torch.fx.Graph, anchor: torch.fx.Node, ctx: PassContext) -> torch.fx.Node:
        x = anchor.args[0]
        product, chain = view_chain(x)
        if not is_op(product, aten.mm.default):
            raise NearMiss(f"the rotated rows {describe(x)} are not a product of two matrices (mm) through reshapes")
        for node in [product, *chain]:
            if len(live_users(node)) != 1 or not tensor_val(node).is_contiguous():
                raise NearMiss(f"{describe(node)}, the q projection, is read elsewhere too or not contiguous")
        a, w_t = product.args
        if not (is_op(w_t, aten.permute.default) and list(w_t.args[1]) == [1, 0]):
            raise NearMiss(f"the projection's right operand {describe(w_t)} is not a transposed weight (F.linear)")
        weight = w_t.args[0]
        if view_chain(weight, _WEIGHT_VIEWS)[0].op not in ("placeholder", "get_attr"):
            raise NearMiss(f"the weight {describe(weight)} is computed in the graph")
        a_val, w_val, x_val = tensor_val(a), tensor_val(weight), tensor_val(x)
        if a_val.dtype != torch.bfloat16 or w_val.dtype != torch.bfloat16:
            raise NearMiss(f"the projection is {a_val.dtype} x {w_val.dtype}, not bf16 x bf16")
        heads, rem = divmod(w_val.shape[0], HEAD_DIM)
        if rem or x_val.dim() != 3 or x_val.shape[1] != heads or not sym_equal(x_val.shape[0], a_val.shape[0]):
            raise NearMiss(f"the rotated rows are {list(x_val.shape)}, not [T={a_val.shape[0]}, {heads}, "
                           f"{HEAD_DIM}] of the projection's {list(w_val.shape)} weight")
        anchor.args = (a, *anchor.args[1:])
        anchor.kwargs = {**anchor.kwargs, "weight": weight}
        return anchor

    def finish(self, graph: torch.fx.Graph, rewritten: list[torch.fx.Node]) -> None:
        graph.eliminate_dead_code()
