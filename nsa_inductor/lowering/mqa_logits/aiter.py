"""``nsa.mqa_logits`` through aiter's ``fp8_mqa_logits(Q, KV, kv_scales, weights, cu_starts, cu_ends,
clean_logits=True)`` in ``aiter.ops.triton.attention.fp8_mqa_logits`` (``aiter.ops.triton.fp8_mqa_logits`` before
aiter 0.1.10). ``clean_logits`` (aiter >= 0.1.15) defaults to True, and older releases always fill -inf, so it is
never passed: every release writes -inf outside ``[ks, ke)``. From 0.1.15 it returns a column slice of a 256-aligned
buffer, so the result is made contiguous here. aiter asserts a power-of-two head count: the dispatch
(``capability.aiter_refusal``) sends other head counts to the Triton kernel."""

from __future__ import annotations

import functools

import torch

from .._aiter_common import import_first


@functools.cache
def _ragged_logits_fn():
    module = import_first("aiter.ops.triton.attention.fp8_mqa_logits", "aiter.ops.triton.fp8_mqa_logits")
    return module.fp8_mqa_logits


def mqa_logits(q_fp8, k_fp8, k_scale, weights, ks, ke, write_masked=True):
    """Every element: aiter's ``clean_logits`` masks [0, ks) and [ke, N) together (``write_masked`` saves nothing).
    No row or no key: no call (aiter's kernel would launch an empty grid)."""
    if q_fp8.shape[0] == 0 or k_fp8.shape[0] == 0:
        return torch.empty(q_fp8.shape[0], k_fp8.shape[0], dtype=torch.float32, device=q_fp8.device)
    return _ragged_logits_fn()(q_fp8, k_fp8, k_scale, weights, ks, ke).contiguous()
