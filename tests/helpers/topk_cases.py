"""Top-k test cases shared by the op tests and the topk_indices pass tests: logits with distinct values (some -inf),
the case generator, and what the indexer computes eagerly, found by sorting in Python."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

HYP = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def eager_topk_rows(logits, k, lengths=None, offset=None) -> list[list[int]]:
    """What the indexer computes eagerly, found by sorting each row in Python (columns past ``lengths`` count as
    -inf; finite values must be distinct): the k largest columns minus the offset, -1 for -inf ones, sorted."""
    rows = []
    for r, row in enumerate(logits.tolist()):
        visible = len(row) if lengths is None else max(0, min(int(lengths[r]), len(row)))
        ranked = sorted(((v if c < visible else -math.inf, c) for c, v in enumerate(row)), key=lambda vc: -vc[0])
        shift = 0 if offset is None else int(offset[r])
        rows.append(sorted(-1 if v == -math.inf else c - shift for v, c in ranked[:k]))
    return rows


def topk_logits(rows, cols, neg_inf_fraction, seed) -> torch.Tensor:
    """Distinct values (no ties at the k-th value), some -inf."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randperm(rows * cols, generator=gen).float().view(rows, cols) / 7 - rows * cols / 14
    return logits.masked_fill(torch.rand(rows, cols, generator=gen) < neg_inf_fraction, float("-inf"))


def topk_case(rows, cols, k_frac, inf, with_lengths, with_offset, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, cols + 3, (rows,), generator=gen).int() if with_lengths else None
    offset = torch.randint(0, 5, (rows,), generator=gen) if with_offset else None
    return topk_logits(rows, cols, inf, seed), round(k_frac * cols), lengths, offset


TOPK_CASES = dict(rows=st.integers(1, 5), cols=st.integers(1, 80), k_frac=st.floats(0, 1),
                  inf=st.sampled_from([0, 0.3, 1.0]), with_lengths=st.booleans(), with_offset=st.booleans(),
                  seed=st.integers(0, 99))
