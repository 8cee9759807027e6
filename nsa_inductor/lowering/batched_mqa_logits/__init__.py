"""``nsa.batched_mqa_logits``: indexer logits over plain bf16/fp16 q and K, one K per batch entry (no fp8, no cache),
as Hugging Face's DeepSeek-V3.2 indexer scores them: ``relu(q.float() @ k.float()^T * scale)`` summed over heads
with fp32 weights. The scores tensor ``[B, S, H, T]`` eager and Inductor write and read back is never formed, and
with the indexer's boolean mask (``masked_fill(~mask, -inf)`` after the scores) neither are the masked ones: keys no
row of a tile keeps are not read, tiles nobody keeps not computed (the fill, -inf or another number, written there).

``out[b, s, t] = sum_h w[b, s, h] * relu((q[b, s, h] . k[b, t]) * scale)`` in fp32 (the products of bf16/fp16
values are exact in fp32; only the order of the sums differs from a GEMM's). aiter has no kernel for it: Triton on
GPUs, the reference elsewhere.
"""

from __future__ import annotations

import math

import torch

from .._common import check, check_devices, nsa_op, once_per_signature, triton_or_reference

DTYPES = (torch.bfloat16, torch.float16)


@once_per_signature
def _validate(q, k, weights, scale, scale_tensor, mask) -> None:
    check("q", q, (None, None, None, None), DTYPES, "[B, S, H, D]")
    batch, tokens, heads, dim = q.shape
    check("k", k, (batch, None, dim), (q.dtype,), f"[B={batch}, T, D={dim}] (same dtype as q)")
    check("weights", weights, (batch, tokens, heads), (torch.float32,), f"[B={batch}, S={tokens}, H={heads}]")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if scale_tensor is not None:
        check("scale_tensor", scale_tensor, (), (torch.float32,), "[] (one value)")
    if mask is not None:
        check("mask", mask, (batch, tokens, k.shape[1]), (torch.bool,),
              f"[B={batch}, S={tokens}, T={k.shape[1]}] (any strides: a broadcast mask expanded)")
    optional = {name: t for name, t in (("scale_tensor", scale_tensor), ("mask", mask)) if t is not None}
    check_devices(q=q, k=k, weights=weights, **optional)


@nsa_op("batched_mqa_logits")
def batched_mqa_logits(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float,
                       scale_tensor: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                       fill: float | None = None) -> torch.Tensor:
    """Logits ``[B, S, T]`` fp32 of q ``[B, S, H, D]`` against k ``[B, T, D]`` (bf16 or fp16, the same),
    weights ``[B, S, H]`` fp32: ``sum_h weights * relu(q.k * scale)``, every element written.
    ``scale_tensor``: a 0-d fp32 tensor multiplying ``q.k * scale`` too (a scale that is a graph input, as Dynamo
    passes an unspecialised float). ``mask``: bool ``[B, S, T]`` (any strides); where it is False the logits are
    ``fill`` (None: -inf), as ``logits.masked_fill(~mask, fill)``."""
    _validate(q, k, weights, scale, scale_tensor, mask)
    q, k, weights = (t.contiguous() for t in (q, k, weights))
    return triton_or_reference("batched_mqa_logits", q.device)(q, k, weights, scale, scale_tensor, mask, fill)


@batched_mqa_logits.register_fake
def _(q, k, weights, scale, scale_tensor=None, mask=None, fill=None):
    _validate(q, k, weights, scale, scale_tensor, mask)
    return q.new_empty((q.shape[0], q.shape[1], k.shape[1]), dtype=torch.float32)
