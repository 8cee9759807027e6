"""Torch reference of ``nsa.paged_mqa_logits``: any device, no host synchronisation, static output shapes; the op's CPU
path and the yardstick its GPU kernels are tested against. Inputs are assumed validated."""

from __future__ import annotations

import torch

from ...layout import HEAD_DIM, KCacheLayout
from .._common import MAX_SCORE_ELEMENTS, head_weights, slots_of


def paged_mqa_logits(q_fp8, cache, weights, context_lens, block_table, max_len, page_size, preshuffle,
                     weights_factor=None, weight_scale=1.0, write_masked=True) -> torch.Tensor:
    """Decode logits ``[B*next_n, max_len]``: row ``b*next_n+j`` sees keys ``s <= ctx_b - next_n + j``, else -inf;
    without ``write_masked``, NaN past the row's last visible key (unspecified there: NaN, which a top-k ranks
    first, makes a reader past it visible in CPU tests).

    Only the block table's reach (``max_pages * page_size`` columns) can hold keys (contexts fit their table, DESIGN
    §4); the columns past it are -inf without being computed, which keeps a ``max_model_len``-wide call cheap.
    Keys on an unreadable page (docs/indices.md) are -inf.
    """
    batch, next_n, heads, _ = q_fp8.shape
    weights = head_weights(weights, weights_factor, weight_scale)
    layout = KCacheLayout(page_size, preshuffle)
    reach = min(max_len, block_table.shape[1] * page_size)
    out = torch.full((batch * next_n, max_len), float("-inf"), dtype=torch.float32, device=q_fp8.device)
    cols = torch.arange(reach, device=q_fp8.device)
    limit = context_lens.long()[:, None] - next_n + torch.arange(next_n, device=q_fp8.device)[None, :]  # last key
    rows_per_step = max(1, MAX_SCORE_ELEMENTS // max(1, (next_n * heads + HEAD_DIM) * reach))
    for b0 in range(0, batch, rows_per_step):
        b1 = min(batch, b0 + rows_per_step)
        seqs = torch.arange(b1 - b0, device=q_fp8.device)
        slots, readable = slots_of(block_table[b0:b1], seqs[:, None], cols[None, :], page_size, cache.shape[0])
        values, scale = layout.load(cache, slots.reshape(-1), q_fp8.dtype)
        values = values.view(b1 - b0, reach, HEAD_DIM).float()
        scores = torch.einsum("bjhd,bsd->bjhs", q_fp8[b0:b1].float(), values) * scale.view(b1 - b0, 1, 1, reach)
        w = weights.view(batch, next_n, heads, 1)[b0:b1].float()
        logits = (scores.relu() * w).sum(dim=2)
        mask = (cols[None, None, :] <= limit[b0:b1, :, None]) & readable[:, None, :]
        out.view(batch, next_n, max_len)[b0:b1, :, :reach] = torch.where(mask, logits, float("-inf"))
    if not write_masked:
        past = torch.arange(max_len, device=q_fp8.device)[None, :] > limit.view(-1, 1)
        out.masked_fill_(past, float("nan"))
    return out
