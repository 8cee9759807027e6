"""plain-torch paged (decode) MQA logits -> nsa.paged_mqa_logits.

Fires on ``where(mask, Σ_h w[r,h] * relu(q8[r,h]·K8[b,s]) * k_scale[b,s], -inf)`` (any spelling: einsum/matmul,
masked_fill/where, scale inside or outside the relu, K read by byte offsets or through page views) when
``mqa_matching.analyze`` proves, by probing the graph, that K and k_scale are read from the K cache at the
compile-time layout's offsets of ``slot = block_table[b, s // P] * P + s % P`` with ``b = row // next_n``, and that
the mask is ``s <= context_lens[b] - next_n + j``. The masked logits become
``nsa.paged_mqa_logits(q8 [B, next_n, H, 128], cache, w [B*next_n, H], context_lens, block_table, max_len, P,
preshuffle)`` reshaped to the shape the consumers expected. Anything unproven is a near miss with the reason.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..pass_manager import PassContext, PassResult
from .graph_utils import insert_call, val
from .mqa_matching import HEAD_DIM, as_dtype, replace, reshape, run_family, size_arg


def rewrite(graph: torch.fx.Graph, m, layout) -> None:
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
        q = reshape(graph, m.q, [batch, -1, heads, HEAD_DIM])
        weights = reshape(graph, m.weights, [-1, heads])
        cache = m.cache
        if val(cache).dim() != 2 or val(cache).shape[-1] != layout.page_bytes:
            cache = reshape(graph, cache, [-1, layout.page_bytes])
        out = insert_call(
            graph, torch.ops.nsa.paged_mqa_logits.default,
            (q, cache, weights, as_dtype(graph, lens, torch.int32), as_dtype(graph, bt, torch.int32), max_len,
             layout.page_size, layout.preshuffle),
        )
        replace(graph, m.where, out, known=((val(bt).shape[0], batch), (val(m.where).shape[-1], max_len)))


class PagedMqaLogits:
    name = "paged_mqa_logits"

    def __call__(self, graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
        return run_family(graph, ctx, "decode", rewrite)


PASS = PagedMqaLogits()
