"""The split-K partial sums of the K projection -> the store sums them as it loads the rows.

Eager idiom (``Indexer.store_k``) after ``wk_gate_gemm``, whose K projection is fp32 split-K partials ``P [S, T, 128]``
summed by pointwise adds and rounded as the bf16 GEMM rounds its output::

    k = self.k_norm(self.wk(x).float()).to(torch.bfloat16)   # wk(x) -> convert(P[0] + P[1] + ... + P[S-1], bf16)
    ... LayerNorm, RoPE, rotation, act_quant, cache write     # nsa.quant_cache_store(k=y, round_k=True, ...)

Matches the ``k`` of an ``nsa.quant_cache_store`` with ``round_k`` (``store_input_rounding`` ran) that is
``convert(convert(P[0] + P[1] + ... + P[S-1], bf16), f32)`` (the sum read back with ``.float()``, e.g. by the LayerNorm
``layer_norm_prologue`` moved into the store), or, with no LayerNorm in the store, the sum itself (the store rounds it
to bf16 first); the adds left to right over every split of one fp32 ``P``, read by nothing else. Rewrites to the store
reading ``P`` with ``k_split_sum=True``: the kernel adds the partials in the same order and rounds the sum to bf16, and
Inductor's kernel for the sum goes.
Never: a sum over some of the splits or in another order, a sum the LayerNorm reads before it is rounded, a sum or
cast something else reads too.
"""

from __future__ import annotations

import torch
import torch.fx

from .base import GraphPass, NearMiss, PassContext
from .fx_utils import as_int, aten, describe, is_op, is_store, live_users, prims, val


def _read_back_bf16(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The casts of ``convert(bf16 value, f32)``: ``[node]``, or ``[node, inner]`` where the bf16 value is itself
    ``inner = convert(y, bf16)``; ``[]`` where ``node`` is not a bf16 value read back as float32."""
    if not (is_op(node, prims.convert_element_type.default) and val(node).dtype == torch.float32
            and isinstance(node.args[0], torch.fx.Node) and val(node.args[0]).dtype == torch.bfloat16):
        return []
    inner = node.args[0]
    return [node, inner] if is_op(inner, prims.convert_element_type.default) else [node]


def _split_sum(total: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """``(P, nodes)`` where ``total`` is ``P[0] + P[1] + ... + P[S-1]`` (left to right, ``S = P.shape[0]``) and
    ``nodes`` the adds and selects that compute it."""
    nodes, splits = [], []
    node = total
    while is_op(node, aten.add.Tensor) and len(node.args) == 2 and not node.kwargs:
        left, right = node.args
        if not (isinstance(right, torch.fx.Node) and is_op(right, aten.select.int) and right.args[1] == 0):
            raise NearMiss(f"{describe(node)} adds {describe(right)}, not a split-K partial")
        nodes += [node, right]
        splits.append(right.args[2])
        node = left
    if not (is_op(node, aten.select.int) and node.args[1] == 0 and node.args[2] == 0):
        raise NearMiss(f"the stored k {describe(total)} is not a sum of split-K partials P[0] + P[1] + ...")
    nodes.append(node)
    partials = node.args[0]
    if any(n.args[0] is not partials for n in nodes if is_op(n, aten.select.int)):
        raise NearMiss(f"the sum at {describe(total)} adds partials of more than one tensor")
    p = val(partials)
    count = as_int(p.shape[0])
    if count is None:
        raise NearMiss(f"the partials {describe(partials)} have a symbolic count {p.shape[0]}")
    if splits[::-1] != list(range(1, count)):
        raise NearMiss(f"the sum at {describe(total)} adds splits {[0, *splits[::-1]]} of {describe(partials)}, not "
                       f"all of them left to right")
    if p.dtype != torch.float32 or p.dim() != 3:
        raise NearMiss(f"the partials {describe(partials)} are not fp32 [S, T, 128]")
    return partials, nodes


class SplitKPrologue(GraphPass):
    name = "split_k_prologue"

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext):
        for node in list(graph.nodes):
            if is_store(node) and node.kwargs.get("round_k", False) and not node.kwargs.get("k_split_sum", False):
                yield node

    def rewrite(self, graph: torch.fx.Graph, anchor: torch.fx.Node, ctx: PassContext) -> torch.fx.Node:
        k = anchor.kwargs["k"]
        casts = _read_back_bf16(k)
        if not casts and anchor.kwargs.get("ln_weight") is not None:
            raise NearMiss(f"the store's LayerNorm reads {describe(k)}, not a bf16 value read back as float32")
        total = casts[-1].args[0] if casts else k  # (one cast: the bf16 value itself, e.g. cuBLAS's GEMM output)
        partials, nodes = _split_sum(total)
        chain = set(casts + nodes)
        for node in chain:
            readers = [u for u in live_users(node) if u is not anchor and u not in chain]
            if readers:
                raise NearMiss(f"{describe(node)} of the split-K sum is also read by {describe(readers[0])}")
        anchor.kwargs = {**anchor.kwargs, "k": partials, "k_split_sum": True}
        return anchor

    def finish(self, graph: torch.fx.Graph, rewritten: list[torch.fx.Node]) -> None:
        graph.eliminate_dead_code()
