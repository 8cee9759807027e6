"""``nsa.gather_k`` through aiter's ``aiter.ops.cache.cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale,
block_table, cu_seq_lens, preshuffle=False)``; ``dst_scale`` may be ``[N, 4]`` bytes (aiter derives the quant block
from its byte width).

Not reached through the op's dispatch (``capability.aiter_refusal("gather_k")``): aiter needs the output row count
to equal ``cu_seq_lens[-1]`` (each row looks up its sequence in ``cu_seq_lens``; a row past the end reads an
uninitialised batch index and indexes ``block_table`` and the cache with it), while the op allows
``num_tokens > cu_seqlens[-1]`` and ``cu_seqlens[-1]`` is a device value that cannot be compared without a host
sync. The function is kept for a caller that knows the two are equal."""

from __future__ import annotations

import torch

from ...layout import HEAD_DIM
from .._aiter_common import cache_ops, kv_cache, preshuffle_kwarg


def gather_k(cache, block_table, cu_seqlens, page_size, preshuffle, num_tokens, fp8_dtype):
    """Only for ``num_tokens == cu_seqlens[-1]`` (see the module docstring)."""
    k_fp8 = torch.empty(num_tokens, HEAD_DIM, dtype=fp8_dtype, device=cache.device)
    k_scale = torch.empty(num_tokens, dtype=torch.float32, device=cache.device)
    cache_ops().cp_gather_indexer_k_quant_cache(
        kv_cache(cache, page_size, fp8_dtype),
        k_fp8,
        k_scale.view(torch.uint8).view(num_tokens, 4),
        block_table,
        cu_seqlens,
        **preshuffle_kwarg(preshuffle),
    )
    return k_fp8, k_scale
