"""``nsa.topk_indices``: the indexer's top-k of each logits row as int32 column indices, -1 for -inf values.

Set semantics (the order within a row is unspecified) let the kernel select without sorting. aiter's top-k
kernels are not wired: the op runs its Triton kernel on GPUs, the reference elsewhere.
"""

from __future__ import annotations

import torch

from .._common import INT_TYPES, check, check_devices, contiguous, triton_or_reference


def _validate(logits, k, lengths, offset) -> None:
    check("logits", logits, (None, None), (torch.float32,), "[R, N]")
    rows, cols = logits.shape
    if not 0 <= k <= cols:
        raise ValueError(f"k must be in [0, N={cols}], got {k}")
    if lengths is not None:
        check("lengths", lengths, (rows,), INT_TYPES, f"[R={rows}]")
    if offset is not None:
        check("offset", offset, (rows,), INT_TYPES, f"[R={rows}]")
    check_devices(logits=logits, **{n: t for n, t in (("lengths", lengths), ("offset", offset)) if t is not None})


@torch.library.custom_op("nsa::topk_indices", mutates_args=())
def topk_indices(
    logits: torch.Tensor, k: int, lengths: torch.Tensor | None = None, offset: torch.Tensor | None = None
) -> torch.Tensor:
    """``[R, k]`` int32: a top-k set of each row's first ``lengths[r]`` columns (all when ``None``), as column
    minus ``offset[r]``, -1 where the value is -inf. Set semantics: the order within a row is unspecified."""
    _validate(logits, k, lengths, offset)
    run = triton_or_reference("topk_indices", logits.device)
    return run(logits.contiguous(), k, *contiguous(lengths, offset))


@topk_indices.register_fake
def _(logits, k, lengths=None, offset=None):
    _validate(logits, k, lengths, offset)
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)
