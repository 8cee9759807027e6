"""Triton kernel of ``nsa.quant_cache_store``: one launch quantizes BLOCK_T rows per program and stores them.

The quantizer rounds onto the fp8 grid itself, so the cache bytes are those of the torch reference on the same
device, also under the Triton interpreter.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ...quant import AMAX_FLOOR, fp8_max
from .._triton_common import interpreted, round_to_bf16, scale_offsets, value_offsets

_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)


@triton.jit
def _round_to_fp8_grid(y, sign_of, MIN_EXP: tl.constexpr, SIGNED_ZERO: tl.constexpr):
    """Round fp32 ``y`` (already within +-fmax) to the nearest e4m3 value, ties to even, still in fp32.

    The fp8 cast after it is then exact on every backend, so the bytes do not depend on how a backend rounds
    (the Triton interpreter's own cast truncates and drops carries). e4m3 keeps 3 mantissa bits: the grid step is
    ``2^(e-3)`` with ``e`` the exponent of ``y``, floored at the smallest normal exponent ``MIN_EXP``
    (subnormals). Adding and subtracting 1.5 * 2^23 rounds a float below 2^22 to an integer, ties to even.
    fnuz has no negative zero (its 0x80 is NaN), hence ``SIGNED_ZERO``. The sign comes from ``sign_of`` (the
    unscaled input: the scale is positive) and is set as a bit: a GPU clamp or negation may turn -0.0 into +0.0.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign_negative = sign_of.to(tl.int32, bitcast=True) < 0
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)
    r = ((tl.abs(y) * inv_step + 12582912.0) - 12582912.0) * step
    if SIGNED_ZERO:
        negative = sign_negative
    else:
        negative = sign_negative & (r > 0.0)
    return (r.to(tl.int32, bitcast=True) | (negative.to(tl.int32) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _quant_store_kernel(
    k_ptr,
    stride_k,
    slot_ptr,
    values_ptr,
    scales_ptr,
    num_tokens,
    num_slots,
    INPUT_SCALE: tl.constexpr,
    ROUND_TO: tl.constexpr,
    FMAX: tl.constexpr,
    INV_FMAX: tl.constexpr,
    UE8M0: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PRESHUFFLE: tl.constexpr,
    MIN_EXP: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
    NAN_CODE: tl.constexpr,
    ON_GPU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SCAN_BLOCK: tl.constexpr,
):
    """act_quant of BLOCK_T rows of ``k * INPUT_SCALE`` (rounded to ``ROUND_TO``: "bf16", "fp16" or ""), then the
    fp8 values and fp32 scale of each row go to its slot, unless it is outside ``[0, num_slots)`` or a later token
    of the store has the same slot (docs/indices.md: the last token writes a shared slot). Each program finds the
    later tokens by scanning the slot mapping past its first row, SCAN_BLOCK slots at a time (8 bytes a token: a
    few KB in decode, read from L2 by every program).

    Bit-identical to the torch reference on the same device: torch on a GPU computes ``amax / fmax`` as
    ``amax * (1/fmax)`` (scalar divisor) and log2/exp2 with the device math library (libdevice/ocml); on the host
    (interpreter) it divides exactly. ``x / scale`` is an IEEE division in both.
    """
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, 128)
    in_range = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=in_range, other=-1).to(tl.int64)
    x = tl.load(k_ptr + t[:, None].to(tl.int64) * stride_k + d[None, :], mask=in_range[:, None], other=0.0)
    x = x.to(tl.float32)
    if INPUT_SCALE != 1.0:
        x = x * INPUT_SCALE
    if ROUND_TO == "bf16":
        x = round_to_bf16(x)
    elif ROUND_TO == "fp16":
        x = x.to(tl.float16).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), _AMAX_FLOOR)
    amax = tl.where(tl.max((x != x).to(tl.int32), axis=1) > 0, float("nan"), amax)  # GPU max/maximum drop NaN
    if ON_GPU:
        scale = amax * INV_FMAX
    else:
        scale = tl.math.div_rn(amax, FMAX)
    if UE8M0:
        if ON_GPU:
            scale = libdevice.exp2(tl.math.ceil(libdevice.log2(scale)))
        else:
            scale = tl.exp2(tl.math.ceil(tl.log2(scale)))
    quotient = tl.math.div_rn(x, scale[:, None])
    y = _round_to_fp8_grid(tl.clamp(quotient, -FMAX, FMAX), x, MIN_EXP, SIGNED_ZERO)
    # NaN stays NaN, as its fp8 code: the interpreter's fp8 cast turns NaN into +-inf's bits
    y = tl.where(quotient != quotient, NAN_CODE, y.to(values_ptr.dtype.element_ty).to(tl.uint8, bitcast=True))
    y = y.to(values_ptr.dtype.element_ty, bitcast=True)
    overwritten = tl.zeros([BLOCK_T], dtype=tl.int32)
    for first in range(tl.program_id(0) * BLOCK_T + 1, num_tokens, SCAN_BLOCK):
        later = first + tl.arange(0, SCAN_BLOCK)
        later_slot = tl.load(slot_ptr + later, mask=later < num_tokens, other=-1).to(tl.int64)
        same = (later_slot[None, :] == slot[:, None]) & (later[None, :] > t[:, None]) & (later < num_tokens)[None, :]
        overwritten = tl.maximum(overwritten, tl.max(same.to(tl.int32), axis=1))
    keep = (slot >= 0) & (slot < num_slots) & (overwritten == 0)
    page = slot // PAGE_SIZE
    pos = slot % PAGE_SIZE
    tl.store(values_ptr + value_offsets(page[:, None], pos[:, None], d[None, :], PAGE_SIZE, PRESHUFFLE), y,
             mask=keep[:, None])
    tl.store(scales_ptr + scale_offsets(page, pos, PAGE_SIZE), scale, mask=keep)


_ROUND_TO = {None: "", torch.bfloat16: "bf16", torch.float16: "fp16"}


def quant_cache_store(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype, input_scale=1.0,
                      input_dtype=None, block_t: int = 4):
    """One launch: quantize ``k [T,128]`` (after the input epilogue) and store it into ``cache`` at
    ``slot_mapping``; a slot outside ``[0, num_slots)`` (negative = padding) writes nothing, and of tokens sharing
    a slot only the last writes it (both decided inside the kernel)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    fmax = fp8_max(fp8_dtype)
    kernel = _quant_store_kernel
    kernel[(triton.cdiv(num_tokens, block_t),)](
        k,
        k.stride(0),
        slot_mapping,
        cache.view(fp8_dtype),
        cache.view(torch.float32),
        num_tokens,
        cache.shape[0] * page_size,
        INPUT_SCALE=float(input_scale),
        ROUND_TO=_ROUND_TO[input_dtype],
        FMAX=fmax,
        INV_FMAX=float(np.float32(1.0) / np.float32(fmax)),
        UE8M0=scale_fmt == "ue8m0",
        PAGE_SIZE=page_size,
        PRESHUFFLE=preshuffle,
        MIN_EXP=1 - (8 if fp8_dtype == torch.float8_e4m3fnuz else 7),
        SIGNED_ZERO=fp8_dtype == torch.float8_e4m3fn,
        NAN_CODE=0x7F if fp8_dtype == torch.float8_e4m3fn else 0x80,
        ON_GPU=not interpreted(kernel),
        BLOCK_T=block_t,
        SCAN_BLOCK=128,
        num_warps=4,
    )
