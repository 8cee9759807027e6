"""Plain-torch reference implementations of the ``nsa`` ops (DESIGN §2 step 4-6, §3, §4).

They run on any device, never synchronise with the host and have static output shapes, so they are also the
CPU path of the ops and the yardstick the GPU kernels are tested against. Inputs are assumed validated.
"""

from __future__ import annotations

import torch

from ..layout import HEAD_DIM, KCacheLayout
from ..quant import QUANT_BLOCK, act_quant

# Largest [rows, heads, keys] fp32 block the logits references materialise at once (1 GiB).
_MAX_SCORE_ELEMENTS = 1 << 28


def quant_cache_store(
    k: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_size: int,
    preshuffle: bool,
    scale_fmt: str,
    fp8_dtype: torch.dtype,
    input_scale: float = 1.0,
    input_dtype: torch.dtype | None = None,
) -> None:
    """``act_quant`` each row of ``k'`` and write values + scale into ``cache`` at its slot (negative = skip)."""
    values, scale = act_quant(scaled_input(k, input_scale, input_dtype), QUANT_BLOCK, scale_fmt, fp8_dtype)
    KCacheLayout(page_size, preshuffle).store(cache, slot_mapping, values, scale.reshape(-1))


def scaled_input(k: torch.Tensor, input_scale: float, input_dtype: torch.dtype | None) -> torch.Tensor:
    """``k * input_scale`` in fp32, rounded to ``input_dtype`` when given; ``k`` itself when there is nothing to do."""
    if input_scale == 1.0 and input_dtype in (None, k.dtype):
        return k
    scaled = k.float() * input_scale
    return scaled if input_dtype is None else scaled.to(input_dtype)


def _slots_of(block_table: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slot of token ``pos`` of sequence ``seq`` (broadcasting); out-of-table pages read page 0."""
    page_col = pos // page_size
    in_table = page_col < block_table.shape[1]
    page = block_table[seq, page_col.clamp(max=block_table.shape[1] - 1)].long()
    return torch.where(in_table, page * page_size + pos % page_size, 0)


def gather_k(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    page_size: int,
    preshuffle: bool,
    num_tokens: int,
    fp8_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy each sequence's tokens out of the paged cache into contiguous rows; rows past the total are zero."""
    layout = KCacheLayout(page_size, preshuffle)
    rows = torch.arange(num_tokens, device=cache.device)
    cu = cu_seqlens.long()
    seq = (torch.searchsorted(cu[1:], rows, right=True)).clamp(max=cu.numel() - 2)
    pos = rows - cu[seq]
    valid = rows < cu[-1]
    num_slots = cache.shape[0] * page_size
    slots = torch.where(valid, _slots_of(block_table, seq, pos.clamp(min=0), page_size), 0).clamp(0, num_slots - 1)
    values, scale = layout.load(cache, slots, fp8_dtype)
    values = torch.where(valid[:, None], values.view(torch.uint8), 0).view(fp8_dtype)
    scale = torch.where(valid, scale, 0.0)
    return values, scale


def paged_mqa_logits(
    q_fp8: torch.Tensor,
    cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_len: int,
    page_size: int,
    preshuffle: bool,
) -> torch.Tensor:
    """Decode logits ``[B*next_n, max_len]``: row ``b*next_n+j`` sees keys ``s <= ctx_b - next_n + j``, else -inf.

    Only the block table's reach (``max_pages * page_size`` columns) can hold keys (contexts fit their table, DESIGN
    §4); the columns past it are -inf without being computed, which keeps a ``max_model_len``-wide call cheap.
    """
    batch, next_n, heads, _ = q_fp8.shape
    layout = KCacheLayout(page_size, preshuffle)
    num_slots = cache.shape[0] * page_size
    reach = min(max_len, block_table.shape[1] * page_size)
    out = torch.full((batch * next_n, max_len), float("-inf"), dtype=torch.float32, device=q_fp8.device)
    cols = torch.arange(reach, device=q_fp8.device)
    rows_per_step = max(1, _MAX_SCORE_ELEMENTS // max(1, (next_n * heads + HEAD_DIM) * reach))
    for b0 in range(0, batch, rows_per_step):
        b1 = min(batch, b0 + rows_per_step)
        ctx = context_lens[b0:b1].long()
        seqs = torch.arange(b1 - b0, device=q_fp8.device)
        visible = cols[None, :] < ctx[:, None]
        slots = torch.where(visible, _slots_of(block_table[b0:b1], seqs[:, None], cols[None, :], page_size), 0)
        values, scale = layout.load(cache, slots.clamp(0, num_slots - 1).reshape(-1), q_fp8.dtype)
        values = values.view(b1 - b0, reach, HEAD_DIM).float()
        scores = torch.einsum("bjhd,bsd->bjhs", q_fp8[b0:b1].float(), values) * scale.view(b1 - b0, 1, 1, reach)
        w = weights.view(batch, next_n, heads, 1)[b0:b1].float()
        logits = (scores.relu() * w).sum(dim=2)
        limit = ctx[:, None] - next_n + torch.arange(next_n, device=q_fp8.device)[None, :]
        mask = cols[None, None, :] <= limit[:, :, None]
        out.view(batch, next_n, max_len)[b0:b1, :, :reach] = torch.where(mask, logits, float("-inf"))
    return out


def mqa_logits(
    q_fp8: torch.Tensor,
    k_fp8: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
) -> torch.Tensor:
    """Ragged (prefill) logits ``[T, N]``: row ``t`` sees keys ``ks[t] <= n < ke[t]``, -inf elsewhere."""
    tokens, heads, _ = q_fp8.shape
    num_keys = k_fp8.shape[0]
    out = torch.empty(tokens, num_keys, dtype=torch.float32, device=q_fp8.device)
    cols = torch.arange(num_keys, device=q_fp8.device)
    k = k_fp8.float()
    rows_per_step = max(1, _MAX_SCORE_ELEMENTS // max(1, heads * num_keys))
    for t0 in range(0, tokens, rows_per_step):
        t1 = min(tokens, t0 + rows_per_step)
        scores = torch.einsum("thd,nd->thn", q_fp8[t0:t1].float(), k) * k_scale.float()[None, None, :]
        logits = (scores.relu() * weights[t0:t1].float()[:, :, None]).sum(dim=1)
        mask = (cols[None, :] >= ks[t0:t1, None]) & (cols[None, :] < ke[t0:t1, None])
        out[t0:t1] = torch.where(mask, logits, float("-inf"))
    return out


def topk_indices(
    logits: torch.Tensor, k: int, lengths: torch.Tensor | None, offset: torch.Tensor | None
) -> torch.Tensor:
    """``[R, k]`` int32: the columns of a top-``k`` set of each row, minus ``offset[r]``; -1 where the value is -inf.

    Only a row's first ``lengths[r]`` columns take part (the rest count as -inf); as sets, the result equals eager's
    ``topk(logits, k)`` indices (minus the offset) with -inf entries replaced by -1, up to ties.
    """
    if lengths is not None:
        cols = torch.arange(logits.shape[1], device=logits.device)
        logits = logits.masked_fill(cols[None, :] >= lengths[:, None], float("-inf"))
    values, indices = torch.topk(logits, k, dim=-1)
    if offset is not None:
        indices = indices - offset[:, None]
    return indices.masked_fill(values == float("-inf"), -1).to(torch.int32)


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
