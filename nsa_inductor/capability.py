"""What this machine can run, and which K-cache layout to use: the project's only reader of environment variables.

Everything here is decided once per process (cached) and reported in one line by :func:`describe`. The layout
decision feeds the pass manager's cache key, so a different layout never reuses a cached compiled graph.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
from dataclasses import dataclass

import torch

from .layout import KCacheLayout

log = logging.getLogger("nsa_inductor")

ENV_LAYOUT = "NSA_INDUCTOR_LAYOUT"
ENV_PAGE_SIZE = "NSA_INDUCTOR_PAGE_SIZE"
ENV_DISABLE_PRESHUFFLE = "NSA_INDUCTOR_DISABLE_PRESHUFFLE"
ENV_DISABLE_AITER = "NSA_INDUCTOR_DISABLE_AITER"
ENV_DUMP_DIR = "NSA_INDUCTOR_DUMP_DIR"
ENV_AITER_AOT = "AITER_ENABLE_AOT_GLUON_PA_MQA_LOGITS"

LAYOUT_NAMES = ("flat", "paged", "preshuffle")
DEFAULT_PAGE_SIZE = 64
PRESHUFFLE_MIN_TRITON = (3, 5)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _version_tuple(version: str | None) -> tuple[int, ...]:
    if not version:
        return ()
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


@dataclass(frozen=True)
class Capability:
    """The facts the layout and kernel choices depend on."""

    platform: str  # "rocm" | "cuda" | "cpu"
    device_name: str
    aiter_available: bool
    aiter_disabled: bool
    triton_version: str | None
    aiter_aot: bool
    preshuffle_disabled: bool
    fp8_dtype: torch.dtype

    @property
    def use_aiter(self) -> bool:
        return self.platform == "rocm" and self.aiter_available and not self.aiter_disabled

    @property
    def use_triton(self) -> bool:
        return self.platform in ("cuda", "rocm") and self.triton_version is not None

    @property
    def kernel_backend(self) -> str:
        if self.use_aiter:
            return "aiter"
        return "triton" if self.use_triton else "torch"

    @property
    def preshuffle_usable(self) -> bool:
        """aiter's preshuffle paged-MQA kernel needs gluon (Triton >= 3.5) or aiter's ahead-of-time bundle."""
        return _version_tuple(self.triton_version) >= PRESHUFFLE_MIN_TRITON or self.aiter_aot


def _platform() -> tuple[str, str]:
    if not torch.cuda.is_available():
        return "cpu", "cpu"
    name = torch.cuda.get_device_name(0)
    return ("rocm" if torch.version.hip else "cuda"), name


def _rocm_fp8_dtype() -> torch.dtype:
    """gfx942 (MI300) uses the fnuz fp8 encoding; later ROCm GPUs use OCP e4m3fn."""
    arch = getattr(torch.cuda.get_device_properties(0), "gcnArchName", "")
    return torch.float8_e4m3fnuz if "gfx94" in arch else torch.float8_e4m3fn


def _triton_version() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:
        return None


@functools.cache
def capability() -> Capability:
    platform, device_name = _platform()
    return Capability(
        platform=platform,
        device_name=device_name,
        aiter_available=platform == "rocm" and importlib.util.find_spec("aiter") is not None,
        aiter_disabled=_env_flag(ENV_DISABLE_AITER),
        triton_version=_triton_version(),
        aiter_aot=os.environ.get(ENV_AITER_AOT) == "1",  # aiter itself accepts exactly "1"
        preshuffle_disabled=_env_flag(ENV_DISABLE_PRESHUFFLE),
        fp8_dtype=_rocm_fp8_dtype() if platform == "rocm" else torch.float8_e4m3fn,
    )


@dataclass(frozen=True)
class LayoutDecision:
    layout: KCacheLayout
    reason: str

    def __str__(self) -> str:
        return f"{self.layout} ({self.reason})"


def _parse_page_size(value: int | str | None, source: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        page_size = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source} must be a positive integer page size, got {value!r}") from None
    if page_size < 1:
        raise ValueError(f"{source} must be a positive integer page size, got {value!r}")
    return page_size


def _explicit_layout(name: str, page_size: int | None, source: str) -> KCacheLayout:
    if name not in LAYOUT_NAMES:
        raise ValueError(f"{source} must be one of {', '.join(LAYOUT_NAMES)}, got {name!r}")
    if name == "flat":
        if page_size not in (None, 1):
            raise ValueError(f"{source}=flat means page_size 1, got page_size={page_size}")
        return KCacheLayout(page_size=1)
    page_size = page_size or DEFAULT_PAGE_SIZE
    if name == "preshuffle" and page_size % 16:
        raise ValueError(
            f"{source}=preshuffle needs a page size that is a multiple of 16, got page_size={page_size}"
        )
    if name == "paged" and page_size == 1:
        raise ValueError(f"{source}=paged needs page_size > 1 (page_size 1 is the flat layout)")
    return KCacheLayout(page_size=page_size, preshuffle=name == "preshuffle")


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


@functools.cache
def _select_layout(layout: str | None, page_size: int | None, env_layout: str, env_page_size: str) -> LayoutDecision:
    env_page = _parse_page_size(env_page_size, ENV_PAGE_SIZE)
    if layout is not None:
        if layout != "flat":
            page_size = page_size or env_page
        return LayoutDecision(_explicit_layout(layout, page_size, "layout"), "requested by argument")
    if env_layout:
        if env_layout == "flat" and page_size is None:
            env_page = None
        return LayoutDecision(
            _explicit_layout(env_layout, page_size or env_page, ENV_LAYOUT), f"requested by {ENV_LAYOUT}"
        )
    cap = capability()
    page = page_size or env_page or DEFAULT_PAGE_SIZE
    if not cap.use_aiter:
        if page == 1:
            return LayoutDecision(KCacheLayout(page_size=1), "page_size 1 requested")
        return LayoutDecision(KCacheLayout(page_size=page), f"{cap.platform}: paged row-major")
    if page % 16:
        why = f"page_size {page} is not a multiple of 16"
    elif cap.preshuffle_disabled:
        why = f"{ENV_DISABLE_PRESHUFFLE}=1"
    elif not cap.preshuffle_usable:
        why = f"Triton {cap.triton_version} < 3.5 and {ENV_AITER_AOT} is not set"
    else:
        return LayoutDecision(KCacheLayout(page_size=page, preshuffle=True), "rocm+aiter: preshuffle paged MQA")
    decision = LayoutDecision(KCacheLayout(page_size=1), f"rocm+aiter: preshuffle unusable ({why}); flat fallback")
    _warn_once(f"nsa_inductor: K-cache layout falls back to flat page_size=1 because {why}")
    return decision


def select_layout(layout: str | None = None, page_size: int | None = None) -> LayoutDecision:
    """The K-cache layout for this process: an argument beats the environment, which beats the platform default.

    ``layout`` is one of ``flat``, ``paged``, ``preshuffle``; ``page_size`` applies to the paged layouts.
    Impossible requests (preshuffle with a page size that is not a multiple of 16) raise ``ValueError``.
    """
    if page_size is not None:
        page_size = _parse_page_size(page_size, "page_size=")
    return _select_layout(
        layout, page_size, os.environ.get(ENV_LAYOUT, "").strip().lower(), os.environ.get(ENV_PAGE_SIZE, "").strip()
    )


def dump_dir_from_env() -> str | None:
    return os.environ.get(ENV_DUMP_DIR) or None


def describe(decision: LayoutDecision | None = None) -> str:
    """One line for logs and reports."""
    cap = capability()
    decision = decision or select_layout()
    fp8 = str(cap.fp8_dtype).removeprefix("torch.")
    return (
        f"nsa_inductor: platform={cap.platform} ({cap.device_name}) kernels={cap.kernel_backend} "
        f"triton={cap.triton_version or 'none'} aiter={'yes' if cap.aiter_available else 'no'} "
        f"fp8={fp8} layout={decision}"
    )
