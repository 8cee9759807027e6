"""plain-torch paged (decode) MQA logits -> ``nsa.paged_mqa_logits``.

Matches (any spelling: einsum/matmul, masked_fill/where, relu as ``clamp_min``/``maximum``/``where`` with 0, scale
inside or outside the relu or on the head sum, the heads summed or contracted with the weights by an einsum, K read
by byte offsets or through page views), once :func:`~.proofs.analyze` proves it by probing::

    slot = block_table[b, s // P] * P + s % P                       # b = row // next_n, K read at the layout's offsets
    score = (w[row, :, None] * relu(q8[row].float() @ K8[slot].float().T) * k_scale[slot]).sum(0)
    logits = score.masked_fill(~(s <= context_lens[b] - next_n + j), -inf)   # or on a wider -inf buffer holding it
    # or the mask s < row_lens[row]: per-row lengths an engine precomputed, a graph input [B * next_n]

Rewrites to ``nsa.paged_mqa_logits(q8 [B, next_n, H, 128], cache, w [B*next_n, H], context_lens, block_table,
max_len, P, preshuffle[, w2, c])`` reshaped to the shape the consumers expected, ``w * w2 * c`` being the weights
as the model computes them (e.g. ``gates * q_scale * softmax_scale``, computed in the kernel; ``w`` may be the head
gate's split-K partials ``[S, rows, H]``); with per-row lengths, one row per query token: ``q8 [B*next_n, 1, H,
128]``, ``context_lens = row_lens``, the block table's rows repeated ``next_n`` times.
Never: a mask, layout, head axis or weight indexing that is not proven (reported as a near miss).
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...layout import HEAD_DIM
from ..fx_utils import as_dtype, insert_call, replace, reshape, size_arg, val
from . import MqaLogitsPass

aten = torch.ops.aten


class PagedMqaLogits(MqaLogitsPass):
    name = "paged_mqa_logits"
    family = "decode"

    def rewrite_match(self, graph: torch.fx.Graph, m, layout) -> None:
        bt, lens, heads = m.block_table, m.lens, m.heads
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        with graph.inserting_before(m.where):
            batch = size_arg(graph, val(bt).shape[0], [bt])
            max_len = val(m.where).shape[-1]
            if not isinstance(max_len, int) and statically_known_true(max_len == val(bt).shape[1] * layout.page_size):
                pages = size_arg(graph, val(bt).shape[1], [bt])
                max_len = insert_call(graph, operator.mul, (pages, layout.page_size))
            else:
                max_len = size_arg(graph, max_len, [bt, m.q, *inputs])
            known = [(val(bt).shape[0], batch)]
            if m.row_lens is None:
                q = reshape(graph, m.q, [batch, -1, heads, HEAD_DIM])
            else:  # one row per query token: row r reads block_table[r // next_n] and sees s < row_lens[r]
                lens = m.row_lens
                rows = size_arg(graph, val(lens).shape[0], [lens])
                next_n = rows // batch if isinstance(rows, int) and isinstance(batch, int) else \
                    insert_call(graph, operator.floordiv, (rows, batch))
                pages = size_arg(graph, val(bt).shape[1], [bt])
                per_row = insert_call(graph, aten.expand.default,
                                      (insert_call(graph, aten.unsqueeze.default, (bt, 1)), [batch, next_n, pages]))
                bt = reshape(graph, per_row, [rows, pages])
                q = reshape(graph, m.q, [rows, 1, heads, HEAD_DIM])
                known.append((val(lens).shape[0], rows))
            weights, weights_factor, weight_scale = self.head_weight_factors(graph, m)
            factors = () if weights_factor is None and weight_scale == 1.0 else (weights_factor, weight_scale)
            cache = m.cache
            if val(cache).dim() != 2 or val(cache).shape[-1] != layout.page_bytes:
                cache = reshape(graph, cache, [-1, layout.page_bytes])
            out = insert_call(
                graph, torch.ops.nsa.paged_mqa_logits.default,
                (q, cache, weights, as_dtype(graph, lens, torch.int32), as_dtype(graph, bt, torch.int32), max_len,
                 layout.page_size, layout.preshuffle, *factors),
            )
            replace(graph, m.where, out, known=(*known, (val(m.where).shape[-1], max_len)))
