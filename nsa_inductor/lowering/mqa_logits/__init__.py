"""``nsa.mqa_logits``: the indexer's ragged (prefill) logits over contiguous fp8 K (from ``nsa.gather_k``).

``logit[t, n] = sum_h w[t, h] * relu(q8[t,h] . k8[n] * k_scale[n])`` for ``ks[t] <= n < ke[t]``, -inf elsewhere;
with ``write_masked=False`` the columns from each row's ``ke`` on may be left unwritten (for a reader that stops there).
"""

from __future__ import annotations

import torch

from ...layout import HEAD_DIM
from ...quant import FP8_DTYPES
from .._common import check, check_devices, contiguous, implementation, nsa_op, once_per_signature


@once_per_signature
def _validate(q_fp8, k_fp8, k_scale, weights, ks, ke) -> None:
    check("q_fp8", q_fp8, (None, None, HEAD_DIM), FP8_DTYPES, "[T, H, 128]")
    tokens, heads, _ = q_fp8.shape
    check("k_fp8", k_fp8, (None, HEAD_DIM), (q_fp8.dtype,), "[N, 128] (same fp8 type as q_fp8)")
    num_keys = k_fp8.shape[0]
    check("k_scale", k_scale, (num_keys,), (torch.float32,), f"[N={num_keys}] (N of k_fp8)")
    check("weights", weights, (tokens, heads), (torch.float32,), f"[T={tokens}, H={heads}] (T, H of q_fp8)")
    check("ks", ks, (tokens,), (torch.int32,), f"[T={tokens}] (T of q_fp8)")
    check("ke", ke, (tokens,), (torch.int32,), f"[T={tokens}] (T of q_fp8)")
    check_devices(q_fp8=q_fp8, k_fp8=k_fp8, k_scale=k_scale, weights=weights, ks=ks, ke=ke)


@nsa_op("mqa_logits")
def mqa_logits(
    q_fp8: torch.Tensor,
    k_fp8: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    write_masked: bool = True,
) -> torch.Tensor:
    """Ragged (prefill) logits ``[T, N]`` fp32: row t sees keys ``ks[t] <= n < ke[t]``, -inf elsewhere.

    ``write_masked=False``: the Triton kernel does not write the tiles of columns at or past every one of their rows'
    ``ke`` (what they hold is then unspecified; the columns before ``ke``, -inf below ``ks`` included, are written):
    for a reader that stops at each row's ``ke``, as ``nsa.topk_indices`` with those lengths does."""
    _validate(q_fp8, k_fp8, k_scale, weights, ks, ke)
    args = contiguous(q_fp8, k_fp8, k_scale, weights, ks, ke)
    return implementation("mqa_logits", q_fp8.device, q_fp8.dtype, heads=q_fp8.shape[1])(*args, write_masked)


@mqa_logits.register_fake
def _(q_fp8, k_fp8, k_scale, weights, ks, ke, write_masked=True):
    _validate(q_fp8, k_fp8, k_scale, weights, ks, ke)
    return q_fp8.new_empty((q_fp8.shape[0], k_fp8.shape[0]), dtype=torch.float32)
