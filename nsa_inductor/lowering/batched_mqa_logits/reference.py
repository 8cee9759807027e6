"""Torch reference of ``nsa.batched_mqa_logits``: the op's CPU path and the yardstick of its GPU kernel; eager's
math (fp32 upcasts, ``relu(scores * scale)``, the weighted head sum, ``masked_fill(~mask, fill)``), a bounded block
of scores at a time."""

from __future__ import annotations

import torch

from .._common import MAX_SCORE_ELEMENTS


def batched_mqa_logits(q, k, weights, scale, scale_tensor=None, mask=None, fill=None) -> torch.Tensor:
    batch, tokens, heads, _ = q.shape
    keys = k.shape[1]
    out = torch.empty(batch, tokens, keys, dtype=torch.float32, device=q.device)
    rows_per_step = max(1, MAX_SCORE_ELEMENTS // max(1, heads * keys))
    for b in range(batch):
        kf = k[b].float()
        for s0 in range(0, tokens, rows_per_step):
            s1 = min(tokens, s0 + rows_per_step)
            scores = torch.einsum("shd,td->sht", q[b, s0:s1].float(), kf) * scale
            if scale_tensor is not None:
                scores = scores * scale_tensor
            out[b, s0:s1] = (scores.relu() * weights[b, s0:s1, :, None]).sum(dim=1)
    return out if mask is None else out.masked_fill_(~mask, float("-inf") if fill is None else fill)
