"""``nsa.topk_indices`` through aiter's ``aiter.ops.topk.top_k_per_row_decode(logits, next_n, seqLens, indices,
numRows, stride0, stride1, k=2048)`` (``k`` from aiter 0.1.14; the dispatch uses it from 0.1.17, where decode always
runs one block per row: ``capability.aiter_refusal``).

What aiter computes (``csrc/kernels/topk_per_row_kernels.cu``): row r covers columns ``[0, seqLens[r // next_n] -
next_n + r % next_n + 1)`` of the fp32 row at ``logits + r * stride0``; ``stride1`` is ignored, so a row's columns
must be contiguous. A row no longer than k gets its columns ``0 .. len-1`` in column order, then -1; a longer row gets
a radix-selected top-k set in no particular order (ties in any order; its ``sorted`` flag is unused), as absolute
columns, -inf values included. ``seqLens`` and ``indices`` are read as int32, ``indices`` as ``[numRows, k]``.

Adapting that to the op, with ``next_n = 1`` so that ``seqLens`` is the op's per-row length:

- lengths are clamped to ``[0, N]``: aiter would read past the row (into the next one; past the tensor for the last);
- ``pad="neg1"``: entries whose logit is -inf become -1 (aiter returns those columns, eager masks them);
- ``pad="column"``: the -1 past a short row's length at slot j becomes column j. Slots ``0 .. len-1`` hold the row's
  own columns, so these are distinct columns past the length, which count as -inf;
- ``offset`` is subtracted from every entry that is a column.

``sorted=True`` never comes here (aiter's order is not by value). ``top_k_per_row_prefill`` is not used: the op has
no row starts, its multi-block path is chosen from the allocated width ``stride0`` rather than the lengths (the
reason aiter took decode off that path), and its positional signature changed in 0.1.8 (``values`` was inserted).
- NaN: aiter's key is the float's bits, flipped for a clear sign bit, so a NaN with the sign bit set would rank below
  -inf; torch ranks every NaN highest. Rows are given to aiter with every NaN's sign bit cleared (one elementwise
  pass over the logits).
"""

from __future__ import annotations

import functools
import importlib

import torch


@functools.cache
def _topk_ops():
    return importlib.import_module("aiter.ops.topk")


def topk_indices(logits, k, lengths, offset, pad="neg1", sorted=False):
    """The op's result (see ``nsa.topk_indices``) from aiter's decode top-k, adapted as the module docstring says."""
    if sorted:
        raise ValueError("aiter's top-k returns an unordered set: sorted=True runs the Triton kernel")
    rows, cols = logits.shape
    out = torch.empty(rows, k, dtype=torch.int32, device=logits.device)
    if rows == 0 or k == 0:
        return out
    # a NaN of either sign ranks highest, as in torch; the result is also the row-contiguous copy aiter reads
    logits = torch.where(logits.isnan(), float("nan"), logits).contiguous()
    if lengths is None:
        row_lengths = torch.full((rows,), cols, dtype=torch.int32, device=logits.device)
    else:
        row_lengths = lengths.clamp(0, cols).to(torch.int32)
    _topk_ops().top_k_per_row_decode(logits, 1, row_lengths, out, rows, logits.stride(0), 1, k=k)
    kept = None
    if pad == "column":
        out = torch.where(out < 0, torch.arange(k, dtype=torch.int32, device=out.device), out)
    else:
        kept = (out >= 0) & (logits.gather(1, out.clamp(min=0).long()) != float("-inf"))
    if offset is not None:
        out = out - offset[:, None]
    if kept is not None:
        out = torch.where(kept, out, -1)
    return out.to(torch.int32)
