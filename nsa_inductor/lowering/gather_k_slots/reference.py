"""Torch reference of ``nsa.gather_k_slots``: any device, no host synchronisation; the op's CPU path and the
yardstick its Triton kernel is tested against. Inputs are assumed validated."""

from __future__ import annotations

import torch

from ...layout import HEAD_DIM, KCacheLayout
from ...index_contract import python_index
from .._common import slots_of


def gather_k_slots(cache, positions, page_size, preshuffle, fp8_dtype, block_table=None, seq_ids=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's row at its slot (DESIGN §3), read as eager's indexing reads it; zero where eager's would not."""
    layout = KCacheLayout(page_size, preshuffle)
    num_pages = cache.shape[0]
    if block_table is None:
        slots, readable = python_index(positions, num_pages * page_size)
    else:
        batch, width = block_table.shape
        seq, seq_ok = python_index(seq_ids, batch)
        pos, pos_ok = python_index(positions, width * page_size)  # wraps the page column, keeps pos % P
        slots, readable = slots_of(block_table, seq, pos, page_size, num_pages)
        readable &= seq_ok & pos_ok
    if num_pages == 0:  # nothing to read, not even the safe slot 0
        return (torch.zeros(positions.shape[0], HEAD_DIM, dtype=fp8_dtype, device=cache.device),
                torch.zeros(positions.shape[0], device=cache.device))
    values, scale = layout.load(cache, slots, fp8_dtype)
    values = torch.where(readable[:, None], values.view(torch.uint8), 0).view(fp8_dtype)
    return values, torch.where(readable, scale, 0.0)
