"""``nsa.paged_mqa_logits`` through aiter's ``deepgemm_fp8_paged_mqa_logits(q_fp8, kv_cache, weights, out_logits,
context_lens, kv_indices, max_model_len, Preshuffle=False, KVBlockSize=1, ...)`` in
``aiter.ops.triton.attention.pa_mqa_logits`` (``aiter.ops.triton.pa_mqa_logits`` before aiter 0.1.10).

Only the two layouts aiter reads correctly reach this module (``capability.aiter_refusal``): flat (page_size 1, no
preshuffle) and preshuffle with a page size aiter's ChunkK 256 accepts, on a gluon GPU. Row-major pages with
page_size > 1 never come here: aiter's non-preshuffle kernels read the block table as one slot per token whatever
``KVBlockSize`` says. ``Preshuffle``/``KVBlockSize`` exist from aiter 0.1.8 (older releases are refused)."""

from __future__ import annotations

import functools

import torch

from .._aiter_common import import_first, kv_cache
from .._common import head_weights


@functools.cache
def _paged_logits_fn():
    module = import_first("aiter.ops.triton.attention.pa_mqa_logits", "aiter.ops.triton.pa_mqa_logits")
    return module.deepgemm_fp8_paged_mqa_logits


def paged_mqa_logits(q_fp8, cache, weights, context_lens, block_table, max_len, page_size, preshuffle,
                     weights_factor=None, weight_scale=1.0, write_masked=True):
    """aiter writes only the chunks it visits; every column a row may not see is then set to -inf (``write_masked``;
    else left as aiter left it). aiter takes one weights tensor: factors are multiplied first."""
    weights = head_weights(weights, weights_factor, weight_scale)
    batch, next_n = q_fp8.shape[:2]
    out = torch.empty(batch * next_n, max_len, dtype=torch.float32, device=q_fp8.device)
    if out.numel() == 0:  # an empty batch: no call (aiter's kernel would launch an empty grid)
        return out
    _paged_logits_fn()(
        q_fp8,
        kv_cache(cache, page_size, q_fp8.dtype, 1),
        weights,
        out,
        context_lens,
        block_table,
        max_len,
        Preshuffle=preshuffle,
        KVBlockSize=page_size,
    )
    if not write_masked:
        return out
    cols = torch.arange(max_len, device=out.device)
    limit = context_lens[:, None] - next_n + torch.arange(next_n, device=out.device)[None, :]
    hidden = cols[None, None, :] > limit[:, :, None]
    return out.masked_fill_(hidden.view(batch * next_n, max_len), float("-inf"))
