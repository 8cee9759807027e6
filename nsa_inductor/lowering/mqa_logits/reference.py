"""Torch reference of ``nsa.mqa_logits``: any device, no host synchronisation, static output shapes; the op's CPU
path and the yardstick its GPU kernels are tested against. Inputs are assumed validated."""

from __future__ import annotations

import torch

from .._common import MAX_SCORE_ELEMENTS


def mqa_logits(q_fp8, k_fp8, k_scale, weights, ks, ke, write_masked=True) -> torch.Tensor:
    """Ragged (prefill) logits ``[T, N]``: row ``t`` sees keys ``ks[t] <= n < ke[t]``, -inf elsewhere; without
    ``write_masked``, NaN from ``ke[t]`` on (unspecified there: NaN, which a top-k ranks first, makes a reader past
    ``ke`` visible in CPU tests)."""
    tokens, heads, _ = q_fp8.shape
    num_keys = k_fp8.shape[0]
    out = torch.empty(tokens, num_keys, dtype=torch.float32, device=q_fp8.device)
    cols = torch.arange(num_keys, device=q_fp8.device)
    k = k_fp8.float()
    rows_per_step = max(1, MAX_SCORE_ELEMENTS // max(1, heads * num_keys))
    for t0 in range(0, tokens, rows_per_step):
        t1 = min(tokens, t0 + rows_per_step)
        scores = torch.einsum("thd,nd->thn", q_fp8[t0:t1].float(), k) * k_scale.float()[None, None, :]
        logits = (scores.relu() * weights[t0:t1].float()[:, :, None]).sum(dim=1)
        mask = (cols[None, :] >= ks[t0:t1, None]) & (cols[None, :] < ke[t0:t1, None])
        out[t0:t1] = torch.where(mask, logits, float("-inf"))
    if not write_masked:
        out.masked_fill_(cols[None, :] >= ke[:, None], float("nan"))
    return out
