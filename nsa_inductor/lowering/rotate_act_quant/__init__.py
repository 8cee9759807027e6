"""``nsa.rotate_act_quant``: the indexer's Hadamard rotation and the act_quant after it, as one op.

``y = ((x.float() @ rotation) * scale).to(bf16)`` (``/ scale`` with ``divide``; eager's ``rotate_activation``),
then ``act_quant(y)``: fp8 values and one fp32 scale per ``quant_block`` group. The Triton kernel multiplies one
or two rows a program in fp32 (decode sizes), or a tile of rows with ``tl.dot`` (an fp32 rotation split into bf16
hi + lo in registers, so any static 128x128 matrix is applied to ~16 bits and a +-1 Hadamard exactly), so neither
the fp32 GEMM output nor the bf16 rotated rows reach memory. The products are summed in another order than cuBLAS:
docs/numerics.md states which bytes may differ. aiter has no kernel for it: Triton on GPUs, the reference elsewhere.
"""

from __future__ import annotations

import torch

from ...layout import HEAD_DIM
from ...quant import ROTATED_QUANT_BLOCKS, check_scale_fmt, fp8_max as dtype_fp8_max
from .._common import (check, check_devices, check_fp8, check_rope, check_rotation, contiguous, describe, nsa_op,
                       once_per_signature, triton_or_reference)


@once_per_signature
def _validate(x, rotation, scale, divide, quant_block, scale_fmt, fp8_dtype, fp8_max, rope_cos, rope_sin,
              positions) -> None:
    check_scale_fmt(scale_fmt)
    check_fp8("fp8_dtype", fp8_dtype)
    if x.dim() < 1:
        raise ValueError(f"x must be bfloat16 [..., 128], got {describe(x)}")
    check("x", x, (None,) * (x.dim() - 1) + (HEAD_DIM,), (torch.bfloat16,), "[..., 128]")
    check_rotation(rotation)
    if quant_block not in ROTATED_QUANT_BLOCKS:
        raise ValueError(f"quant_block must be one of {ROTATED_QUANT_BLOCKS} (groups of the 128 rotated values), got "
                         f"{quant_block}")
    if not 0 < fp8_max <= dtype_fp8_max(fp8_dtype):
        raise ValueError(f"fp8_max must be in (0, {dtype_fp8_max(fp8_dtype)}] for {fp8_dtype}, got {fp8_max}")
    if not scale == scale or scale in (float("inf"), float("-inf")) or divide and scale == 0:
        raise ValueError(f"scale must be a finite float (nonzero with divide), got {scale}")
    check_rope(x, rope_cos, rope_sin, positions)
    check_devices(x=x, rotation=rotation, **({} if rope_cos is None else {
        "rope_cos": rope_cos, "rope_sin": rope_sin, "positions": positions}))


def _scale_shape(x: torch.Tensor, quant_block: int) -> list:
    return [*x.shape[:-1], HEAD_DIM // quant_block]


@nsa_op("rotate_act_quant")
def rotate_act_quant(x: torch.Tensor, rotation: torch.Tensor, scale: float, divide: bool, quant_block: int,
                     scale_fmt: str, fp8_dtype: torch.dtype, fp8_max: float, rope_cos: torch.Tensor | None = None,
                     rope_sin: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                     rope_interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``act_quant(((x.float() @ rotation) * scale).to(bf16))`` (``/ scale`` with ``divide``): ``(values fp8
    [..., 128], scale fp32 [..., 128 // quant_block])``, values clamped to ``fp8_max`` (the type's own max or less:
    224 for fnuz q in SGLang).

    ``x``: bf16 ``[..., 128]``; ``rotation``: ``[128, 128]`` fp32 or bf16, any strides. With ``rope_cos`` /
    ``rope_sin`` (fp32 ``[P, r/2]``, any strides) and ``positions`` (``[T]``, x's first dim), eager's RoPE
    (``indexer.apply_rope``, interleaved pairs with ``rope_interleaved``) first turns the first ``r`` lanes of each
    row of token ``t`` by ``positions[t]`` (docs/passes/rope_prologue.md)."""
    _validate(x, rotation, scale, divide, quant_block, scale_fmt, fp8_dtype, fp8_max, rope_cos, rope_sin, positions)
    x, positions = contiguous(x, positions)
    run = triton_or_reference("rotate_act_quant", x.device, fp8_dtype)
    return run(x, rotation, scale, divide, quant_block, scale_fmt, fp8_dtype, fp8_max, rope_cos, rope_sin, positions,
               rope_interleaved)


@rotate_act_quant.register_fake
def _(x, rotation, scale, divide, quant_block, scale_fmt, fp8_dtype, fp8_max, rope_cos=None, rope_sin=None,
      positions=None, rope_interleaved=False):
    _validate(x, rotation, scale, divide, quant_block, scale_fmt, fp8_dtype, fp8_max, rope_cos, rope_sin, positions)
    return x.new_empty(x.shape, dtype=fp8_dtype), x.new_empty(_scale_shape(x, quant_block), dtype=torch.float32)
