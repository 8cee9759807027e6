"""Triton kernel of ``nsa.rotate_act_quant``: one program rotates and quantizes BLOCK_M rows of 128. Many rows
(prefill) take an fp32 rotation split into bf16 planes by one launch first, not by each program, then one launch for
a lo plane of zeros (a +-1 Hadamard) and one for any other."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_common import (ROTATION_PLANE, cuda_isa, launch, quantize_constants, quantize_rows,
                              rope_arguments, rope_rows, rotate_rows, round_to_bf16, scale_constants, scale_rows,
                              split_bf16, wait_for_previous_grid)


@triton.jit
def _rotate_act_quant_tile(tile, x_ptr, rot_ptr, values_ptr, scales_ptr, rows, stride_rk, stride_rn, pos_ptr,
                           n_positions, rows_per_token, cos_ptr, sin_ptr, stride_cp, stride_cj, stride_sp, stride_sj,
                           ROPE_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, SCALE: tl.constexpr,
                           INV_SCALE: tl.constexpr, DIVIDE: tl.constexpr, SPLIT_ROTATION: tl.constexpr,
                           QUANT_BLOCK: tl.constexpr, FMAX: tl.constexpr, INV_FMAX: tl.constexpr,
                           UE8M0: tl.constexpr, MIN_EXP: tl.constexpr, SIGNED_ZERO: tl.constexpr,
                           NAN_CODE: tl.constexpr, CUDA_ISA: tl.constexpr, BLOCK_M: tl.constexpr,
                           ONE_TOKEN_A_TILE: tl.constexpr):
    """``y = bf16((x' @ R) * SCALE)`` for the BLOCK_M rows of ``tile`` (``x'``: x with the RoPE of its token on its
    first ``ROPE_DIM`` lanes, ``rope_rows``; x itself without) (``rotate_rows``: fp32 accumulation, then the scale in
    fp32 as torch applies it, ``scale_rows``, and the bf16 rounding eager does), then act_quant of each QUANT_BLOCK
    group of ``y`` (``quantize_rows``). ``ONE_TOKEN_A_TILE``: every tile's rows are of one token."""
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, 128)
    in_range = r < rows
    offsets = r[:, None].to(tl.int64) * 128 + d[None, :]
    x = tl.load(x_ptr + offsets, mask=in_range[:, None], other=1.0)  # not 0: `_quant_store_kernel`'s note
    if ROPE_DIM:
        if ONE_TOKEN_A_TILE:  # (the tile's first row is in range)
            token = (tile * BLOCK_M + tl.zeros([1], tl.int32)) // rows_per_token
            token_ok = token >= 0
        else:
            token, token_ok = r // rows_per_token, in_range
        x = rope_rows(x, x_ptr + r.to(tl.int64) * 128, in_range, token, token_ok, pos_ptr, n_positions, cos_ptr,
                      sin_ptr, stride_cp, stride_cj, stride_sp, stride_sj, 0.0, 0.0, cos_ptr, cos_ptr, 0, ROPE_DIM,
                      INTERLEAVED, False, False, CUDA_ISA, 0)
    y = rotate_rows(x, rot_ptr, stride_rk, stride_rn, SPLIT_ROTATION, BLOCK_M)
    y = round_to_bf16(scale_rows(y, SCALE, INV_SCALE, DIVIDE))
    groups: tl.constexpr = 128 // QUANT_BLOCK
    values, scale = quantize_rows(tl.reshape(y, [BLOCK_M * groups, QUANT_BLOCK]), values_ptr.dtype.element_ty, FMAX,
                                  INV_FMAX, UE8M0, MIN_EXP, SIGNED_ZERO, NAN_CODE, CUDA_ISA)
    tl.store(values_ptr + offsets, tl.reshape(values, [BLOCK_M, 128]), mask=in_range[:, None])
    if groups == 1:
        tl.store(scales_ptr + r, scale, mask=in_range)
    else:
        g = tl.arange(0, groups)
        tl.store(scales_ptr + r[:, None].to(tl.int64) * groups + g[None, :], tl.reshape(scale, [BLOCK_M, groups]),
                 mask=in_range[:, None])


@triton.jit
def _rotate_act_quant_kernel(x_ptr, rot_ptr, values_ptr, scales_ptr, rows, stride_rk, stride_rn,
                             pos_ptr, n_positions, rows_per_token, cos_ptr, sin_ptr, stride_cp, stride_cj, stride_sp,
                             stride_sj, ROPE_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, SCALE: tl.constexpr,
                             INV_SCALE: tl.constexpr, DIVIDE: tl.constexpr, SPLIT_ROTATION: tl.constexpr,
                             QUANT_BLOCK: tl.constexpr, FMAX: tl.constexpr, INV_FMAX: tl.constexpr, UE8M0: tl.constexpr,
                             MIN_EXP: tl.constexpr, SIGNED_ZERO: tl.constexpr, NAN_CODE: tl.constexpr,
                             CUDA_ISA: tl.constexpr, BLOCK_M: tl.constexpr, ONE_TOKEN_A_TILE: tl.constexpr,
                             PDL: tl.constexpr = False):
    """A tile a program (``_rotate_act_quant_tile``). A rotation split once (``SPLIT_ROTATION`` 2 and 3) comes with
    two launches, one for each value of the split's flag: 2 (a tile a program) works where no lo is nonzero and 3
    (a few programs an SM, looping over the tiles) where some is; the other returns at once."""
    wait_for_previous_grid(PDL)
    if SPLIT_ROTATION >= 2:
        if (tl.load(rot_ptr + 2 * ROTATION_PLANE) != 0.0) != (SPLIT_ROTATION == 3):
            return
    if SPLIT_ROTATION == 3:  # (pipelined, the loop's buffers would outgrow the shared memory)
        for tile in tl.range(tl.program_id(0), tl.cdiv(rows, BLOCK_M), tl.num_programs(0), num_stages=1):
            _rotate_act_quant_tile(tile, x_ptr, rot_ptr, values_ptr, scales_ptr, rows, stride_rk, stride_rn, pos_ptr,
                                   n_positions, rows_per_token, cos_ptr, sin_ptr, stride_cp, stride_cj, stride_sp,
                                   stride_sj, ROPE_DIM, INTERLEAVED, SCALE, INV_SCALE, DIVIDE, SPLIT_ROTATION,
                                   QUANT_BLOCK, FMAX, INV_FMAX, UE8M0, MIN_EXP, SIGNED_ZERO, NAN_CODE, CUDA_ISA,
                                   BLOCK_M, ONE_TOKEN_A_TILE)
    else:
        _rotate_act_quant_tile(tl.program_id(0), x_ptr, rot_ptr, values_ptr, scales_ptr, rows, stride_rk, stride_rn,
                               pos_ptr, n_positions, rows_per_token, cos_ptr, sin_ptr, stride_cp, stride_cj, stride_sp,
                               stride_sj, ROPE_DIM, INTERLEAVED, SCALE, INV_SCALE, DIVIDE, SPLIT_ROTATION, QUANT_BLOCK,
                               FMAX, INV_FMAX, UE8M0, MIN_EXP, SIGNED_ZERO, NAN_CODE, CUDA_ISA, BLOCK_M,
                               ONE_TOKEN_A_TILE)


@triton.jit
def _split_rotation_kernel(rot_ptr, stride_rk, stride_rn, planes_ptr, PDL: tl.constexpr = False):
    """fp32 ``R`` as ``rotate_rows``' SPLIT 2 and 3 read it: bf16 ``hi`` and ``lo`` planes (:func:`split_bf16`), then
    a flag, 1 where any ``lo`` is nonzero."""
    wait_for_previous_grid(PDL)
    d = tl.arange(0, 128)
    hi, lo = split_bf16(tl.load(rot_ptr + d[:, None] * stride_rk + d[None, :] * stride_rn))
    plane = d[:, None] * 128 + d[None, :]
    tl.store(planes_ptr + plane, hi.to(tl.bfloat16))
    tl.store(planes_ptr + ROTATION_PLANE + plane, lo.to(tl.bfloat16))
    any_lo = tl.sum((lo != 0.0).to(tl.int32), axis=None) > 0
    tl.store(planes_ptr + 2 * ROTATION_PLANE, tl.where(any_lo, 1.0, 0.0).to(tl.bfloat16))


def split_rotation(rotation: torch.Tensor) -> torch.Tensor:
    """An fp32 [128, 128] rotation split once for ``rotate_rows``' SPLIT 2: bf16 [2 * 128 * 128 + 1] (one launch)."""
    planes = torch.empty(2 * 128 * 128 + 1, dtype=torch.bfloat16, device=rotation.device)
    launch(_split_rotation_kernel, (1,), rotation, *rotation.stride(), planes, num_warps=4)
    return planes


def block_rows(rows: int) -> int:
    """Rows per program: one or two on the fp32 row path up to 512 rows (decode up to B=8), then ``tl.dot`` tiles
    of 16, 32 from 2049 rows and 64 from 4097 (BENCHMARKS.md "The rotation's small tiles", "The rotation's tiles by
    size")."""
    return 1 if rows <= 128 else 2 if rows <= 512 else 16 if rows <= 2048 else 32 if rows <= 4096 else 64


# From this many rows an fp32 rotation is split once before the launch (`split_rotation`), not in every program:
# one launch more, each program's 64 KB load and split less (BENCHMARKS.md "The rotation split once").
PRESPLIT_MIN_ROWS = 32768
# Programs of the launch for a split rotation whose lo plane is not all zero: it returns at once for a +-1 Hadamard,
# so its grid is small; otherwise they loop over the tiles.
LO_PLANE_PROGRAMS = 264


def warps_for(rows: int, block_m: int) -> int:
    """8 warps for the dot tiles of decode (up to 8192 rows), else 4 (the row path; prefill's many tiles)."""
    return 8 if block_m >= 16 and rows <= 8192 else 4


def rotate_act_quant(x, rotation, scale, divide, quant_block, scale_fmt, fp8_dtype, fp8_max, rope_cos=None,
                     rope_sin=None, positions=None, rope_interleaved=False, block_m: int | None = None,
                     presplit: bool | None = None):
    """``(values fp8 [..., 128], scales fp32 [..., 128 // quant_block])`` of contiguous bf16 ``x`` (after the RoPE
    prologue when tables are given): one launch; three with an fp32 rotation split first (``presplit``; by default
    from ``PRESPLIT_MIN_ROWS`` rows; tiles of 16+ rows only): the split, then a launch for each value of its flag.
    Why not one: a kernel that branches on the flag holds the registers of the lo dot it skips, and ran fewer
    programs an SM (BENCHMARKS.md "The q rotation, its instructions and the lo plane's own launch")."""
    values = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scales = torch.empty(*x.shape[:-1], 128 // quant_block, dtype=torch.float32, device=x.device)
    rows = x.numel() // 128
    if rows == 0:
        return values, scales
    block_m = block_m or block_rows(rows)
    split = int(rotation.dtype == torch.float32)
    strides = rotation.stride()
    tiles = triton.cdiv(rows, block_m)
    grids = {split: tiles}
    if split and block_m >= 16 and (rows >= PRESPLIT_MIN_ROWS if presplit is None else presplit):
        rotation, strides = split_rotation(rotation), (128, 1)
        grids = {2: tiles, 3: min(tiles, LO_PLANE_PROGRAMS)}
    rope = rope_arguments(x, rows, rope_cos, rope_sin, positions)
    for split, grid in grids.items():
        launch(_rotate_act_quant_kernel, (grid,), x, rotation, values, scales, rows, *strides, *rope,
               ROPE_DIM=0 if rope_cos is None else 2 * rope_cos.shape[1], INTERLEAVED=rope_interleaved,
               **scale_constants(scale, divide), SPLIT_ROTATION=split,
               QUANT_BLOCK=quant_block, **quantize_constants(fp8_dtype, float(fp8_max), scale_fmt),
               CUDA_ISA=cuda_isa(_rotate_act_quant_kernel), BLOCK_M=block_m,
               ONE_TOKEN_A_TILE=rope_cos is not None and rope[2] % block_m == 0,
               num_warps=warps_for(rows, block_m))
    return values, scales
