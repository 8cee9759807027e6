"""``nsa.gather_k_slots``: cached K rows of tokens given as data, by slot or by (sequence, position).

Serving engines precompute per-token maps once per batch and pass them in (a slot mapping; or sequence ids and
positions read through the block table). Token ``n`` reads::

    slot = positions[n]                                                           # without a block table
    slot = block_table[seq_ids[n], positions[n] // P] * P + positions[n] % P     # with block_table and seq_ids

and its row is the 128 fp8 values and the fp32 scale at that slot (DESIGN §3). Every id wraps as a Python index
where eager indexing accepts it; any other id reads nothing: a zero row, scale 0 (docs/indices.md).
"""

from __future__ import annotations

import torch

from ...capability import capability
from ...index_contract import check_gather_ids, eager_call
from ...layout import HEAD_DIM
from .._common import (INT_TYPES, check, check_devices, check_fp8, check_layout, contiguous, describe, nsa_op,
                       once_per_signature, triton_or_reference)


@once_per_signature
def _validate(cache, positions, page_size, preshuffle, fp8_dtype, block_table, seq_ids) -> None:
    check_fp8("fp8_dtype", fp8_dtype)
    check_layout(cache, page_size, preshuffle)
    check("positions", positions, (None,), INT_TYPES, "[N]")
    if (block_table is None) != (seq_ids is None):
        raise ValueError("block_table and seq_ids go together: give both (positions in sequences) or neither "
                         f"(positions are slots), got block_table={block_table is not None}, "
                         f"seq_ids={seq_ids is not None}")
    if block_table is not None:
        check("block_table", block_table, (None, None), INT_TYPES, "[B, max_pages]")
        if block_table.shape[0] < 1 or block_table.shape[1] < 1:
            raise ValueError(f"block_table must have at least one row and one column, got {describe(block_table)}")
        check("seq_ids", seq_ids, (positions.shape[0],), INT_TYPES, f"[N={positions.shape[0]}] (N of positions)")
        check_devices(cache=cache, positions=positions, block_table=block_table, seq_ids=seq_ids)
    else:
        check_devices(cache=cache, positions=positions)


@nsa_op("gather_k_slots")
def gather_k_slots(
    cache: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    preshuffle: bool,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    block_table: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_fp8 [N, 128], k_scale [N])`` of the slots ``positions`` (or the positions of sequences ``seq_ids``
    through ``block_table``); a row whose ids eager indexing would not accept is zero."""
    _validate(cache, positions, page_size, preshuffle, fp8_dtype, block_table, seq_ids)
    if capability().index_checks:
        check_gather_ids(eager_call, positions, cache.shape[0], page_size, block_table, seq_ids,
                         *((block_table.shape[0], block_table.shape[1]) if block_table is not None else ()))
    positions, block_table, seq_ids = contiguous(positions, block_table, seq_ids)
    run = triton_or_reference("gather_k_slots", cache.device, fp8_dtype)
    return run(cache, positions, page_size, preshuffle, fp8_dtype, block_table, seq_ids)


@gather_k_slots.register_fake
def _(cache, positions, page_size, preshuffle, fp8_dtype=torch.float8_e4m3fn, block_table=None, seq_ids=None):
    _validate(cache, positions, page_size, preshuffle, fp8_dtype, block_table, seq_ids)
    return (
        cache.new_empty((positions.shape[0], HEAD_DIM), dtype=fp8_dtype),
        cache.new_empty((positions.shape[0],), dtype=torch.float32),
    )
