"""``nsa.quant_cache_store``: act_quant of K rows (per-row fp8 + fp32 scale) written into the paged K cache.

The indexer's ``act_quant`` then cache write as one op, so the fp8 values never round-trip through memory. An
optional epilogue (``input_scale``, ``input_dtype``) folds in the Hadamard rotation's ``(y * 128**-0.5).to(bf16)``, an
optional prologue (``rotation``) the product ``y = k.float() @ H`` itself (then ``k`` is bf16 and aiter is not used).
"""

from __future__ import annotations

import torch

from ...capability import capability
from ...index_contract import check_slots, eager_call
from ...layout import HEAD_DIM
from ...quant import check_scale_fmt
from .._common import (INT_TYPES, check, check_devices, check_fp8, check_layout, check_rope, check_rotation, contiguous,
                       implementation, nsa_op, once_per_signature)
from .._streams import check_stream, on_stream

_K_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ROUNDED_K_DTYPES = (torch.bfloat16, torch.float16)


@once_per_signature
def _validate(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype, input_dtype, rotation, rope_cos,
              rope_sin, positions, round_k, ln_weight, ln_bias, k_split_sum, stream) -> None:
    check_stream(stream)
    check_scale_fmt(scale_fmt)
    check_fp8("fp8_dtype", fp8_dtype)
    if (ln_weight is None) != (ln_bias is None):
        raise ValueError("ln_weight and ln_bias go together (the LayerNorm prologue has both or is off)")
    if ln_weight is not None:
        check("ln_weight", ln_weight, (HEAD_DIM,), (torch.float32,), "[128]")
        check("ln_bias", ln_bias, (HEAD_DIM,), (torch.float32,), "[128]")
        if not round_k:
            raise ValueError("the LayerNorm prologue needs round_k=True (eager rounds LayerNorm's rows to bf16)")
    if k_split_sum:
        check("k", k, (None, None, HEAD_DIM), (torch.float32,), "[S, T, 128] (k_split_sum: fp32 split-K partials)")
        if k.shape[0] < 1:
            raise ValueError("k_split_sum needs at least one split-K partial, got k of shape [0, ...]")
        if not round_k:
            raise ValueError("k_split_sum needs round_k=True (the summed rows are bf16 values, rounded for the cache)")
        k = k[0]  # the rows' shape, for the checks below
    elif round_k:
        check("k", k, (None, HEAD_DIM), (torch.float32,), "[T, 128] (round_k rounds fp32 rows to bf16)")
    elif rotation is None:
        check("k", k, (None, HEAD_DIM), _K_DTYPES, "[T, 128]")
    else:
        check("k", k, (None, HEAD_DIM), (torch.bfloat16,), "[T, 128] (the rotation prologue multiplies bf16 rows)")
    if rotation is not None:
        check_rotation(rotation)
    if input_dtype is not None and input_dtype not in _ROUNDED_K_DTYPES:
        raise ValueError(f"input_dtype must be None or one of {_ROUNDED_K_DTYPES}, got {input_dtype}")
    check("slot_mapping", slot_mapping, (k.shape[0],), INT_TYPES, f"[T={k.shape[0]}] (one slot per row of k)")
    check_layout(cache, page_size, preshuffle)
    check_rope(k, rope_cos, rope_sin, positions, torch.bfloat16 if round_k else None)
    optional = {"rotation": rotation, "rope_cos": rope_cos, "rope_sin": rope_sin, "positions": positions,
                "ln_weight": ln_weight, "ln_bias": ln_bias}
    check_devices(k=k, cache=cache, slot_mapping=slot_mapping,
                  **{name: t for name, t in optional.items() if t is not None})


@nsa_op("quant_cache_store", mutates_args=("cache",))
def quant_cache_store(
    k: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_size: int,
    preshuffle: bool,
    scale_fmt: str,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    input_scale: float = 1.0,
    input_dtype: torch.dtype | None = None,
    input_divide: bool = False,
    rotation: torch.Tensor | None = None,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    rope_interleaved: bool = False,
    round_k: bool = False,
    ln_weight: torch.Tensor | None = None,
    ln_bias: torch.Tensor | None = None,
    ln_eps: float = 0.0,
    k_split_sum: bool = False,
    stream: str = "current",
) -> None:
    """``act_quant(k')`` (per-row fp8 + fp32 scale) written into the K cache at ``slot_mapping`` (< 0: skipped).

    ``k' = (k @ rotation) * input_scale`` in fp32 (``/ input_scale`` with ``input_divide``; ``k`` itself without a
    rotation), rounded to ``input_dtype`` when given: the Hadamard rotation ``(k.float() @ H * 128**-0.5).to(bf16)``,
    which then needs no kernel of its own. The rotation ([128, 128] fp32 or bf16, any strides) is summed in another
    order than a cuBLAS GEMM: see docs/numerics.md for the bytes that may differ. Before it all, the RoPE prologue
    (``rope_cos``, ``rope_sin``, ``positions``, ``rope_interleaved``: as ``nsa.rotate_act_quant``'s) may turn the
    first lanes of each bf16 row of ``k``; first of all, with ``round_k``, fp32 ``k`` is rounded to bf16 (eager's
    ``.to(bf16)``, then the rows above are those bf16 rows), and before that, with ``ln_weight`` and ``ln_bias``,
    ``F.layer_norm(k, [128], ln_weight, ln_bias, ln_eps)`` of fp32 ``k`` (on the GPU in ATen's CUDA order); and
    before everything, with ``k_split_sum``, ``k`` is ``[S, T, 128]`` fp32 split-K partials of a bf16 GEMM: the rows
    are ``k[0] + k[1] + ... + k[S-1]`` (left to right) rounded to bf16, as the GEMM's output read with ``.float()``.
    ``stream``: where it runs on CUDA (``"fork"``, ``"side"``: the device's second stream, lowering/_streams.py; a
    reader of the cache on the current stream must join it first)."""
    _validate(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype, input_dtype, rotation, rope_cos,
              rope_sin, positions, round_k, ln_weight, ln_bias, k_split_sum, stream)
    on_stream(stream, _store, k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype, input_scale,
              input_dtype, input_divide, rotation, rope_cos, rope_sin, positions, rope_interleaved, round_k, ln_weight,
              ln_bias, ln_eps, k_split_sum)


def _store(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype, input_scale, input_dtype, input_divide,
           rotation, rope_cos, rope_sin, positions, rope_interleaved, round_k, ln_weight, ln_bias, ln_eps,
           k_split_sum) -> None:
    if capability().index_checks:
        check_slots(eager_call, slot_mapping, cache.shape[0], page_size)
    k, slot_mapping, positions = contiguous(k, slot_mapping, positions)
    run = implementation("quant_cache_store", k.device, fp8_dtype, page_size=page_size, preshuffle=preshuffle,
                         prologue=rotation is not None or rope_cos is not None or round_k)
    run(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype, input_scale, input_dtype, input_divide,
        rotation, rope_cos, rope_sin, positions, rope_interleaved, round_k, ln_weight, ln_bias, ln_eps, k_split_sum)


@quant_cache_store.register_fake
def _(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype=torch.float8_e4m3fn, input_scale=1.0,
      input_dtype=None, input_divide=False, rotation=None, rope_cos=None, rope_sin=None, positions=None,
      rope_interleaved=False, round_k=False, ln_weight=None, ln_bias=None, ln_eps=0.0, k_split_sum=False,
      stream="current"):
    _validate(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype, input_dtype, rotation, rope_cos,
              rope_sin, positions, round_k, ln_weight, ln_bias, k_split_sum, stream)
