"""plain-torch ragged causal (prefill) MQA logits -> nsa.mqa_logits (+ nsa.gather_k).

Fires on ``where(mask, Σ_h w[t,h] * relu(q8[t,h]·K8[n]) * k_scale[n], -inf)`` when ``mqa_matching.analyze`` proves,
by probing the graph, that key ``n`` is token ``n - cu[seq]`` of sequence ``seq = searchsorted(cu[1:], n, right)``
read from the K cache at the compile-time layout's offsets of ``block_table[seq, pos // P] * P + pos % P`` (then
``nsa.gather_k`` copies K out of the cache), and that the mask is ``cu[seq[t]] <= n <= t``. The masked logits become ``nsa.mqa_logits(q8, k8, k_scale, w, ks, ke)``
with ``ks = cu[searchsorted(cu[1:], t, right)]`` and ``ke = t + 1`` computed in the graph. K already held in plain
``[N,128]`` / ``[N]`` tensors (not read from the cache) is not matched yet.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..pass_manager import PassContext, PassResult
from .graph_utils import insert_call, val
from .mqa_matching import HEAD_DIM, Unproven, as_dtype, replace, reshape, run_family, size_arg

aten = torch.ops.aten


def rewrite(graph: torch.fx.Graph, m, layout) -> None:
    cu, heads = m.lens, m.heads
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    where_shape = val(m.where).shape
    if len(where_shape) != 2:
        raise Unproven(f"prefill logits {m.where.name} have shape {list(where_shape)}, expected [T, N]")
    with graph.inserting_before(m.where):
        tokens = size_arg(graph, where_shape[0], [m.q, m.weights, *inputs])
        q = reshape(graph, m.q, [-1, heads, HEAD_DIM])
        weights = reshape(graph, m.weights, [-1, heads])
        num_keys = size_arg(graph, where_shape[1], [m.q, m.weights, *inputs])
        cache = m.cache
        if val(cache).dim() != 2 or val(cache).shape[-1] != layout.page_bytes:
            cache = reshape(graph, cache, [-1, layout.page_bytes])
        gathered = insert_call(
            graph, torch.ops.nsa.gather_k.default,
            (cache, as_dtype(graph, m.block_table, torch.int32), as_dtype(graph, cu, torch.int32),
             layout.page_size, layout.preshuffle, num_keys, val(m.q).dtype),
        )
        k8 = insert_call(graph, operator.getitem, (gathered, 0))
        k_scale = insert_call(graph, operator.getitem, (gathered, 1))
        cu64 = as_dtype(graph, cu, torch.int64)
        token = insert_call(graph, torch.ops.prims.iota.default, (tokens,),
                            dict(start=0, step=1, dtype=torch.int64, device=val(cu).device, requires_grad=False), cu)
        # the searchsorted_offset pass, which runs later, gives this search a copy of the slice (torch 2.11)
        ends = insert_call(graph, aten.slice.Tensor, (cu64, 0, 1))
        seq = insert_call(graph, aten.searchsorted.Tensor, (ends, token), {"right": True})
        ks = as_dtype(graph, insert_call(graph, aten.index.Tensor, (cu64, [seq])), torch.int32)
        ke = as_dtype(graph, insert_call(graph, aten.add.Tensor, (token, 1)), torch.int32)
        out = insert_call(graph, torch.ops.nsa.mqa_logits.default, (q, k8, k_scale, weights, ks, ke))
        replace(graph, m.where, out)


class RaggedMqaLogits:
    name = "ragged_mqa_logits"

    def __call__(self, graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
        return run_family(graph, ctx, "prefill", rewrite)


PASS = RaggedMqaLogits()
