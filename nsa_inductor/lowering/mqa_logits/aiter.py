"""``nsa.mqa_logits`` through aiter's ``fp8_mqa_logits(Q, KV, kv_scales, weights, cu_starts, cu_ends,
clean_logits=True)`` in ``aiter.ops.triton.attention.fp8_mqa_logits`` (``aiter.ops.triton.fp8_mqa_logits`` in
older releases, which have no ``clean_logits`` and always fill -inf). It returns a column slice of a 256-aligned
buffer, so the result is made contiguous here."""

from __future__ import annotations

import functools
import inspect

from .._aiter_common import import_first


@functools.cache
def _ragged_logits_fn():
    module = import_first("aiter.ops.triton.attention.fp8_mqa_logits", "aiter.ops.triton.fp8_mqa_logits")
    return module.fp8_mqa_logits


@functools.cache
def _accepts_clean_logits(fn) -> bool:
    return "clean_logits" in inspect.signature(fn).parameters


def mqa_logits(q_fp8, k_fp8, k_scale, weights, ks, ke):
    fn = _ragged_logits_fn()
    extra = {"clean_logits": True} if _accepts_clean_logits(fn) else {}
    return fn(q_fp8, k_fp8, k_scale, weights, ks, ke, **extra).contiguous()
