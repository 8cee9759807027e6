"""The ``nsa`` custom ops (DESIGN §4): schema, fake (meta) implementations, validation and device dispatch.

Dispatch per call: CPU tensors (or no Triton) use the torch reference; on ROCm with aiter enabled the aiter
kernels; on other GPUs the project's Triton kernels. Triton and aiter are imported only on those GPU paths.
The fnuz fp8 type has no native Triton support on NVIDIA, so fnuz arithmetic there runs the torch reference
(logged once); the gather is a byte copy and stays on Triton for both fp8 types.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..capability import capability
from ..layout import HEAD_DIM, KCacheLayout
from ..quant import FP8_DTYPES, check_scale_fmt
from . import reference

log = logging.getLogger("nsa_inductor")

_INT_TYPES = (torch.int32, torch.int64)
_K_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ROUNDED_K_DTYPES = (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------------------------
# validation (metadata only, so it runs on fake tensors too)
# ---------------------------------------------------------------------------------------------------------------


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def _check(name: str, t: torch.Tensor, shape: tuple, dtypes: tuple[torch.dtype, ...], what: str) -> None:
    """``shape`` entries of ``None`` match any size."""
    ok = t.dim() == len(shape) and all(want is None or got == want for got, want in zip(t.shape, shape))
    if not ok or t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be {names} {what}, got {_describe(t)}")


def _check_layout(cache: torch.Tensor, page_size: int, preshuffle: bool) -> KCacheLayout:
    layout = KCacheLayout(page_size, preshuffle)
    _check("cache", cache, (None, layout.page_bytes), (torch.uint8,), f"[num_pages, {layout.page_bytes}] for {layout}")
    if not cache.is_contiguous():
        raise ValueError(f"cache must be contiguous, got {_describe(cache)} with strides {list(cache.stride())}")
    return layout


def _check_fp8(name: str, dtype: torch.dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{name} must be one of {FP8_DTYPES}, got {dtype}")


def _check_devices(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def _validate_quant_cache_store(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype, input_dtype
                                ) -> None:
    check_scale_fmt(scale_fmt)
    _check_fp8("fp8_dtype", fp8_dtype)
    _check("k", k, (None, HEAD_DIM), _K_DTYPES, "[T, 128]")
    if input_dtype is not None and input_dtype not in _ROUNDED_K_DTYPES:
        raise ValueError(f"input_dtype must be None or one of {_ROUNDED_K_DTYPES}, got {input_dtype}")
    _check("slot_mapping", slot_mapping, (k.shape[0],), _INT_TYPES, f"[T={k.shape[0]}] (one slot per row of k)")
    _check_layout(cache, page_size, preshuffle)
    _check_devices(k=k, cache=cache, slot_mapping=slot_mapping)


def _validate_gather_k(cache, block_table, cu_seqlens, page_size, preshuffle, num_tokens, fp8_dtype) -> None:
    _check_fp8("fp8_dtype", fp8_dtype)
    _check_layout(cache, page_size, preshuffle)
    _check("block_table", block_table, (None, None), (torch.int32,), "[B, max_pages]")
    batch = block_table.shape[0]
    _check("cu_seqlens", cu_seqlens, (batch + 1,), (torch.int32,), f"[B+1={batch + 1}] (B from block_table)")
    if batch < 1 or block_table.shape[1] < 1:
        raise ValueError(f"block_table must have at least one row and one column, got {_describe(block_table)}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    _check_devices(cache=cache, block_table=block_table, cu_seqlens=cu_seqlens)


def _validate_paged(q_fp8, cache, weights, context_lens, block_table, max_len, page_size, preshuffle) -> None:
    _check("q_fp8", q_fp8, (None, None, None, HEAD_DIM), FP8_DTYPES, "[B, next_n, H, 128]")
    batch, next_n, heads, _ = q_fp8.shape
    _check("weights", weights, (batch * next_n, heads), (torch.float32,), f"[B*next_n={batch * next_n}, H={heads}]")
    _check("context_lens", context_lens, (batch,), (torch.int32,), f"[B={batch}]")
    _check("block_table", block_table, (batch, None), (torch.int32,), f"[B={batch}, max_pages]")
    if block_table.shape[1] < 1:
        raise ValueError(f"block_table must have at least one column, got {_describe(block_table)}")
    if max_len < 0:
        raise ValueError(f"max_len must be >= 0, got {max_len}")
    _check_layout(cache, page_size, preshuffle)
    _check_devices(q_fp8=q_fp8, cache=cache, weights=weights, context_lens=context_lens, block_table=block_table)


def _validate_mqa(q_fp8, k_fp8, k_scale, weights, ks, ke) -> None:
    _check("q_fp8", q_fp8, (None, None, HEAD_DIM), FP8_DTYPES, "[T, H, 128]")
    tokens, heads, _ = q_fp8.shape
    _check("k_fp8", k_fp8, (None, HEAD_DIM), (q_fp8.dtype,), "[N, 128] (same fp8 type as q_fp8)")
    num_keys = k_fp8.shape[0]
    _check("k_scale", k_scale, (num_keys,), (torch.float32,), f"[N={num_keys}]")
    _check("weights", weights, (tokens, heads), (torch.float32,), f"[T={tokens}, H={heads}]")
    _check("ks", ks, (tokens,), (torch.int32,), f"[T={tokens}]")
    _check("ke", ke, (tokens,), (torch.int32,), f"[T={tokens}]")
    _check_devices(q_fp8=q_fp8, k_fp8=k_fp8, k_scale=k_scale, weights=weights, ks=ks, ke=ke)


def _validate_topk(logits, k, lengths, offset) -> None:
    _check("logits", logits, (None, None), (torch.float32,), "[R, N]")
    rows, cols = logits.shape
    if not 0 <= k <= cols:
        raise ValueError(f"k must be in [0, N={cols}], got {k}")
    if lengths is not None:
        _check("lengths", lengths, (rows,), _INT_TYPES, f"[R={rows}]")
    if offset is not None:
        _check("offset", offset, (rows,), _INT_TYPES, f"[R={rows}]")
    _check_devices(logits=logits, **{n: t for n, t in (("lengths", lengths), ("offset", offset)) if t is not None})


def _validate_head_gate_gemm(x, weight, splits, round_weight) -> None:
    _check("x", x, (None, None), (torch.bfloat16,), "[M, K]")
    k = x.shape[1]
    _check("weight", weight, (None, k), (torch.float32, torch.bfloat16), f"[N, K={k}]")
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    if round_weight and weight.dtype != torch.float32:
        raise ValueError(f"round_weight needs a float32 weight (a bfloat16 one is used as is), got {_describe(weight)}")
    _check_devices(x=x, weight=weight)


# ---------------------------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def _log_once(message: str) -> None:
    log.warning(message)


def _backend(op: str, device: torch.device, fp8_dtype: torch.dtype) -> str:
    """``"aiter"``, ``"triton"`` or ``"torch"`` for one call of ``op`` on ``device``."""
    if device.type == "cpu":
        return "torch"
    cap = capability()
    if cap.use_aiter and fp8_dtype == cap.fp8_dtype:
        return "aiter"
    if not cap.use_triton:
        return "torch"
    if cap.platform == "cuda" and fp8_dtype == torch.float8_e4m3fnuz and op != "gather_k":
        _log_once(f"nsa_inductor: nsa.{op} with float8_e4m3fnuz runs the torch reference on NVIDIA "
                  "(Triton has no fnuz fp8 type there)")
        return "torch"
    return "triton"


def _implementation(op: str, device: torch.device, fp8_dtype: torch.dtype):
    """The function that runs this call of ``op``: from ``aiter_dispatch``, ``triton_kernels`` or ``reference``."""
    backend = _backend(op, device, fp8_dtype)
    if backend == "aiter":
        from . import aiter_dispatch as module
    elif backend == "triton":
        from . import triton_kernels as module
    else:
        module = reference
    return getattr(module, op)


def _triton_or_reference(op: str, device: torch.device):
    """For the ops aiter has no kernel for: the Triton kernel on GPUs, the torch reference elsewhere."""
    if device.type != "cpu" and capability().use_triton:
        from . import triton_kernels as module
    else:
        module = reference
    return getattr(module, op)


def _contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.contiguous() for t in tensors]


def _contiguous_or_none(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.contiguous() for t in tensors]


# ---------------------------------------------------------------------------------------------------------------
# ops
# ---------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("nsa::quant_cache_store", mutates_args=("cache",))
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
) -> None:
    """``act_quant(k')`` (per-row fp8 + fp32 scale) written into the K cache at ``slot_mapping`` (< 0: skipped).

    ``k' = k * input_scale`` in fp32, rounded to ``input_dtype`` when given: the epilogue of the Hadamard rotation
    (``(x @ H * 128**-0.5).to(bf16)``), which then needs no kernel of its own."""
    _validate_quant_cache_store(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype, input_dtype)
    k, slot_mapping = _contiguous(k, slot_mapping)
    run = _implementation("quant_cache_store", k.device, fp8_dtype)
    run(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype, input_scale, input_dtype)


@quant_cache_store.register_fake
def _(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype=torch.float8_e4m3fn, input_scale=1.0,
      input_dtype=None):
    _validate_quant_cache_store(k, cache, slot_mapping, page_size, preshuffle, scale_fmt, fp8_dtype, input_dtype)


@torch.library.custom_op("nsa::gather_k", mutates_args=())
def gather_k(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    page_size: int,
    preshuffle: bool,
    num_tokens: int,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences' cached K as contiguous ``(k_fp8 [num_tokens,128], k_scale [num_tokens])``; spare rows zero."""
    _validate_gather_k(cache, block_table, cu_seqlens, page_size, preshuffle, num_tokens, fp8_dtype)
    block_table, cu_seqlens = _contiguous(block_table, cu_seqlens)
    run = _implementation("gather_k", cache.device, fp8_dtype)
    return run(cache, block_table, cu_seqlens, page_size, preshuffle, num_tokens, fp8_dtype)


@gather_k.register_fake
def _(cache, block_table, cu_seqlens, page_size, preshuffle, num_tokens, fp8_dtype=torch.float8_e4m3fn):
    _validate_gather_k(cache, block_table, cu_seqlens, page_size, preshuffle, num_tokens, fp8_dtype)
    return (
        cache.new_empty((num_tokens, HEAD_DIM), dtype=fp8_dtype),
        cache.new_empty((num_tokens,), dtype=torch.float32),
    )


@torch.library.custom_op("nsa::paged_mqa_logits", mutates_args=())
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
    """Decode logits ``[B*next_n, max_len]`` fp32 from the paged K cache; every element written (-inf masked)."""
    _validate_paged(q_fp8, cache, weights, context_lens, block_table, max_len, page_size, preshuffle)
    q_fp8, weights, context_lens, block_table = _contiguous(q_fp8, weights, context_lens, block_table)
    args = (q_fp8, cache, weights, context_lens, block_table, max_len, page_size, preshuffle)
    return _implementation("paged_mqa_logits", q_fp8.device, q_fp8.dtype)(*args)


@paged_mqa_logits.register_fake
def _(q_fp8, cache, weights, context_lens, block_table, max_len, page_size, preshuffle):
    _validate_paged(q_fp8, cache, weights, context_lens, block_table, max_len, page_size, preshuffle)
    return q_fp8.new_empty((q_fp8.shape[0] * q_fp8.shape[1], max_len), dtype=torch.float32)


@torch.library.custom_op("nsa::mqa_logits", mutates_args=())
def mqa_logits(
    q_fp8: torch.Tensor,
    k_fp8: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
) -> torch.Tensor:
    """Ragged (prefill) logits ``[T, N]`` fp32: row t sees keys ``ks[t] <= n < ke[t]``, -inf elsewhere."""
    _validate_mqa(q_fp8, k_fp8, k_scale, weights, ks, ke)
    args = _contiguous(q_fp8, k_fp8, k_scale, weights, ks, ke)
    return _implementation("mqa_logits", q_fp8.device, q_fp8.dtype)(*args)


@mqa_logits.register_fake
def _(q_fp8, k_fp8, k_scale, weights, ks, ke):
    _validate_mqa(q_fp8, k_fp8, k_scale, weights, ks, ke)
    return q_fp8.new_empty((q_fp8.shape[0], k_fp8.shape[0]), dtype=torch.float32)


@torch.library.custom_op("nsa::topk_indices", mutates_args=())
def topk_indices(
    logits: torch.Tensor, k: int, lengths: torch.Tensor | None = None, offset: torch.Tensor | None = None
) -> torch.Tensor:
    """``[R, k]`` int32: a top-k set of each row's first ``lengths[r]`` columns (all when ``None``), as column
    minus ``offset[r]``, -1 where the value is -inf. Set semantics: the order within a row is unspecified."""
    _validate_topk(logits, k, lengths, offset)
    run = _triton_or_reference("topk_indices", logits.device)
    return run(logits.contiguous(), k, *_contiguous_or_none(lengths, offset))


@topk_indices.register_fake
def _(logits, k, lengths=None, offset=None):
    _validate_topk(logits, k, lengths, offset)
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)


@torch.library.custom_op("nsa::head_gate_gemm", mutates_args=())
def head_gate_gemm(x: torch.Tensor, weight: torch.Tensor, splits: int, round_weight: bool) -> torch.Tensor:
    """Split-K partial products ``[splits, M, N]`` fp32 of ``x [M, K] bf16 @ weight [N, K]^T``; their sum over dim 0
    is the GEMM. An fp32 weight enters as ``hi + lo`` (two bf16 halves, ~16 bits of W) or, with ``round_weight``, as
    ``bf16(W)``; the chunking and numerics are ``reference.head_gate_gemm``'s."""
    _validate_head_gate_gemm(x, weight, splits, round_weight)
    return _triton_or_reference("head_gate_gemm", x.device)(x, weight, splits, round_weight)


@head_gate_gemm.register_fake
def _(x, weight, splits, round_weight):
    _validate_head_gate_gemm(x, weight, splits, round_weight)
    return x.new_empty((splits, x.shape[0], weight.shape[0]), dtype=torch.float32)
