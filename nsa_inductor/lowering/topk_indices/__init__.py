"""``nsa.topk_indices``: the indexer's top-k of each logits row as int32 column indices.

``sorted=False`` (set order) lets the kernel select without sorting; ``sorted=True`` keeps torch.topk's descending
value order. ``pad`` says what fills a row with fewer than k finite values: ``"neg1"`` (-1, the masked idiom) or
``"column"`` (distinct columns of -inf entries, as plain ``torch.topk`` returns). On ROCm, aiter's
``top_k_per_row_decode`` serves set-order calls where ``capability.aiter_refusal`` allows; other GPU calls run the
Triton kernel, CPU calls the reference.
"""

from __future__ import annotations

import torch

from .._common import INT_TYPES, check, check_devices, contiguous, implementation, nsa_op, once_per_signature


PADS = ("neg1", "column")


@once_per_signature
def _validate(logits, k, lengths, offset, pad) -> None:
    check("logits", logits, (None, None), (torch.float32,), "[R, N]")
    rows, cols = logits.shape
    if not 0 <= k <= cols:
        raise ValueError(f"k must be in [0, N={cols}], got {k}")
    if pad not in PADS:
        raise ValueError(f"pad must be one of {PADS}, got {pad!r}")
    if lengths is not None:
        check("lengths", lengths, (rows,), INT_TYPES, f"[R={rows}] (R of logits)")
    if offset is not None:
        check("offset", offset, (rows,), INT_TYPES, f"[R={rows}] (R of logits)")
    check_devices(logits=logits, **{n: t for n, t in (("lengths", lengths), ("offset", offset)) if t is not None})


@nsa_op("topk_indices")
def topk_indices(
    logits: torch.Tensor, k: int, lengths: torch.Tensor | None = None, offset: torch.Tensor | None = None,
    pad: str = "neg1", sorted: bool = False,
) -> torch.Tensor:
    """``[R, k]`` int32: a top-k set of each row's first ``lengths[r]`` columns (all when ``None``; the others count
    as -inf), as column minus ``offset[r]``. Entries for -inf values are -1 (``pad="neg1"``) or distinct columns of
    -inf entries (``pad="column"``). ``sorted``: descending value order (ties in any order); else any order. On
    the Triton and torch paths the same call gives the same output, slot for slot (the ties taken and the order
    never depend on how the GPU schedules programs); aiter's is not known to."""
    _validate(logits, k, lengths, offset, pad)
    run = implementation("topk_indices", logits.device, None, sorted=sorted)
    return run(logits.contiguous(), k, *contiguous(lengths, offset), pad, sorted)


@topk_indices.register_fake
def _(logits, k, lengths=None, offset=None, pad="neg1", sorted=False):
    _validate(logits, k, lengths, offset, pad)
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)
