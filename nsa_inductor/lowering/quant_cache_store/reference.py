"""Torch reference of ``nsa.quant_cache_store``: any device, no host synchronisation, static output shapes; the op's CPU
path and the yardstick its GPU kernels are tested against. Inputs are assumed validated."""

from __future__ import annotations

import torch

from ...layout import KCacheLayout
from ...quant import QUANT_BLOCK, act_quant
from .._common import roped


def quant_cache_store(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype, input_scale=1.0,
                      input_dtype=None, input_divide=False, rotation=None, rope_cos=None, rope_sin=None, positions=None,
                      rope_interleaved=False, round_k=False, ln_weight=None, ln_bias=None, ln_eps=0.0,
                      k_split_sum=False) -> None:
    """``act_quant`` each row of ``k'`` and write values + scale into ``cache`` at its slot (negative = skip)."""
    k = prologue_rows(k, rope_cos, rope_sin, positions, rope_interleaved, round_k, ln_weight, ln_bias, ln_eps,
                      k_split_sum)
    k = scaled_input(k, input_scale, input_dtype, input_divide, rotation)
    values, scale = act_quant(k, QUANT_BLOCK, scale_fmt, fp8_dtype)
    KCacheLayout(page_size, preshuffle).store(cache, slot_mapping, values, scale.reshape(-1))


def prologue_rows(k, rope_cos, rope_sin, positions, rope_interleaved, round_k, ln_weight, ln_bias, ln_eps,
                  k_split_sum) -> torch.Tensor:
    """The rows after the prologues, in the op's order: the split-K sum, LayerNorm, bf16 rounding, RoPE."""
    if k_split_sum:
        k = split_sum(k)
    if ln_weight is not None:
        k = torch.nn.functional.layer_norm(k, (k.shape[-1],), ln_weight, ln_bias, ln_eps)
    return roped(k.to(torch.bfloat16) if round_k else k, rope_cos, rope_sin, positions, rope_interleaved)


def split_sum(partials: torch.Tensor) -> torch.Tensor:
    """``partials[0] + partials[1] + ...`` (left to right, as pointwise adds) rounded to bf16, back in fp32."""
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial
    return total.to(torch.bfloat16).float()


def scaled_input(k: torch.Tensor, input_scale: float, input_dtype: torch.dtype | None, input_divide: bool = False,
                 rotation: torch.Tensor | None = None) -> torch.Tensor:
    """``(k.float() @ rotation) * input_scale`` (``/`` with ``input_divide``) in fp32 (eager's fp32 GEMM; no
    rotation: ``k``), rounded to ``input_dtype`` when given; ``k`` itself when there is nothing to do."""
    if rotation is None and input_scale == 1.0 and input_dtype in (None, k.dtype):
        return k
    product = k.float() if rotation is None else k.float() @ rotation.float()
    scaled = product / input_scale if input_divide else product * input_scale
    return scaled if input_dtype is None else scaled.to(input_dtype)
