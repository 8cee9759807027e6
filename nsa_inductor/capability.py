"""What this machine can run, and which K-cache layout to use: the project's only reader of environment variables.

Two kinds of decision, both reported in one line by :func:`describe`:

- :func:`capability`: the machine (platform, gfx arch, Triton and aiter versions, which keywords the installed
  aiter accepts) and the switches ``NSA_INDUCTOR_DISABLE_AITER`` / ``NSA_INDUCTOR_DISABLE_PRESHUFFLE`` /
  ``AITER_ENABLE_AOT_GLUON_PA_MQA_LOGITS`` / ``NSA_INDUCTOR_CHECKS`` / ``NSA_INDUCTOR_DISABLE_PDL`` /
  ``NSA_INDUCTOR_DISABLE_HOST_PLANS``: read once per process, on first use (never at import).
- :func:`select_layout`: the K-cache layout. ``NSA_INDUCTOR_LAYOUT`` / ``NSA_INDUCTOR_PAGE_SIZE`` are read on every
  call (each compile), so a changed value takes effect at the next compile; the result is cached per value.

Rule for overrides: an argument (or the ``nsa.layout`` / ``nsa.page_size`` option) beats the environment, which beats
the platform default, and an environment value is validated only where it is used: ``NSA_INDUCTOR_LAYOUT=bogus`` is
an error for a compile that takes its layout from the environment and ignored by one that sets ``nsa.layout``.

Per op, :func:`aiter_refusal` says why aiter cannot serve a call (``None``: it can); the dispatch then runs the
project's Triton kernel. The layout decision and the capability feed the pass manager's cache key, so a different
layout or machine never reuses a cached compiled graph.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
from dataclasses import dataclass

import torch

from .layout import TOKEN_BYTES, KCacheLayout

log = logging.getLogger("nsa_inductor")

ENV_LAYOUT = "NSA_INDUCTOR_LAYOUT"
ENV_PAGE_SIZE = "NSA_INDUCTOR_PAGE_SIZE"
ENV_DISABLE_PRESHUFFLE = "NSA_INDUCTOR_DISABLE_PRESHUFFLE"
ENV_DISABLE_AITER = "NSA_INDUCTOR_DISABLE_AITER"
ENV_DUMP_DIR = "NSA_INDUCTOR_DUMP_DIR"
ENV_AITER_AOT = "AITER_ENABLE_AOT_GLUON_PA_MQA_LOGITS"
ENV_CHECKS = "NSA_INDUCTOR_CHECKS"
ENV_DISABLE_PDL = "NSA_INDUCTOR_DISABLE_PDL"
ENV_DISABLE_HOST_PLANS = "NSA_INDUCTOR_DISABLE_HOST_PLANS"

LAYOUT_NAMES = ("flat", "paged", "preshuffle")
DEFAULT_PAGE_SIZE = 64
MAX_PAGE_SIZE = 1 << 16  # a page is P * 132 bytes; kernels index slots as page * P + i in 32 bits
PRESHUFFLE_MIN_TRITON = (3, 5)  # aiter JIT-compiles its gluon paged-MQA kernels from Triton 3.5
AOT_MAX_TRITON = (3, 4)  # aiter's ahead-of-time gluon bundle asserts Triton < 3.4 (an ABI change in 3.4)
PDL_MIN_TRITON = (3, 4)  # Triton's `launch_pdl` and `gdc_wait` (triton-lang/triton#6394)
GLUON_ARCHS = ("gfx942", "gfx950", "gfx1250")  # aiter's _GLUON_PA_MQA_LOGITS_ARCHS
AITER_CHUNK_K = 256  # deepgemm_fp8_paged_mqa_logits' ChunkK: it asserts ChunkK % P == 0 or P % ChunkK == 0
AITER_DIST = "amd-aiter"  # aiter's distribution name (setup.py PACKAGE_NAME)

# What the aiter dispatch relies on, as (function, keyword or None for the function itself, first aiter release
# that has it). Read in ROCm/aiter's tags: aiter/ops/cache.py, aiter/ops/triton/{attention/,}pa_mqa_logits.py,
# fp8_mqa_logits.py, aiter/ops/topk.py. Signature inspection of the installed aiter wins over the version where it
# tells something: aiter's compiled ops (``@compile_ops``: the cache ops, top-k before 0.1.17) show only
# ``(*args, **kwargs)``, so for them the version decides.
AITER_FEATURES: dict[str, tuple[str, str | None, tuple[int, ...]]] = {
    "quant_store": ("indexer_k_quant_and_cache", None, (0, 1, 7)),
    "quant_store_preshuffle": ("indexer_k_quant_and_cache", "preshuffle", (0, 1, 13)),
    "gather": ("cp_gather_indexer_k_quant_cache", None, (0, 1, 7)),
    "gather_preshuffle": ("cp_gather_indexer_k_quant_cache", "preshuffle", (0, 1, 13)),
    "paged_logits": ("deepgemm_fp8_paged_mqa_logits", "KVBlockSize", (0, 1, 8)),  # with Preshuffle
    "ragged_logits": ("fp8_mqa_logits", None, (0, 1, 7)),
    "clean_logits": ("fp8_mqa_logits", "clean_logits", (0, 1, 15)),
    "topk": ("top_k_per_row_decode", "k", (0, 1, 14)),  # k fixed at 2048 before
}
# aiter 0.1.14-0.1.16's top_k_per_row_decode may launch its multi-block kernel (a cross-block spin barrier; chosen
# from the allocated row width): from 0.1.17 decode is always one block per row (aiter #3773).
TOPK_ONE_BLOCK_SINCE = (0, 1, 17)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _version_tuple(version: str | None) -> tuple[int, ...]:
    if not version:
        return ()
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def aiter_preshuffle_page_sizes(gfx_arch: str = "") -> str:
    """The preshuffle page sizes aiter's paged-MQA kernel accepts, in words (for error messages)."""
    if gfx_arch == "gfx1250":
        return "16, 32, 64, 128 or 256 (gfx1250: ChunkK 256 must be a multiple of the page size)"
    return "16, 32, 64, 128 or a multiple of 256 (aiter's ChunkK 256: 256 % P == 0 or P % 256 == 0)"


def aiter_preshuffle_page_ok(page_size: int, gfx_arch: str = "") -> bool:
    if page_size % 16:
        return False
    if gfx_arch == "gfx1250":
        return AITER_CHUNK_K % page_size == 0
    return AITER_CHUNK_K % page_size == 0 or page_size % AITER_CHUNK_K == 0


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
    aiter_version: str | None = None  # the installed amd-aiter's version (None: unknown)
    gfx_arch: str = ""  # e.g. "gfx942" (ROCm only)
    aiter_aot_bundle: bool = False  # aiter's configs/paged_mqa_logits/aot kernels are present
    # "function" and "function.keyword" names found by inspecting the installed aiter, "function.*" for a function
    # whose signature tells nothing (sorted, so the cache key is the same in every process); None: not inspected,
    # the version decides.
    aiter_params: tuple[str, ...] | None = None
    index_checks: bool = False  # NSA_INDUCTOR_CHECKS: every nsa op call asserts its index arguments
    cuda_arch: int = 0  # NVIDIA compute capability as major * 10 + minor (90: H100/H200); 0 elsewhere
    pdl_disabled: bool = False  # NSA_INDUCTOR_DISABLE_PDL
    host_plans_disabled: bool = False  # NSA_INDUCTOR_DISABLE_HOST_PLANS (lowering/_host_plans.py)

    def aiter_has(self, feature: str) -> bool:
        """Whether the installed aiter has ``feature`` (a key of ``AITER_FEATURES``)."""
        function, keyword, since = AITER_FEATURES[feature]
        if self.aiter_params is not None and f"{function}.*" not in self.aiter_params:
            return (f"{function}.{keyword}" if keyword else function) in self.aiter_params
        return _version_tuple(self.aiter_version) >= since

    @property
    def gluon_paged_logits(self) -> str | None:
        """Why aiter's gluon paged-MQA kernels (the only preshuffle ones) cannot run here; ``None`` if they can."""
        if self.gfx_arch not in GLUON_ARCHS:
            return f"gluon paged-MQA kernels need {'/'.join(GLUON_ARCHS)}, this GPU is {self.gfx_arch or 'unknown'}"
        triton = _version_tuple(self.triton_version)
        if triton >= PRESHUFFLE_MIN_TRITON:
            return None
        if not self.aiter_aot:
            return f"Triton {self.triton_version} < 3.5 and {ENV_AITER_AOT} is not set"
        if triton >= AOT_MAX_TRITON:
            return f"Triton {self.triton_version}: aiter's AOT gluon path needs Triton < 3.4, its JIT path >= 3.5"
        if not self.aiter_aot_bundle:
            return f"{ENV_AITER_AOT}=1 but aiter's AOT kernel bundle (configs/paged_mqa_logits/aot) is not installed"
        return None

    @property
    def use_aiter(self) -> bool:
        return self.platform == "rocm" and self.aiter_available and not self.aiter_disabled

    @property
    def use_triton(self) -> bool:
        return self.platform in ("cuda", "rocm") and self.triton_version is not None

    @property
    def programmatic_launch(self) -> bool:
        """Whether the Triton kernels are launched as programmatic dependent launches (``_triton_common.launch``,
        ``wait_for_previous_grid``): NVIDIA from Hopper (sm_90) on with Triton >= 3.4, unless NSA_INDUCTOR_DISABLE_PDL
        is set."""
        return (self.platform == "cuda" and self.cuda_arch >= 90 and not self.pdl_disabled
                and _version_tuple(self.triton_version) >= PDL_MIN_TRITON)

    @property
    def warp_threads(self) -> int:
        """Threads of a Triton warp: 64 on CDNA GPUs (gfx9, wave64), else 32. Kernels whose scan order follows the
        threads' layout (top-k's ``_prefix_sum``) are told it; a wrong figure costs speed, never the result."""
        return 64 if self.platform == "rocm" and self.gfx_arch.startswith("gfx9") else 32

    @property
    def kernel_backend(self) -> str:
        if self.use_aiter:
            return "aiter"
        return "triton" if self.use_triton else "torch"

    @property
    def preshuffle_unusable(self) -> str | None:
        """Why aiter's preshuffle paged-MQA kernel cannot run here (``None``: it can): it needs aiter >= 0.1.8 and
        >= 0.1.13 for the preshuffled cache store, a gluon GPU, and gluon (Triton >= 3.5) or the AOT bundle."""
        if not self.aiter_has("paged_logits"):
            return f"aiter {self.aiter_version or '(unknown version)'} has no Preshuffle/KVBlockSize (aiter >= 0.1.8)"
        if not self.aiter_has("quant_store_preshuffle"):
            return (f"aiter {self.aiter_version or '(unknown version)'}'s indexer_k_quant_and_cache has no preshuffle "
                    "(aiter >= 0.1.13)")
        return self.gluon_paged_logits

    @property
    def preshuffle_usable(self) -> bool:
        return self.preshuffle_unusable is None


def _platform() -> tuple[str, str]:
    if not torch.cuda.is_available():
        return "cpu", "cpu"
    name = torch.cuda.get_device_name(0)
    return ("rocm" if torch.version.hip else "cuda"), name


def _gfx_arch() -> str:
    """``gfx942`` from ``gcnArchName`` (which may read ``gfx942:sramecc+:xnack-``)."""
    return getattr(torch.cuda.get_device_properties(0), "gcnArchName", "").split(":")[0]


def _cuda_arch() -> int:
    major, minor = torch.cuda.get_device_capability(0)
    return major * 10 + minor


def _rocm_fp8_dtype(arch: str) -> torch.dtype:
    """gfx942 (MI300) uses the fnuz fp8 encoding; later ROCm GPUs use OCP e4m3fn."""
    return torch.float8_e4m3fnuz if arch.startswith("gfx94") else torch.float8_e4m3fn


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _aiter_aot_bundle() -> bool:
    """aiter loads its AOT gluon kernels from ``aiter/ops/triton/configs/paged_mqa_logits/aot`` (found, not imported)."""
    spec = importlib.util.find_spec("aiter")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return any(os.path.isdir(os.path.join(r, "ops", "triton", "configs", "paged_mqa_logits", "aot")) for r in roots)


_AITER_MODULES = {
    "indexer_k_quant_and_cache": ("aiter.ops.cache",),
    "cp_gather_indexer_k_quant_cache": ("aiter.ops.cache",),
    "deepgemm_fp8_paged_mqa_logits": ("aiter.ops.triton.attention.pa_mqa_logits", "aiter.ops.triton.pa_mqa_logits"),
    "fp8_mqa_logits": ("aiter.ops.triton.attention.fp8_mqa_logits", "aiter.ops.triton.fp8_mqa_logits"),
    "top_k_per_row_decode": ("aiter.ops.topk",),
}


def _aiter_params() -> tuple[str, ...] | None:
    """The aiter functions the dispatch uses and their keywords, by signature inspection (ROCm, first use only).

    A function wrapped as ``(*args, **kwargs)`` (aiter's ``@compile_ops``) is listed as ``"function.*"``: its
    features are then decided by the version. ``None`` when aiter does not import."""
    import inspect

    found: set[str] = set()
    for function, modules in _AITER_MODULES.items():
        for module_name in modules:
            try:
                fn = getattr(importlib.import_module(module_name), function)
            except Exception:  # noqa: BLE001 - a missing or broken aiter module means: not available
                continue
            found.add(function)
            try:
                params = inspect.signature(fn).parameters
            except (TypeError, ValueError):
                params = {}
            if not params or all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
                found.add(f"{function}.*")
            else:
                found.update(f"{function}.{name}" for name in params)
            break
    return tuple(sorted(found)) if found else None


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
    rocm = platform == "rocm"
    arch = _gfx_arch() if rocm else ""
    aiter_available = rocm and importlib.util.find_spec("aiter") is not None
    aiter_disabled = _env_flag(ENV_DISABLE_AITER)
    use = aiter_available and not aiter_disabled
    return Capability(
        platform=platform,
        device_name=device_name,
        aiter_available=aiter_available,
        aiter_disabled=aiter_disabled,
        triton_version=_triton_version(),
        aiter_aot=os.environ.get(ENV_AITER_AOT) == "1",  # aiter itself accepts exactly "1"
        preshuffle_disabled=_env_flag(ENV_DISABLE_PRESHUFFLE),
        fp8_dtype=_rocm_fp8_dtype(arch) if rocm else torch.float8_e4m3fn,
        aiter_version=_dist_version(AITER_DIST) if aiter_available else None,
        gfx_arch=arch,
        aiter_aot_bundle=use and _aiter_aot_bundle(),
        aiter_params=_aiter_params() if use else None,
        index_checks=_env_flag(ENV_CHECKS),
        cuda_arch=_cuda_arch() if platform == "cuda" else 0,
        pdl_disabled=_env_flag(ENV_DISABLE_PDL),
        host_plans_disabled=_env_flag(ENV_DISABLE_HOST_PLANS),
    )


# ---------------------------------------------------------------------------------------------------------------
# per-op aiter decision
# ---------------------------------------------------------------------------------------------------------------

AITER_OPS = ("quant_cache_store", "gather_k", "paged_mqa_logits", "mqa_logits", "topk_indices")


def aiter_refusal(cap: Capability, op: str, *, page_size: int = 1, preshuffle: bool = False,
                  heads: int | None = None, sorted: bool | None = None, prologue: bool = False) -> str | None:
    """Why aiter cannot serve this call of ``op`` on ``cap``'s machine; ``None`` when it can.

    Only static facts (shapes, flags, versions): a call the answer does not cover goes to the Triton kernel. A
    ``heads`` or ``sorted`` of ``None`` (unknown, for :func:`describe`) is not held against aiter.
    """
    if not cap.use_aiter:
        return "aiter not in use"
    version = cap.aiter_version or "(unknown version)"
    if op == "quant_cache_store":
        if not cap.aiter_has("quant_store"):
            return f"aiter {version} has no indexer_k_quant_and_cache (aiter >= 0.1.7)"
        if preshuffle and not cap.aiter_has("quant_store_preshuffle"):
            return f"aiter {version}'s indexer_k_quant_and_cache has no preshuffle (aiter >= 0.1.13)"
        if prologue:
            return "aiter's indexer_k_quant_and_cache has no rotation or RoPE prologue"
        return None
    if op == "gather_k":
        # cp_gather_indexer_k_quant_cache finds each output row's sequence in cu_seq_lens and does not skip rows
        # past cu_seq_lens[-1]: it reads an uninitialised batch index for them. num_tokens is static, cu[-1] is a
        # device value, so equality cannot be proven without a host sync: the Triton gather serves every call.
        return "cp_gather_indexer_k_quant_cache needs num_tokens == cu_seqlens[-1], a device value"
    if op == "paged_mqa_logits":
        if not cap.aiter_has("paged_logits"):
            return f"aiter {version}'s deepgemm_fp8_paged_mqa_logits has no Preshuffle/KVBlockSize (aiter >= 0.1.8)"
        if heads is not None and (not _power_of_two(heads) or heads % 16):
            return f"{heads} heads: aiter's paged-MQA kernels tile all heads at once (a power of two >= 16)"
        if preshuffle:
            # from aiter 0.1.13, where aiter's own cache store writes the layout its preshuffle kernel reads
            why = cap.preshuffle_unusable
            if why:
                return why
            if not aiter_preshuffle_page_ok(page_size, cap.gfx_arch):
                return f"preshuffle page_size {page_size} is not one of {aiter_preshuffle_page_sizes(cap.gfx_arch)}"
            return None
        if page_size != 1:
            # its non-preshuffle kernels read the block table as one slot per token (KVBlockSize is ignored)
            return f"row-major pages (page_size {page_size}): aiter's non-preshuffle kernel reads one slot per token"
        return None
    if op == "mqa_logits":
        if not cap.aiter_has("ragged_logits"):
            return f"aiter {version} has no fp8_mqa_logits (aiter >= 0.1.7)"
        if heads is not None and not _power_of_two(heads):
            return f"{heads} heads: aiter's fp8_mqa_logits asserts a power-of-two head count"
        return None
    if op == "topk_indices":
        if not cap.aiter_has("topk"):
            return f"aiter {version}'s top_k_per_row_decode has no k (fixed at 2048 before aiter 0.1.14)"
        if _version_tuple(cap.aiter_version) < TOPK_ONE_BLOCK_SINCE:
            return (f"aiter {version}'s top_k_per_row_decode may launch its multi-block kernel (cross-block spin "
                    "barrier); one block per row from aiter 0.1.17")
        if sorted:
            # its `sorted` argument is unused ((void)sorted); stable=True (0.1.20) orders by column, not by value
            return "sorted=True: aiter's top-k returns the set unordered"
        return None
    raise ValueError(f"op must be one of {AITER_OPS}, got {op!r}")


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
        raise ValueError(f"{source} must be a positive integer page size (1..{MAX_PAGE_SIZE}), got {value!r}") from None
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"{source} must be a positive integer page size (1..{MAX_PAGE_SIZE}), got {value!r}")
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
    if name == "preshuffle":
        cap = capability()
        if cap.use_aiter and cap.preshuffle_usable and not aiter_preshuffle_page_ok(page_size, cap.gfx_arch):
            raise ValueError(
                f"{source}=preshuffle with page_size={page_size}: aiter's paged-MQA kernel (used on this machine) "
                f"accepts preshuffle page sizes {aiter_preshuffle_page_sizes(cap.gfx_arch)}"
            )
    if name == "paged" and page_size == 1:
        raise ValueError(f"{source}=paged needs page_size > 1 (page_size 1 is the flat layout)")
    return KCacheLayout(page_size=page_size, preshuffle=name == "preshuffle")


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


@functools.cache
def _select_layout(layout: str | None, page_size: int | None, env_layout: str, env_page_size: str) -> LayoutDecision:
    """Each environment value is parsed only where it is used (an explicit argument makes it unused)."""
    if layout is not None:
        if layout != "flat" and page_size is None:
            page_size = _parse_page_size(env_page_size, ENV_PAGE_SIZE)
        return LayoutDecision(_explicit_layout(layout, page_size, "layout"), "requested by argument")
    if env_layout:
        if page_size is None and env_layout != "flat":
            page_size = _parse_page_size(env_page_size, ENV_PAGE_SIZE)
        return LayoutDecision(_explicit_layout(env_layout, page_size, ENV_LAYOUT), f"requested by {ENV_LAYOUT}")
    cap = capability()
    page = page_size or _parse_page_size(env_page_size, ENV_PAGE_SIZE) or DEFAULT_PAGE_SIZE
    if not cap.use_aiter:
        if page == 1:
            return LayoutDecision(KCacheLayout(page_size=1), "page_size 1 requested")
        return LayoutDecision(KCacheLayout(page_size=page), f"{cap.platform}: paged row-major")
    if page == 1:
        return LayoutDecision(KCacheLayout(page_size=1), "page_size 1 requested")
    if not aiter_preshuffle_page_ok(page, cap.gfx_arch):
        why = f"page_size {page} is not one of aiter's preshuffle sizes {aiter_preshuffle_page_sizes(cap.gfx_arch)}"
    elif cap.preshuffle_disabled:
        why = f"{ENV_DISABLE_PRESHUFFLE}=1"
    elif not cap.preshuffle_usable:
        why = cap.preshuffle_unusable
    else:
        return LayoutDecision(KCacheLayout(page_size=page, preshuffle=True), "rocm+aiter: preshuffle paged MQA")
    decision = LayoutDecision(KCacheLayout(page_size=1), f"rocm+aiter: preshuffle unusable ({why}); flat fallback")
    _warn_once(f"nsa_inductor: K-cache layout falls back to flat page_size=1 because {why}")
    return decision


def select_layout(layout: str | None = None, page_size: int | None = None) -> LayoutDecision:
    """The K-cache layout: an argument beats the environment, which beats the platform default.

    ``layout`` is one of ``flat``, ``paged``, ``preshuffle``; ``page_size`` applies to the paged layouts.
    ``NSA_INDUCTOR_LAYOUT`` / ``NSA_INDUCTOR_PAGE_SIZE`` are read on each call and validated only where used.
    Impossible requests (preshuffle with a page size that is not a multiple of 16, or outside aiter's sizes where
    aiter's preshuffle kernel would run; a page size outside 1..65536) raise ``ValueError``.
    """
    if page_size is not None:
        page_size = _parse_page_size(page_size, "page_size")
    return _select_layout(
        layout, page_size, os.environ.get(ENV_LAYOUT, "").strip().lower(), os.environ.get(ENV_PAGE_SIZE, "").strip()
    )


def cache_layout(decision: LayoutDecision, cache_shape: tuple) -> KCacheLayout:
    """The layout of a ``[num_pages, P * 132]`` cache: its own page size ``P`` (its shape, fixed at compile time,
    fixes it) with the guard's format decision (row-major or preshuffle). ``ValueError`` with the reason when the row
    size is not a whole number of tokens or contradicts the format (preshuffle with ``P % 16``, or a ``P`` aiter's
    preshuffle kernel cannot read where it runs). The decision stays part of the cache key; the shape is in the
    graph, so the resulting layout is too."""
    layout = decision.layout
    if len(cache_shape) != 2:
        return layout
    row = cache_shape[1]
    if row == layout.page_bytes:
        return layout
    if row % TOKEN_BYTES:
        raise ValueError(f"cache rows are {row} bytes, not a whole number of {TOKEN_BYTES}-byte tokens")
    page = row // TOKEN_BYTES
    if not layout.preshuffle:
        return KCacheLayout(page)
    if page % 16:
        raise ValueError(f"cache rows are {row} bytes ({page}-token pages), but the compile-time layout {layout} is "
                         "preshuffled, which needs pages of a multiple of 16 tokens")
    cap = capability()
    if cap.use_aiter and cap.preshuffle_usable and not aiter_preshuffle_page_ok(page, cap.gfx_arch):
        raise ValueError(f"cache rows are {row} bytes ({page}-token pages): aiter's preshuffle paged-MQA kernel "
                         f"(used on this machine) reads {aiter_preshuffle_page_sizes(cap.gfx_arch)}")
    return KCacheLayout(page, preshuffle=True)


def dump_dir_from_env() -> str | None:
    return os.environ.get(ENV_DUMP_DIR) or None


def aiter_routes(cap: Capability, layout: KCacheLayout) -> str:
    """Which implementation each op with an aiter kernel gets on ``cap`` for ``layout``, and why not aiter."""
    if not cap.use_aiter:
        return ""
    parts = []
    for op in AITER_OPS:
        why = aiter_refusal(cap, op, page_size=layout.page_size, preshuffle=layout.preshuffle)
        note = {"paged_mqa_logits": "power-of-two heads >= 16", "mqa_logits": "power-of-two heads",
                "topk_indices": "sorted=False", "quant_cache_store": "without a rotation or RoPE prologue"}.get(op)
        parts.append(f"{op}=triton [{why}]" if why else f"{op}=aiter" + (f" [{note}]" if note else ""))
    return " ops: " + ", ".join(parts)


def describe(decision: LayoutDecision | None = None, cap: Capability | None = None) -> str:
    """One line for logs and reports: the machine, the layout, and (ROCm with aiter) each op's kernel and why."""
    cap = cap or capability()
    decision = decision or select_layout()
    fp8 = str(cap.fp8_dtype).removeprefix("torch.")
    arch = f" {cap.gfx_arch}" if cap.gfx_arch else ""
    if cap.aiter_available:
        aiter = f"{cap.aiter_version or 'yes (version unknown)'}"
        if cap.aiter_disabled:
            aiter += f" (disabled by {ENV_DISABLE_AITER})"
    else:
        aiter = "no"
    checks = f" checks=on ({ENV_CHECKS})" if cap.index_checks else ""
    pdl = " pdl=on" if cap.programmatic_launch else (
        f" pdl=off ({ENV_DISABLE_PDL})" if cap.pdl_disabled and cap.platform == "cuda" else "")
    plans = f" host_plans=off ({ENV_DISABLE_HOST_PLANS})" if cap.host_plans_disabled else ""
    return (
        f"nsa_inductor: platform={cap.platform} ({cap.device_name}{arch}) kernels={cap.kernel_backend} "
        f"triton={cap.triton_version or 'none'} aiter={aiter} "
        f"fp8={fp8} layout={decision}{checks}{pdl}{plans}{aiter_routes(cap, decision.layout)}"
    )
