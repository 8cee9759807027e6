"""Torch reference of ``nsa.topk_indices``: any device, no host synchronisation, static output shapes; the op's CPU
path and the yardstick its GPU kernels are tested against. Inputs are assumed validated."""

from __future__ import annotations

import torch


def topk_indices(
    logits: torch.Tensor, k: int, lengths: torch.Tensor | None, offset: torch.Tensor | None
) -> torch.Tensor:
    """``[R, k]`` int32: the columns of a top-``k`` set of each row, minus ``offset[r]``; -1 where the value is -inf.

    Only a row's first ``lengths[r]`` columns take part (the rest count as -inf); as sets, the result equals eager's
    ``topk(logits, k)`` indices (minus the offset) with -inf entries replaced by -1, up to ties.
    """
    if lengths is not None:
        cols = torch.arange(logits.shape[1], device=logits.device)
        logits = logits.masked_fill(cols[None, :] >= lengths[:, None], float("-inf"))
    values, indices = torch.topk(logits, k, dim=-1)
    if offset is not None:
        indices = indices - offset[:, None]
    return indices.masked_fill(values == float("-inf"), -1).to(torch.int32)
