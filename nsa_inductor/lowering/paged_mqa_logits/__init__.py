"""``nsa.paged_mqa_logits``: the indexer's decode logits, read straight from the paged fp8 K cache.

``logit[b*next_n+j, s] = sum_h w[., h] * relu(q8[b,j,h] . k8[s] * k_scale[s])`` for the keys a row may see
(``s <= ctx_b - next_n + j``), -inf elsewhere. Every element is written, so a caller may allocate with ``empty``;
with ``write_masked=False`` only the columns each row may see are (for a reader that stops there).
"""

from __future__ import annotations

import torch

from ...capability import capability
from ...index_contract import check_pages, eager_call
from ...layout import HEAD_DIM
from ...quant import FP8_DTYPES
from .._common import (check, check_devices, check_layout, contiguous, describe, implementation, nsa_op,
                       once_per_signature)
from .. import _streams


@once_per_signature
def _validate(q_fp8, cache, weights, context_lens, block_table, max_len, page_size, preshuffle,
              weights_factor) -> None:
    check("q_fp8", q_fp8, (None, None, None, HEAD_DIM), FP8_DTYPES, "[B, next_n, H, 128]")
    batch, next_n, heads, _ = q_fp8.shape
    if weights.dim() == 3:
        check("weights", weights, (None, batch * next_n, heads), (torch.float32,),
              f"[S, B*next_n={batch * next_n}, H={heads}] (split-K partials; B, next_n, H of q_fp8)")
    else:
        check("weights", weights, (batch * next_n, heads), (torch.float32,),
              f"[B*next_n={batch * next_n}, H={heads}] (B, next_n, H of q_fp8)")
    if weights_factor is not None:
        check("weights_factor", weights_factor, (batch * next_n, heads), (torch.float32,),
              f"[B*next_n={batch * next_n}, H={heads}] (as weights)")
    check("context_lens", context_lens, (batch,), (torch.int32,), f"[B={batch}] (B of q_fp8)")
    check("block_table", block_table, (batch, None), (torch.int32,), f"[B={batch}, max_pages] (B of q_fp8)")
    if block_table.shape[1] < 1:
        raise ValueError(f"block_table must have at least one column, got {describe(block_table)}")
    if max_len < 0:
        raise ValueError(f"max_len must be >= 0, got {max_len}")
    check_layout(cache, page_size, preshuffle)
    check_devices(q_fp8=q_fp8, cache=cache, weights=weights, context_lens=context_lens, block_table=block_table,
                  **({} if weights_factor is None else {"weights_factor": weights_factor}))


@nsa_op("paged_mqa_logits")
def paged_mqa_logits(
    q_fp8: torch.Tensor,
    cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_len: int,
    page_size: int,
    preshuffle: bool,
    weights_factor: torch.Tensor | None = None,
    weight_scale: float = 1.0,
    join_side_stream: bool = False,
    write_masked: bool = True,
) -> torch.Tensor:
    """Decode logits ``[B*next_n, max_len]`` fp32 from the paged K cache; every element written (-inf masked).

    The head weights are ``weights * weights_factor * weight_scale`` (fp32, in that order) when those are given, and
    ``weights`` may be split-K partials ``[S, B*next_n, H]`` (summed first, left to right): the kernel computes them
    itself, so the model's ``(p[0] + p[1] + ...) * q_scale * c`` needs no kernel of its own. ``join_side_stream``
    (CUDA, while a graph is captured): first, the current stream waits for the device's second stream
    (lowering/_streams.py), where the weights and the cache may have been written. ``write_masked=False``: the
    columns past a row's last visible key may be left unwritten (unspecified): for a reader that stops at each row's
    visible columns, as ``nsa.topk_indices`` with the rows' lengths does, where an engine's
    ``max_model_len``-wide rows are mostly past the context."""
    _validate(q_fp8, cache, weights, context_lens, block_table, max_len, page_size, preshuffle, weights_factor)
    if join_side_stream:
        _streams.join_side_stream(q_fp8.device)
    if capability().index_checks:
        check_pages(eager_call, block_table, context_lens, cache.shape[0], block_table.shape[1], page_size,
                    "context_lens", block_table.device)
    q_fp8, weights, weights_factor, context_lens, block_table = contiguous(q_fp8, weights, weights_factor,
                                                                            context_lens, block_table)
    args = (q_fp8, cache, weights, context_lens, block_table, max_len, page_size, preshuffle, weights_factor,
            weight_scale, write_masked)
    run = implementation("paged_mqa_logits", q_fp8.device, q_fp8.dtype, page_size=page_size, preshuffle=preshuffle,
                         heads=q_fp8.shape[2])
    return run(*args)


@paged_mqa_logits.register_fake
def _(q_fp8, cache, weights, context_lens, block_table, max_len, page_size, preshuffle, weights_factor=None,
      weight_scale=1.0, join_side_stream=False, write_masked=True):
    _validate(q_fp8, cache, weights, context_lens, block_table, max_len, page_size, preshuffle, weights_factor)
    return q_fp8.new_empty((q_fp8.shape[0] * q_fp8.shape[1], max_len), dtype=torch.float32)
