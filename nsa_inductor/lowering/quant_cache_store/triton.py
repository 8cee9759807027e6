"""Triton kernel of ``nsa.quant_cache_store``: one launch quantizes BLOCK_T rows per program and stores them.

The quantizer rounds onto the fp8 grid itself, so the cache bytes are those of the torch reference on the same
device, also under the Triton interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_common import (cdiv, cuda_isa, launch, layer_norm_rows, load_split_sum, quantize_constants,
                              quantize_rows, rope_arguments, rope_rows, rotate_rows, round_to_bf16, scale_constants,
                              scale_offsets, scale_rows, value_offsets, wait_for_previous_grid)


@triton.jit
def _token_slots(slot_ptr, t, num_tokens, num_slots):
    """Tokens ``t``'s slots (-1 past the tokens) and which of them the store may write: inside ``[0, num_slots)``."""
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    return slot, (slot >= 0) & (slot < num_slots)


@triton.jit
def _quant_store_kernel(
    k_ptr,
    stride_k,
    slot_ptr,
    values_ptr,
    scales_ptr,
    tags_ptr,
    num_tokens,
    num_slots,
    rot_ptr,
    stride_rk,
    stride_rn,
    pos_ptr,
    n_positions,
    rows_per_token,
    cos_ptr,
    sin_ptr,
    stride_cp,
    stride_cj,
    stride_sp,
    stride_sj,
    ln_w_ptr,
    ln_b_ptr,
    ln_eps,
    split_stride,
    SPLITS: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    LAYER_NORM: tl.constexpr,
    ROUND_K: tl.constexpr,
    ROTATE: tl.constexpr,
    SPLIT_ROTATION: tl.constexpr,
    SCALE: tl.constexpr,
    INV_SCALE: tl.constexpr,
    DIVIDE: tl.constexpr,
    ROUND_TO: tl.constexpr,
    FMAX: tl.constexpr,
    INV_FMAX: tl.constexpr,
    UE8M0: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PRESHUFFLE: tl.constexpr,
    MIN_EXP: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
    NAN_CODE: tl.constexpr,
    CUDA_ISA: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SCAN_BLOCK: tl.constexpr,
    COMPARE_BLOCK: tl.constexpr,
    TAGGED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """act_quant of BLOCK_T rows of ``k * SCALE`` (``/`` with ``DIVIDE``: ``scale_rows``; ``k @ R`` first with
    ``ROTATE``: ``rotate_rows``; before that the RoPE of the first ``ROPE_DIM`` lanes: ``rope_rows``) rounded to
    ``ROUND_TO`` ("bf16", "fp16" or ""; ``ROUND_K``: fp32 ``k`` rounded to bf16 as it is loaded, after
    ``LAYER_NORM``: ``layer_norm_rows``; before all, with ``SPLITS``, ``k`` is the split-K partials of the rows:
    ``load_split_sum``), then the fp8 values and fp32 scale of each row go to its slot (bit-identical to the torch
    reference without a rotation: ``quantize_rows``), unless the slot is outside ``[0, num_slots)`` or a later token
    of the store has the same slot (docs/indices.md: the last token writes a shared slot). Each program finds the
    later tokens by scanning the slot mapping past its first row, SCAN_BLOCK slots at a time (8 bytes a token: a few
    KB in decode, read from L2 by every program), and compares its rows with a block's slots, COMPARE_BLOCK at a
    time, only where some slot of the block lies between its rows' lowest and highest: a prefill's increasing slots
    cost one load and two compares a slot, not BLOCK_T compares. That scan grows with the square of the tokens;
    ``TAGGED`` (``_slot_tag_kernel`` ran first) reads each slot's last token from its scale word instead."""
    wait_for_previous_grid(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, 128)
    in_range = t < num_tokens
    slot, writable = _token_slots(slot_ptr, t, num_tokens, num_slots)
    # rows past the last token load 1.0, not 0: tiles with rows of zeros were slower to quantize (BENCHMARKS.md)
    x = load_split_sum(k_ptr + t[:, None].to(tl.int64) * stride_k + d[None, :], in_range[:, None], 1.0, split_stride,
                       SPLITS)
    ln_mean = tl.zeros([BLOCK_T], tl.float32)
    ln_rstd = ln_mean
    if LAYER_NORM:
        x, ln_mean, ln_rstd = layer_norm_rows(x, ln_w_ptr, ln_b_ptr, ln_eps)
    if ROUND_K:
        x = round_to_bf16(x).to(tl.bfloat16)  # (exact: the value is a bf16 one)
    if ROPE_DIM:
        x = rope_rows(x, k_ptr + t.to(tl.int64) * stride_k, in_range, t // rows_per_token, in_range, pos_ptr,
                      n_positions, cos_ptr, sin_ptr, stride_cp, stride_cj, stride_sp, stride_sj, ln_mean, ln_rstd,
                      ln_w_ptr, ln_b_ptr, split_stride, ROPE_DIM, INTERLEAVED, LAYER_NORM, ROUND_K, CUDA_ISA, SPLITS)
    if ROTATE:
        x = rotate_rows(x, rot_ptr, stride_rk, stride_rn, SPLIT_ROTATION, BLOCK_T)
    else:
        x = x.to(tl.float32)
    x = scale_rows(x, SCALE, INV_SCALE, DIVIDE)
    if ROUND_TO == "bf16":
        x = round_to_bf16(x)
    elif ROUND_TO == "fp16":
        x = x.to(tl.float16).to(tl.float32)
    y, scale = quantize_rows(x, values_ptr.dtype.element_ty, FMAX, INV_FMAX, UE8M0, MIN_EXP, SIGNED_ZERO, NAN_CODE,
                             CUDA_ISA)
    page = slot // PAGE_SIZE
    pos = slot % PAGE_SIZE
    overwritten = tl.zeros([BLOCK_T], dtype=tl.int32)
    if TAGGED:  # (only a slot's last token writes its word: another token reads its tag or the scale's bits)
        tag = tl.load(tags_ptr + scale_offsets(page, pos, PAGE_SIZE), mask=writable, other=0)
        overwritten = (tag != _token_tag(t)).to(tl.int32)
    else:
        lowest = tl.min(tl.where(writable, slot, num_slots), axis=0)
        highest = tl.max(tl.where(writable, slot, -1), axis=0)
        for first in range(tl.program_id(0) * BLOCK_T + 1, num_tokens, SCAN_BLOCK):
            later = first + tl.arange(0, SCAN_BLOCK)
            later_slot = tl.load(slot_ptr + later, mask=later < num_tokens, other=-1).to(tl.int64)
            if tl.max(((later_slot >= lowest) & (later_slot <= highest)).to(tl.int32), axis=0) > 0:
                for part in range(first, tl.minimum(first + SCAN_BLOCK, num_tokens), COMPARE_BLOCK):
                    token = part + tl.arange(0, COMPARE_BLOCK)
                    token_slot = tl.load(slot_ptr + token, mask=token < num_tokens, other=-1).to(tl.int64)
                    same = ((token_slot[None, :] == slot[:, None]) & (token[None, :] > t[:, None])
                            & (token < num_tokens)[None, :])
                    overwritten = tl.maximum(overwritten, tl.max(same.to(tl.int32), axis=1))
    keep = writable & (overwritten == 0)
    tl.store(values_ptr + value_offsets(page[:, None], pos[:, None], d[None, :], PAGE_SIZE, PRESHUFFLE), y,
             mask=keep[:, None])
    tl.store(scales_ptr + scale_offsets(page, pos, PAGE_SIZE), scale, mask=keep)


@triton.jit
def _token_tag(t):
    """Token t's tag in a scale word: negative, so no scale's bits (a positive float, or NaN as GPUs and numpy make
    it) equal one, and the smallest is the last token's."""
    return -2 - t


@triton.jit
def _slot_tag_kernel(slot_ptr, tags_ptr, num_tokens, num_slots, PAGE_SIZE: tl.constexpr, CLAIM: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """The scale word of each writable slot, which the store overwrites: 0 (``CLAIM`` False), then (a second launch)
    the smallest tag of the tokens writing the slot, its last token's (``_token_tag``; an atomic min, so the same
    word whatever order the tokens come in)."""
    wait_for_previous_grid(PDL)
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot, writable = _token_slots(slot_ptr, t, num_tokens, num_slots)
    tag = tags_ptr + scale_offsets(slot // PAGE_SIZE, slot % PAGE_SIZE, PAGE_SIZE)
    if CLAIM:
        tl.atomic_min(tag, _token_tag(t), mask=writable)
    else:
        tl.store(tag, tl.zeros([BLOCK], tl.int32), mask=writable)


# From this many tokens the store finds each slot's last token by tags (two small launches first, ~3 µs) instead
# of every program scanning the later tokens' slots (a cost that grows with the square of the tokens: BENCHMARKS.md
# "The K store's duplicate slots by tags").
TAGGED_MIN_TOKENS = 512
TAG_BLOCK = 128

_ROUND_TO = {None: "", torch.bfloat16: "bf16", torch.float16: "fp16"}


def block_tokens(num_tokens: int, rotate: bool) -> int:
    """Tokens per program: 4 without a rotation; with one, a token per program on the fp32 row path up to 256
    tokens (decode), else ``tl.dot`` tiles of 16 (BENCHMARKS.md "The rotation's small tiles")."""
    return 4 if not rotate else 1 if num_tokens <= 256 else 16


def quant_cache_store(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype, input_scale=1.0,
                      input_dtype=None, input_divide=False, rotation=None, rope_cos=None, rope_sin=None, positions=None,
                      rope_interleaved=False, round_k=False, ln_weight=None, ln_bias=None, ln_eps=0.0,
                      k_split_sum=False, block_t: int | None = None, tagged: bool | None = None):
    """Quantize ``k [T,128]`` (``[S, T, 128]`` split-K partials with ``k_split_sum``; after the RoPE and rotation
    prologues and the input epilogue) and store it into ``cache`` at ``slot_mapping``, in one launch; a slot outside
    ``[0, num_slots)`` (negative = padding) writes nothing, and of tokens sharing a slot only the last writes it (both
    decided inside the kernel; from ``TAGGED_MIN_TOKENS`` tokens, or with ``tagged``, by two launches before it that
    mark each slot's last token in the scale word it will write)."""
    num_tokens = k.shape[-2]
    if num_tokens == 0:
        return
    num_slots = cache.shape[0] * page_size
    tags = cache.view(torch.int32)
    tagged = num_tokens >= TAGGED_MIN_TOKENS if tagged is None else tagged
    if tagged:
        for claim in (False, True):
            launch(_slot_tag_kernel, (cdiv(num_tokens, TAG_BLOCK),), slot_mapping, tags, num_tokens, num_slots,
                   PAGE_SIZE=page_size, CLAIM=claim, BLOCK=TAG_BLOCK, num_warps=4)
    block_t = block_t or block_tokens(num_tokens, rotation is not None)
    rot = k if rotation is None else rotation  # any pointer: not read without a rotation
    layer_norm = ln_weight is not None
    ln_weight, ln_bias = (k, k) if ln_weight is None else (ln_weight, ln_bias)  # any pointers: not read without LN
    launch(_quant_store_kernel, (cdiv(num_tokens, block_t),), k, k.stride(-2), slot_mapping, cache.view(fp8_dtype),
           cache.view(torch.float32), tags, num_tokens, num_slots, rot,
           *(rot.stride() if rotation is not None else (0, 0)),
           *rope_arguments(k, num_tokens, rope_cos, rope_sin, positions), ln_weight, ln_bias, float(ln_eps),
           k.stride(0), SPLITS=k.shape[0] if k_split_sum else 0,
           ROPE_DIM=0 if rope_cos is None else 2 * rope_cos.shape[1], INTERLEAVED=rope_interleaved,
           LAYER_NORM=layer_norm, ROUND_K=round_k, ROTATE=rotation is not None,
           SPLIT_ROTATION=rotation is not None and rotation.dtype == torch.float32,
           **scale_constants(input_scale, input_divide), ROUND_TO=_ROUND_TO[input_dtype], PAGE_SIZE=page_size,
           PRESHUFFLE=preshuffle, **quantize_constants(fp8_dtype, None, scale_fmt),
           CUDA_ISA=cuda_isa(_quant_store_kernel), BLOCK_T=block_t, SCAN_BLOCK=1024, COMPARE_BLOCK=128, TAGGED=tagged,
           num_warps=4)
