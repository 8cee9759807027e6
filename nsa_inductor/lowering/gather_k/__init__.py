"""``nsa.gather_k``: the cached K of the sequences in a batch as contiguous rows (the prefill path).

The ragged logits op then reads K once, in order, instead of through the block table.
"""

from __future__ import annotations

import torch

from ...capability import capability
from ...index_contract import check_cu_seqlens, check_pages, eager_call
from ...layout import HEAD_DIM
from .._common import (check, check_devices, check_fp8, check_layout, contiguous, describe, implementation, nsa_op,
                       once_per_signature)


@once_per_signature
def _validate(cache, block_table, cu_seqlens, page_size, preshuffle, num_tokens, fp8_dtype) -> None:
    check_fp8("fp8_dtype", fp8_dtype)
    check_layout(cache, page_size, preshuffle)
    check("block_table", block_table, (None, None), (torch.int32,), "[B, max_pages]")
    batch = block_table.shape[0]
    check("cu_seqlens", cu_seqlens, (batch + 1,), (torch.int32,), f"[B+1={batch + 1}] (B from block_table)")
    if batch < 1 or block_table.shape[1] < 1:
        raise ValueError(f"block_table must have at least one row and one column, got {describe(block_table)}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    check_devices(cache=cache, block_table=block_table, cu_seqlens=cu_seqlens)


@nsa_op("gather_k")
def gather_k(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    page_size: int,
    preshuffle: bool,
    num_tokens: int,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences' cached K as contiguous ``(k_fp8 [num_tokens,128], k_scale [num_tokens])``; spare rows zero."""
    _validate(cache, block_table, cu_seqlens, page_size, preshuffle, num_tokens, fp8_dtype)
    if capability().index_checks:
        lens = check_cu_seqlens(eager_call, cu_seqlens)
        check_pages(eager_call, block_table, lens, cache.shape[0], block_table.shape[1], page_size, "cu_seqlens",
                    block_table.device)
    block_table, cu_seqlens = contiguous(block_table, cu_seqlens)
    run = implementation("gather_k", cache.device, fp8_dtype, page_size=page_size, preshuffle=preshuffle)
    return run(cache, block_table, cu_seqlens, page_size, preshuffle, num_tokens, fp8_dtype)


@gather_k.register_fake
def _(cache, block_table, cu_seqlens, page_size, preshuffle, num_tokens, fp8_dtype=torch.float8_e4m3fn):
    _validate(cache, block_table, cu_seqlens, page_size, preshuffle, num_tokens, fp8_dtype)
    return (
        cache.new_empty((num_tokens, HEAD_DIM), dtype=fp8_dtype),
        cache.new_empty((num_tokens,), dtype=torch.float32),
    )
