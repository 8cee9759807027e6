"""The ``nsa`` ops on ROCm through aiter's kernels (DESIGN §4), imported lazily on first use.

Signatures as published in ROCm/aiter (checked against its main branch):
- ``aiter.ops.cache.indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt,
  preshuffle=False)``
- ``aiter.ops.cache.cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens,
  preshuffle=False)``; ``dst_scale`` may be ``[N, 4]`` bytes (aiter derives the quant block from its byte width)
- ``deepgemm_fp8_paged_mqa_logits(q_fp8, kv_cache, weights, out_logits, context_lens, kv_indices, max_model_len,
  Preshuffle=False, KVBlockSize=1, ...)`` in ``aiter.ops.triton.attention.pa_mqa_logits`` (``aiter.ops.triton.
  pa_mqa_logits`` before aiter moved its Triton files into folders, January 2026)
- ``fp8_mqa_logits(Q, KV, kv_scales, weights, cu_starts, cu_ends, clean_logits=True)`` in
  ``aiter.ops.triton.attention.fp8_mqa_logits`` (same move; older releases have no ``clean_logits`` and always
  fill -inf). It returns a column slice of a 256-aligned buffer, so the result is made contiguous here.

The two cache ops only take ``preshuffle`` since aiter added the layout (April 2026), so it is passed only when
set: the flat and row-major layouts keep working with older aiter releases.
aiter's quantizer multiplies by ``1/scale`` and divides ``amax / fmax`` exactly, so with ``scale_fmt="fp32"`` its
bytes can differ from the torch reference by one rounding; ue8m0 scales are powers of two and agree.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch

from ..layout import HEAD_DIM, TOKEN_BYTES
from ..quant import QUANT_BLOCK
from .reference import scaled_input


def _import_first(*names: str):
    errors = []
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("aiter kernel module not found; tried " + "; ".join(errors))


@functools.cache
def _cache_ops():
    return importlib.import_module("aiter.ops.cache")


@functools.cache
def _paged_logits_fn():
    module = _import_first("aiter.ops.triton.attention.pa_mqa_logits", "aiter.ops.triton.pa_mqa_logits")
    return module.deepgemm_fp8_paged_mqa_logits


@functools.cache
def _ragged_logits_fn():
    module = _import_first("aiter.ops.triton.attention.fp8_mqa_logits", "aiter.ops.triton.fp8_mqa_logits")
    return module.fp8_mqa_logits


def _preshuffle_kwarg(preshuffle: bool) -> dict:
    return {"preshuffle": True} if preshuffle else {}


def _kv_cache(cache: torch.Tensor, page_size: int, fp8_dtype: torch.dtype, *extra: int) -> torch.Tensor:
    """aiter's view of the uint8 cache: fp8 ``[num_pages, page_size, *extra, 132]`` over the same bytes."""
    return cache.view(fp8_dtype).view(cache.shape[0], page_size, *extra, TOKEN_BYTES)


def quant_cache_store(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype, input_scale=1.0,
                      input_dtype=None) -> None:
    """aiter quantizes the values as given: the input epilogue runs in torch before it."""
    _cache_ops().indexer_k_quant_and_cache(
        scaled_input(k, input_scale, input_dtype), _kv_cache(cache, page_size, fp8_dtype), slot_mapping.long(),
        QUANT_BLOCK, scale_fmt, **_preshuffle_kwarg(preshuffle),
    )


def gather_k(cache, block_table, cu_seqlens, page_size, preshuffle, num_tokens, fp8_dtype):
    """aiter writes only rows below ``cu_seqlens[-1]``; zero-initialised outputs cover the rest."""
    k_fp8 = torch.zeros(num_tokens, HEAD_DIM, dtype=fp8_dtype, device=cache.device)
    k_scale = torch.zeros(num_tokens, dtype=torch.float32, device=cache.device)
    _cache_ops().cp_gather_indexer_k_quant_cache(
        _kv_cache(cache, page_size, fp8_dtype),
        k_fp8,
        k_scale.view(torch.uint8).view(num_tokens, 4),
        block_table,
        cu_seqlens,
        **_preshuffle_kwarg(preshuffle),
    )
    return k_fp8, k_scale


def paged_mqa_logits(q_fp8, cache, weights, context_lens, block_table, max_len, page_size, preshuffle):
    """aiter writes only the chunks it visits; every column a row may not see is then set to -inf."""
    batch, next_n = q_fp8.shape[:2]
    out = torch.empty(batch * next_n, max_len, dtype=torch.float32, device=q_fp8.device)
    _paged_logits_fn()(
        q_fp8,
        _kv_cache(cache, page_size, q_fp8.dtype, 1),
        weights,
        out,
        context_lens,
        block_table,
        max_len,
        Preshuffle=preshuffle,
        KVBlockSize=page_size,
    )
    cols = torch.arange(max_len, device=out.device)
    limit = context_lens[:, None] - next_n + torch.arange(next_n, device=out.device)[None, :]
    hidden = cols[None, None, :] > limit[:, :, None]
    return out.masked_fill_(hidden.view(batch * next_n, max_len), float("-inf"))


@functools.cache
def _accepts_clean_logits(fn) -> bool:
    return "clean_logits" in inspect.signature(fn).parameters


def mqa_logits(q_fp8, k_fp8, k_scale, weights, ks, ke):
    fn = _ragged_logits_fn()
    extra = {"clean_logits": True} if _accepts_clean_logits(fn) else {}
    return fn(q_fp8, k_fp8, k_scale, weights, ks, ke, **extra).contiguous()
