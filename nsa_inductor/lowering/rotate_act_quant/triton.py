"""Triton kernels of ``nsa.rotate_act_quant``: one program rotates and quantizes BLOCK_M rows of 128; with a
``weight``, the programs of one head and tile of BLOCK_M tokens each compute a K chunk of ``x @ weight^T`` first (the q
side's wq_b GEMM) and the last of them to finish rotates and quantizes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._common import projected
from .._triton_common import (dot_bf16, fp8_values, interpreted, launch, next_power_of_2, no_fma, quantize_constants,
                              quantize_rows, rope_arguments, rope_rows, rotate_rows, round_to_bf16, scale_constants,
                              scale_rows)


@triton.jit
def _rotate_quantize_store(x, r, in_range, rot_ptr, values_ptr, scales_ptr, stride_rk, stride_rn, SCALE: tl.constexpr,
                           INV_SCALE: tl.constexpr, DIVIDE: tl.constexpr, SPLIT_ROTATION: tl.constexpr,
                           QUANT_BLOCK: tl.constexpr, FMAX: tl.constexpr, INV_FMAX: tl.constexpr, UE8M0: tl.constexpr,
                           MIN_EXP: tl.constexpr, SIGNED_ZERO: tl.constexpr, NAN_CODE: tl.constexpr,
                           ON_GPU: tl.constexpr, BLOCK_M: tl.constexpr):
    """``y = bf16((x @ R) * SCALE)`` of rows ``r`` (``rotate_rows``: fp32 accumulation, then the scale in fp32 as
    torch applies it, ``scale_rows``, and the bf16 rounding eager does), then act_quant of each QUANT_BLOCK group of
    ``y`` (``quantize_rows``), stored as row ``r`` of the values and scales."""
    y = rotate_rows(x, rot_ptr, stride_rk, stride_rn, SPLIT_ROTATION, ON_GPU, BLOCK_M)
    y = round_to_bf16(scale_rows(y, SCALE, INV_SCALE, DIVIDE, ON_GPU))
    groups: tl.constexpr = 128 // QUANT_BLOCK
    values, scale = quantize_rows(tl.reshape(y, [BLOCK_M * groups, QUANT_BLOCK]), FMAX, INV_FMAX, UE8M0, MIN_EXP,
                                  SIGNED_ZERO, ON_GPU)
    offsets = r[:, None].to(tl.int64) * 128 + tl.arange(0, 128)[None, :]
    tl.store(values_ptr + offsets, fp8_values(tl.reshape(values, [BLOCK_M, 128]), values_ptr.dtype.element_ty,
                                              NAN_CODE), mask=in_range[:, None])
    if groups == 1:
        tl.store(scales_ptr + r, scale, mask=in_range)
    else:
        g = tl.arange(0, groups)
        tl.store(scales_ptr + r[:, None].to(tl.int64) * groups + g[None, :], tl.reshape(scale, [BLOCK_M, groups]),
                 mask=in_range[:, None])


@triton.jit
def _rotate_act_quant_kernel(x_ptr, rot_ptr, values_ptr, scales_ptr, rows, stride_rk, stride_rn,
                             pos_ptr, n_positions, rows_per_token, cos_ptr, sin_ptr, stride_cp, stride_cj, stride_sp,
                             stride_sj, ROPE_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, NO_FMA: tl.constexpr,
                             SCALE: tl.constexpr, INV_SCALE: tl.constexpr, DIVIDE: tl.constexpr,
                             SPLIT_ROTATION: tl.constexpr, QUANT_BLOCK: tl.constexpr,
                             FMAX: tl.constexpr, INV_FMAX: tl.constexpr, UE8M0: tl.constexpr, MIN_EXP: tl.constexpr,
                             SIGNED_ZERO: tl.constexpr, NAN_CODE: tl.constexpr, ON_GPU: tl.constexpr,
                             BLOCK_M: tl.constexpr):
    """BLOCK_M rows of x, with the RoPE of their token on their first ``ROPE_DIM`` lanes (``rope_rows``; x itself
    without), rotated and quantized (``_rotate_quantize_store``)."""
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, 128)
    in_range = r < rows
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * 128 + d[None, :], mask=in_range[:, None],
                other=1.0)  # not 0: `_quant_store_kernel`'s note
    if ROPE_DIM:
        x = rope_rows(x, x_ptr + r.to(tl.int64) * 128, r // rows_per_token, in_range, pos_ptr, n_positions, cos_ptr,
                      sin_ptr, stride_cp, stride_cj, stride_sp, stride_sj, 0.0, 0.0, cos_ptr, cos_ptr, 0, ROPE_DIM,
                      INTERLEAVED, False, False, NO_FMA, 0)
    _rotate_quantize_store(x, r, in_range, rot_ptr, values_ptr, scales_ptr, stride_rk, stride_rn, SCALE, INV_SCALE,
                           DIVIDE, SPLIT_ROTATION, QUANT_BLOCK, FMAX, INV_FMAX, UE8M0, MIN_EXP, SIGNED_ZERO, NAN_CODE,
                           ON_GPU, BLOCK_M)


@triton.jit
def _linear_rotate_act_quant_kernel(x_ptr, w_ptr, part_ptr, arrived_ptr, q_ptr, rot_ptr, values_ptr, scales_ptr,
                                    tokens, k_dim, k_chunk, heads, stride_xt, stride_xk, stride_wn, stride_wk,
                                    stride_rk, stride_rn, pos_ptr, n_positions, rows_per_token, cos_ptr, sin_ptr,
                                    stride_cp, stride_cj, stride_sp, stride_sj, ROPE_DIM: tl.constexpr,
                                    INTERLEAVED: tl.constexpr, NO_FMA: tl.constexpr, SCALE: tl.constexpr,
                                    INV_SCALE: tl.constexpr, DIVIDE: tl.constexpr, SPLIT_ROTATION: tl.constexpr,
                                    QUANT_BLOCK: tl.constexpr, FMAX: tl.constexpr, INV_FMAX: tl.constexpr,
                                    UE8M0: tl.constexpr, MIN_EXP: tl.constexpr, SIGNED_ZERO: tl.constexpr,
                                    NAN_CODE: tl.constexpr, ON_GPU: tl.constexpr, BLOCK_M: tl.constexpr,
                                    BLOCK_K: tl.constexpr, SPLITS: tl.constexpr):
    """Head ``h`` (program 1) of BLOCK_M tokens, K chunk ``s`` (program 2) of ``x @ W[128 h : 128 h + 128]^T``
    (fp32). With SPLITS chunks each program writes its partial sum to ``part_ptr`` and counts itself in
    ``arrived_ptr`` (zeros: one per tile and head); the last to arrive adds the partials in chunk order (the sum is
    the same whichever program finishes it) and finishes the rows: ``bf16`` (one rounding, as a GEMM writes its
    output), then as ``_rotate_act_quant_kernel``. No program waits for another. Row of the values: ``token *
    heads + h``. With RoPE the rows pass through ``q_ptr`` (bf16 [tokens * heads, 128]): the turn reads each lane's
    partner from memory, after a barrier (the program's own writes)."""
    t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)
    split = tl.program_id(2)
    d = tl.arange(0, 128)
    kk = tl.arange(0, BLOCK_K)
    in_range = t < tokens
    r = t * heads + head
    k_end = tl.minimum(split * k_chunk + k_chunk, k_dim)
    acc = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    for k0 in range(split * k_chunk, k_end, BLOCK_K):
        k_ok = k0 + kk < k_end
        a = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_xt + (k0 + kk)[None, :] * stride_xk,
                    mask=in_range[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + (head * 128 + d)[None, :].to(tl.int64) * stride_wn + (k0 + kk)[:, None] * stride_wk,
                    mask=k_ok[:, None], other=0.0)
        acc = dot_bf16(acc, a, w, ON_GPU)  # [BLOCK_M, BLOCK_K] @ [BLOCK_K, 128]
    last = True
    if SPLITS > 1:
        rows = tokens * heads
        part = part_ptr + r[:, None].to(tl.int64) * 128 + d[None, :]
        tl.store(part + split * rows * 128, acc, mask=in_range[:, None])
        tl.debug_barrier()  # every thread's partial written before the count (released with it)
        arrived = tl.atomic_add(arrived_ptr + tl.program_id(0) * heads + head, 1, sem="acq_rel")
        last = arrived == SPLITS - 1
        if last:
            acc = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                acc += tl.load(part + s * rows * 128, mask=in_range[:, None], other=0.0, cache_modifier=".cg")
    if last:
        x = tl.where(in_range[:, None], acc, 1.0).to(tl.bfloat16)  # not 0: `_quant_store_kernel`'s note
        if ROPE_DIM:
            row_ptr = q_ptr + r.to(tl.int64) * 128
            tl.store(row_ptr[:, None] + d[None, :], x, mask=in_range[:, None])
            tl.debug_barrier()
            x = rope_rows(x, row_ptr, t, in_range, pos_ptr, n_positions, cos_ptr, sin_ptr, stride_cp, stride_cj,
                          stride_sp, stride_sj, 0.0, 0.0, cos_ptr, cos_ptr, 0, ROPE_DIM, INTERLEAVED, False, False,
                          NO_FMA, 0)
        _rotate_quantize_store(x, r, in_range, rot_ptr, values_ptr, scales_ptr, stride_rk, stride_rn, SCALE,
                               INV_SCALE, DIVIDE, SPLIT_ROTATION, QUANT_BLOCK, FMAX, INV_FMAX, UE8M0, MIN_EXP,
                               SIGNED_ZERO, NAN_CODE, ON_GPU, BLOCK_M)


def block_rows(rows: int) -> int:
    """Rows per program: one or two on the fp32 row path up to 512 rows (decode up to B=8), then ``tl.dot`` tiles
    of 16, 32 from 2049 rows and 64 from 4097 (BENCHMARKS.md "The rotation's small tiles", "The rotation's tiles by
    size")."""
    return 1 if rows <= 128 else 2 if rows <= 512 else 16 if rows <= 2048 else 32 if rows <= 4096 else 64


def warps_for(rows: int, block_m: int) -> int:
    """8 warps for the dot tiles of decode (up to 8192 rows), else 4 (the row path; prefill's many tiles)."""
    return 8 if block_m >= 16 and rows <= 8192 else 4


# With a weight, the projection runs in the rotation's kernel up to this many tokens (decode); past it, cuBLAS's
# GEMM then the rotation kernel: each program reads its head's whole weight slice, so the weight's reads from L2
# grow with the token tiles.
LINEAR_MAX_TOKENS = 128


@dataclass(frozen=True)
class LinearConfig:
    """Tiles of ``_linear_rotate_act_quant_kernel``: tokens per program, K chunks (programs per tile and head), K
    columns per loop step, launch options."""

    block_m: int
    splits: int = 1
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4


def linear_config(tokens: int) -> LinearConfig:
    """All tokens in one tile up to 64 (16 at least: ``tl.dot``), so the weight is read once from DRAM; K split so
    that its heads x chunks programs fill the SMs (one per head alone leave half of them idle)."""
    return LinearConfig(block_m=min(64, max(16, next_power_of_2(tokens))), splits=4 if tokens <= 16 else 2)


def _linear_rotate_act_quant(x, weight, rotation, scale, divide, quant_block, scale_fmt, fp8_dtype, fp8_max, rope_cos,
                             rope_sin, positions, rope_interleaved, config):
    tokens, (n, k) = x.shape[0], weight.shape
    heads = n // 128
    values = torch.empty(tokens, heads, 128, dtype=fp8_dtype, device=x.device)
    scales = torch.empty(tokens, heads, 128 // quant_block, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return values, scales
    cfg = config or linear_config(tokens)
    tiles = triton.cdiv(tokens, cfg.block_m)
    splits = max(1, min(cfg.splits, triton.cdiv(k, cfg.block_k)))
    k_chunk = triton.cdiv(triton.cdiv(k, splits), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_chunk)  # (no empty chunk)
    part = torch.empty(splits if splits > 1 else 0, tokens * heads, 128, dtype=torch.float32, device=x.device)
    arrived = torch.zeros(tiles * heads if splits > 1 else 0, dtype=torch.int32, device=x.device)
    q = values if rope_cos is None else torch.empty(tokens * heads, 128, dtype=torch.bfloat16, device=x.device)
    kernel = _linear_rotate_act_quant_kernel
    launch(kernel, (tiles, heads, splits), x, weight, part, arrived, q, rotation, values, scales, tokens, k, k_chunk,
           heads, *x.stride(), *weight.stride(), *rotation.stride(),
           *rope_arguments(x, tokens * heads, rope_cos, rope_sin, positions),
           ROPE_DIM=0 if rope_cos is None else 2 * rope_cos.shape[1], INTERLEAVED=rope_interleaved,
           NO_FMA=no_fma(kernel), **scale_constants(scale, divide), SPLIT_ROTATION=rotation.dtype == torch.float32,
           QUANT_BLOCK=quant_block, **quantize_constants(fp8_dtype, float(fp8_max), scale_fmt),
           ON_GPU=not interpreted(kernel), BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, SPLITS=splits,
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return values, scales


def rotate_act_quant(x, rotation, scale, divide, quant_block, scale_fmt, fp8_dtype, fp8_max, rope_cos=None,
                     rope_sin=None, positions=None, rope_interleaved=False, weight=None, block_m: int | None = None,
                     linear: LinearConfig | None = None):
    """``(values fp8 [..., 128], scales fp32 [..., 128 // quant_block])`` of contiguous bf16 ``x`` (after the RoPE
    prologue when tables are given): one launch; with ``weight``, of ``x @ weight^T`` as heads of 128 (one launch
    up to ``LINEAR_MAX_TOKENS`` tokens, ``linear``: its tiles)."""
    if weight is not None:
        if x.shape[0] <= LINEAR_MAX_TOKENS:
            return _linear_rotate_act_quant(x, weight, rotation, scale, divide, quant_block, scale_fmt, fp8_dtype,
                                            fp8_max, rope_cos, rope_sin, positions, rope_interleaved, linear)
        x = projected(x, weight)
    values = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scales = torch.empty(*x.shape[:-1], 128 // quant_block, dtype=torch.float32, device=x.device)
    rows = x.numel() // 128
    if rows == 0:
        return values, scales
    block_m = block_m or block_rows(rows)
    kernel = _rotate_act_quant_kernel
    launch(kernel, (triton.cdiv(rows, block_m),), x, rotation, values, scales, rows, *rotation.stride(),
           *rope_arguments(x, rows, rope_cos, rope_sin, positions),
           ROPE_DIM=0 if rope_cos is None else 2 * rope_cos.shape[1], INTERLEAVED=rope_interleaved,
           NO_FMA=no_fma(kernel), **scale_constants(scale, divide), SPLIT_ROTATION=rotation.dtype == torch.float32,
           QUANT_BLOCK=quant_block, **quantize_constants(fp8_dtype, float(fp8_max), scale_fmt),
           ON_GPU=not interpreted(kernel), BLOCK_M=block_m, num_warps=warps_for(rows, block_m))
    return values, scales
