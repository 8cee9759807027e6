"""What the ops' aiter modules share (ROCm; aiter itself is imported on first call, DESIGN §4).

The two cache ops take ``preshuffle`` only from aiter 0.1.13 (April 2026), so it is passed only when
set: the flat and row-major layouts keep working with older aiter releases. aiter's Triton kernels moved into
folders in January 2026 (``aiter.ops.triton.attention.<name>``); the old paths are tried second.
"""

from __future__ import annotations

import functools
import importlib

import torch

from ..layout import TOKEN_BYTES


def import_first(*names: str):
    errors = []
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("aiter kernel module not found; tried " + "; ".join(errors))


@functools.cache
def cache_ops():
    return importlib.import_module("aiter.ops.cache")


def preshuffle_kwarg(preshuffle: bool) -> dict:
    return {"preshuffle": True} if preshuffle else {}


def kv_cache(cache: torch.Tensor, page_size: int, fp8_dtype: torch.dtype, *extra: int) -> torch.Tensor:
    """aiter's view of the uint8 cache: fp8 ``[num_pages, page_size, *extra, 132]`` over the same bytes."""
    return cache.view(fp8_dtype).view(cache.shape[0], page_size, *extra, TOKEN_BYTES)
