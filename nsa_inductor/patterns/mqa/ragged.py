"""plain-torch ragged causal (prefill) MQA logits -> ``nsa.gather_k`` + ``nsa.mqa_logits``.

Matches, once :func:`~.proofs.analyze` proves it by probing::

    seq = searchsorted(cu[1:], n, right=True); pos = n - cu[seq]    # key n is token pos of sequence seq
    slot = block_table[seq, pos // P] * P + pos % P                 # K read at the layout's offsets
    score = (w[t, :, None] * relu(q8[t].float() @ K8[slot].float().T) * k_scale[slot]).sum(0)
    logits = score.masked_fill(~((cu[seq[t]] <= n) & (n <= t)), -inf)
    # or: K8 [N, 128] fp8 / k_scale [N] however the model gathered them (read at key n), and/or
    #     the mask ks[t] <= n < ke[t] (or n < ke[t]) with ks, ke graph inputs (metadata an engine precomputed)

Rewrites to ``nsa.mqa_logits(q8, k8, k_scale, w, ks, ke)``: ``k8, k_scale`` from ``nsa.gather_k(cache, ...)`` for a
proven cache read (else the model's own gathered tensors: this pass leaves their gather, which ``gather_k_slots``
may then replace); ``ks, ke`` the input bounds, or ``ks = cu[searchsorted(cu[1:], t, right)]`` and ``ke = t + 1``
computed in the graph.
Never: bounds or maps given as inputs in another form than per-row ``ks``/``ke`` (a token -> sequence map given as
data is not known to be monotone), K read through maps given as data and not gathered into a plain tensor.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ...layout import HEAD_DIM
from ..base import NearMiss
from ..fx_utils import as_dtype, insert_call, replace, reshape, size_arg, val
from . import MqaLogitsPass

aten = torch.ops.aten


class RaggedMqaLogits(MqaLogitsPass):
    name = "ragged_mqa_logits"
    family = "prefill"

    def rewrite_match(self, graph: torch.fx.Graph, m, layout) -> None:
        heads = m.heads
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        where_shape = val(m.where).shape
        if len(where_shape) != 2:
            raise NearMiss(f"prefill logits {m.where.name} have shape {list(where_shape)}, expected [T, N]")
        with graph.inserting_before(m.where):
            q = reshape(graph, m.q, [-1, heads, HEAD_DIM])
            weights = self.head_weights(graph, m)
            if m.cached_prefill:
                num_keys = size_arg(graph, where_shape[1], [m.q, *m.weights, *inputs])
                k8, k_scale = self._gather(graph, m, layout, num_keys)
            else:  # the model's own gather stays
                k8, k_scale = reshape(graph, m.k_plain[0], [-1, HEAD_DIM]), reshape(graph, m.k_plain[1], [-1])
            if m.bounds is not None:
                begin, end = m.bounds
                ke = as_dtype(graph, end, torch.int32)
                ks = insert_call(graph, aten.zeros_like.default, (ke,)) if begin is None else \
                    as_dtype(graph, begin, torch.int32)
            else:
                ks, ke = self._causal_bounds(graph, m.lens, size_arg(graph, where_shape[0], [m.q, *m.weights, *inputs]))
            out = insert_call(graph, torch.ops.nsa.mqa_logits.default, (q, k8, k_scale, weights, ks, ke))
            replace(graph, m.where, out)

    @staticmethod
    def _gather(graph: torch.fx.Graph, m, layout, num_keys) -> tuple[torch.fx.Node, torch.fx.Node]:
        cache = m.cache
        if val(cache).dim() != 2 or val(cache).shape[-1] != layout.page_bytes:
            cache = reshape(graph, cache, [-1, layout.page_bytes])
        gathered = insert_call(
            graph, torch.ops.nsa.gather_k.default,
            (cache, as_dtype(graph, m.block_table, torch.int32), as_dtype(graph, m.lens, torch.int32),
             layout.page_size, layout.preshuffle, num_keys, val(m.q).dtype),
        )
        return insert_call(graph, operator.getitem, (gathered, 0)), insert_call(graph, operator.getitem, (gathered, 1))

    @staticmethod
    def _causal_bounds(graph: torch.fx.Graph, cu, tokens) -> tuple[torch.fx.Node, torch.fx.Node]:
        """``ks = cu[searchsorted(cu[1:], t, right)]``, ``ke = t + 1`` (int32)."""
        cu64 = as_dtype(graph, cu, torch.int64)
        token = insert_call(graph, torch.ops.prims.iota.default, (tokens,),
                            dict(start=0, step=1, dtype=torch.int64, device=val(cu).device, requires_grad=False), cu)
        # the searchsorted_offset pass, which runs later, gives this search a copy of the slice (torch 2.11)
        ends = insert_call(graph, aten.slice.Tensor, (cu64, 0, 1))
        seq = insert_call(graph, aten.searchsorted.Tensor, (ends, token), {"right": True})
        ks = as_dtype(graph, insert_call(graph, aten.index.Tensor, (cu64, [seq])), torch.int32)
        ke = as_dtype(graph, insert_call(graph, aten.add.Tensor, (token, 1)), torch.int32)
        return ks, ke
