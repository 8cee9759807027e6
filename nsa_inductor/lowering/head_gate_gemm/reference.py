"""Torch reference of ``nsa.head_gate_gemm``: any device, no host synchronisation, static output shapes; the op's CPU
path and the yardstick its GPU kernels are tested against. Inputs are assumed validated."""

from __future__ import annotations

import torch

# Split-K chunks of ``nsa.head_gate_gemm`` start on multiples of the Triton kernel's K tile.
HEAD_GATE_K_ALIGN = 64


def head_gate_chunk(k: int, splits: int) -> int:
    """Columns of K in each of ``splits`` chunks: ``ceil(K / splits)`` rounded up to a multiple of 64 (the last
    chunks may be short or empty)."""
    per_split = -(-k // splits)
    return -(-per_split // HEAD_GATE_K_ALIGN) * HEAD_GATE_K_ALIGN


def head_gate_weight(weight: torch.Tensor, round_weight: bool) -> torch.Tensor:
    """The fp32 values ``nsa.head_gate_gemm`` multiplies by. A bf16 weight as is; an fp32 one rounded to bf16
    (``round_weight``), or split into ``hi`` (W with its low 16 bits cleared, exactly a bf16) plus
    ``lo = bf16(W - hi)`` (nearest even): two bf16 values whose sum is exact in fp32 (~16 significant bits of W)."""
    if weight.dtype == torch.bfloat16:
        return weight.float()
    if round_weight:
        return weight.to(torch.bfloat16).float()
    hi = (weight.view(torch.int32) & -65536).view(torch.float32)
    return hi + (weight - hi).to(torch.bfloat16).float()


def head_gate_gemm(x: torch.Tensor, weight: torch.Tensor, splits: int, round_weight: bool) -> torch.Tensor:
    """``[splits, M, N]`` fp32: partial ``s`` is ``x[:, chunk s] @ w[:, chunk s]^T`` over the K columns
    ``[s * chunk, (s + 1) * chunk)`` (zero where that range is empty), ``w`` from ``head_gate_weight``. K is padded
    with zeros to ``splits * chunk`` so that every chunk is one slice of a ``[.., splits, chunk]`` view."""
    rows, k = x.shape
    chunk = head_gate_chunk(k, splits)
    pad = splits * chunk - k
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(rows, splits, chunk)
    w = torch.nn.functional.pad(head_gate_weight(weight, round_weight), (0, pad)).view(weight.shape[0], splits, chunk)
    return torch.einsum("msc,nsc->smn", xf, w).contiguous()  # the layout the fake (and Inductor) assume
