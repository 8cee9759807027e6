"""Torch reference of ``nsa.topk_indices``: any device, no host synchronisation, static output shapes; the op's CPU
path and the yardstick its GPU kernels are tested against. Inputs are assumed validated."""

from __future__ import annotations

import torch


def topk_indices(
    logits: torch.Tensor, k: int, lengths: torch.Tensor | None, offset: torch.Tensor | None, pad: str = "neg1",
    sorted: bool = False,
) -> torch.Tensor:
    """``[R, k]`` int32: eager's ``topk(logits, k)`` indices minus ``offset[r]``, in descending value order (so
    valid for either ``sorted``). Only a row's first ``lengths[r]`` columns take part (the rest count as -inf);
    with ``pad="neg1"`` the entries of -inf values become -1."""
    if lengths is not None:
        cols = torch.arange(logits.shape[1], device=logits.device)
        logits = logits.masked_fill(cols[None, :] >= lengths[:, None], float("-inf"))
    values, indices = torch.topk(logits, k, dim=-1)
    if offset is not None:
        indices = indices - offset[:, None]
    if pad == "neg1":
        indices = indices.masked_fill(values == float("-inf"), -1)
    return indices.to(torch.int32)
