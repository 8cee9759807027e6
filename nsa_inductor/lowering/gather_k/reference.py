"""Torch reference of ``nsa.gather_k``: any device, no host synchronisation, static output shapes; the op's CPU
path and the yardstick its GPU kernels are tested against. Inputs are assumed validated."""

from __future__ import annotations

import torch

from ...layout import KCacheLayout
from .._common import slots_of


def gather_k(cache, block_table, cu_seqlens, page_size, preshuffle, num_tokens, fp8_dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy each sequence's tokens out of the paged cache into contiguous rows; rows past the total, before
    ``cu_seqlens[0]`` or on an unreadable page (docs/indices.md) are zero."""
    layout = KCacheLayout(page_size, preshuffle)
    rows = torch.arange(num_tokens, device=cache.device)
    cu = cu_seqlens.long()
    seq = (torch.searchsorted(cu[1:], rows, right=True)).clamp(max=cu.numel() - 2)
    pos = rows - cu[seq]
    slots, readable = slots_of(block_table, seq, pos, page_size, cache.shape[0])
    valid = (rows < cu[-1]) & readable
    values, scale = layout.load(cache, slots, fp8_dtype)
    values = torch.where(valid[:, None], values.view(torch.uint8), 0).view(fp8_dtype)
    scale = torch.where(valid, scale, 0.0)
    return values, scale
