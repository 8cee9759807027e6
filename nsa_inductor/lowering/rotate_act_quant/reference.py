"""Torch reference of ``nsa.rotate_act_quant``: any device, no host synchronisation, static output shapes; the op's
CPU path and the yardstick its GPU kernel is tested against. Eager's own math (an fp32 GEMM), written independently
of the kernel. Inputs are assumed validated."""

from __future__ import annotations

import torch

from ...quant import act_quant
from .._common import roped


def rotate_act_quant(x, rotation, scale, divide, quant_block, scale_fmt, fp8_dtype, fp8_max, rope_cos=None,
                     rope_sin=None, positions=None, rope_interleaved=False):
    """``act_quant(((x'.float() @ rotation) * scale).to(bf16))`` (``/ scale`` with ``divide``) in groups of
    ``quant_block``; ``x'``: x after the RoPE prologue (``roped``)."""
    product = roped(x, rope_cos, rope_sin, positions, rope_interleaved).float() @ rotation.float()
    rotated = (product / scale if divide else product * scale).to(torch.bfloat16)
    return act_quant(rotated, quant_block, scale_fmt, fp8_dtype, fp8_max)
