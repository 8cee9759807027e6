"""``nsa.quant_cache_store`` through aiter's
``aiter.ops.cache.indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, preshuffle=False)``.

aiter's quantizer multiplies by ``1/scale`` and divides ``amax / fmax`` exactly, so with ``scale_fmt="fp32"`` its
bytes can differ from the torch reference by one rounding; ue8m0 scales are powers of two and agree.
"""

from __future__ import annotations

import torch

from ...layout import written_slots
from ...quant import QUANT_BLOCK
from .._aiter_common import cache_ops, kv_cache, preshuffle_kwarg
from .reference import prologue_rows, scaled_input


def quant_cache_store(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype, input_scale=1.0,
                      input_dtype=None, input_divide=False, rotation=None, rope_cos=None, rope_sin=None, positions=None,
                      rope_interleaved=False, round_k=False, ln_weight=None, ln_bias=None, ln_eps=0.0,
                      k_split_sum=False) -> None:
    """aiter quantizes the values as given: the input epilogue runs in torch before it. A call with a prologue
    (rotation, RoPE, rounding, LayerNorm, split-K sum) goes to the Triton kernel (``capability.aiter_refusal``); here
    they would run in torch too. Slots it must not write (out of range, earlier duplicates: docs/indices.md) are given
    as -1, which it skips. No token (an empty batch): no call (aiter's kernel would launch an empty grid)."""
    if slot_mapping.numel() == 0:
        return
    k = prologue_rows(k, rope_cos, rope_sin, positions, rope_interleaved, round_k, ln_weight, ln_bias, ln_eps,
                      k_split_sum)
    slots = slot_mapping.long()
    slots = torch.where(written_slots(slots, cache.shape[0] * page_size), slots, -1)
    cache_ops().indexer_k_quant_and_cache(
        scaled_input(k, input_scale, input_dtype, input_divide, rotation), kv_cache(cache, page_size, fp8_dtype), slots,
        QUANT_BLOCK, scale_fmt, **preshuffle_kwarg(preshuffle),
    )
