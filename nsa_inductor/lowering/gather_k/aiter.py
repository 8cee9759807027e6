"""``nsa.gather_k`` through aiter's ``aiter.ops.cache.cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale,
block_table, cu_seq_lens, preshuffle=False)``; ``dst_scale`` may be ``[N, 4]`` bytes (aiter derives the quant block
from its byte width)."""

from __future__ import annotations

import torch

from ...layout import HEAD_DIM
from .._aiter_common import cache_ops, kv_cache, preshuffle_kwarg


def gather_k(cache, block_table, cu_seqlens, page_size, preshuffle, num_tokens, fp8_dtype):
    """aiter writes only rows below ``cu_seqlens[-1]``; zero-initialised outputs cover the rest."""
    k_fp8 = torch.zeros(num_tokens, HEAD_DIM, dtype=fp8_dtype, device=cache.device)
    k_scale = torch.zeros(num_tokens, dtype=torch.float32, device=cache.device)
    cache_ops().cp_gather_indexer_k_quant_cache(
        kv_cache(cache, page_size, fp8_dtype),
        k_fp8,
        k_scale.view(torch.uint8).view(num_tokens, 4),
        block_table,
        cu_seqlens,
        **preshuffle_kwarg(preshuffle),
    )
    return k_fp8, k_scale
