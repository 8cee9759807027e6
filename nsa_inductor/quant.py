"""Per-block fp8 activation quantization as the DeepSeek-V3.2 indexer writes it (DESIGN §2 step 4)."""

from __future__ import annotations

import torch

QUANT_BLOCK = 128
AMAX_FLOOR = 1e-4
SCALE_FORMATS = ("ue8m0", "fp32")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
# Group sizes the fused rotation's kernel quantizes rows of 128 in (nsa.rotate_act_quant).
ROTATED_QUANT_BLOCKS = (16, 32, 64, 128)


def fp8_max(dtype: torch.dtype) -> float:
    """The fp8 type's own largest finite value: 448 for e4m3fn, 240 for e4m3fnuz."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"fp8 dtype must be one of {FP8_DTYPES}, got {dtype}")
    return float(torch.finfo(dtype).max)


def check_scale_fmt(scale_fmt: str) -> None:
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FORMATS}, got {scale_fmt!r}")


def act_quant(
    x: torch.Tensor,
    block_size: int = QUANT_BLOCK,
    scale_fmt: str = "ue8m0",
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    max_value: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last dimension in blocks of ``block_size``: returns ``(y fp8, scale fp32 [..., n_blocks])``.

    ``x ≈ y * scale``; with ``ue8m0`` the scale is rounded up to a power of two. ``max_value`` defaults to the fp8
    type's own max; SGLang's ROCm q path passes 224 for fnuz, so it stays a parameter.
    """
    check_scale_fmt(scale_fmt)
    fmax = fp8_max(fp8_dtype) if max_value is None else max_value
    blocks = x.float().unflatten(-1, (-1, block_size))
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR)
    scale = amax / fmax
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    y = (blocks / scale).clamp(-fmax, fmax).to(fp8_dtype)
    return y.flatten(-2), scale.squeeze(-1)


def fp8_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance of two fp8 tensors of one type in steps of the fp8 grid (int32, elementwise; +0 and -0 are one
    step apart). For the contracts of rewrites that change a summation order (docs/numerics.md)."""
    if a.dtype != b.dtype or a.dtype not in FP8_DTYPES:
        raise ValueError(f"a and b must share one fp8 type of {FP8_DTYPES}, got {a.dtype} and {b.dtype}")

    def ordered(t: torch.Tensor) -> torch.Tensor:
        code = t.view(torch.uint8).to(torch.int32)
        magnitude = code & 0x7F
        return torch.where(code >= 0x80, -magnitude - 1, magnitude)

    return (ordered(a) - ordered(b)).abs()
