"""The ``nsa_rocm`` torch.compile backend and :func:`install` for users who keep their own Inductor config."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from .cached_reports import reports_kept_with_cache
from .options import parse_options
from .pass_manager import NsaPassManager
from .verify import reference_graph, verified

# Round bf16 intermediates inside fused kernels as eager does: without it the K fed to act_quant differs in the last
# bf16 bit and the cache bytes stop matching eager. Users may still override it in ``options``.
EAGER_NUMERICS = {"emulate_precision_casts": True}

# Let a single-use pointwise chain grow to 12 reads / 64 ops before Inductor stores it (its GPU defaults: 8 / 30; its
# CPU defaults: 12 / 50). RoPE with the cos/sin gather reads 9-10 buffers in ~40-54 ops: under the GPU defaults it
# is stored, and its write-back into the head slice plus the fp32 cast for the Hadamard GEMM become a second kernel,
# for q and for k. Only where intermediates are stored changes, never the arithmetic. ``options`` may override it.
ROPE_FUSION = {"realize_acc_reads_threshold": 12, "realize_opcount_threshold": 64}
INDUCTOR_SETTINGS = {**EAGER_NUMERICS, **ROPE_FUSION}


def nsa_rocm(gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None,
             options: dict[str, Any] | None = None):
    """Inductor with the nsa pass manager as its post-grad custom pass.

    Reached as ``torch.compile(fn, backend="nsa_rocm")`` through the ``torch_dynamo_backends`` entry point.
    ``nsa.*`` options configure the passes; the other options and ``mode`` go to Inductor unchanged. A graph served
    from Inductor's caches reports what its passes did when it was compiled (:mod:`.cached_reports`).
    """
    import torch._inductor
    from torch._inductor.compile_fx import compile_fx

    nsa_options, inductor_options = parse_options(options)
    patches: dict[str, Any] = dict(INDUCTOR_SETTINGS)
    patches.update(torch._inductor.list_mode_options(mode) if mode else {})
    patches.update(inductor_options)
    existing = inductor_options.get("post_grad_custom_post_pass", torch._inductor.config.post_grad_custom_post_pass)
    manager = NsaPassManager(nsa_options, inner=existing)
    patches["post_grad_custom_post_pass"] = manager
    reference = reference_graph(gm) if nsa_options.verify else None
    with _eager_layer_norm(nsa_options.eager_layer_norm), _rounding_casts_kept(), \
            reports_kept_with_cache(gm, example_inputs, manager) as (reports, inner_compile):
        compiled = compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)
    if reference is None:
        return compiled
    cache_bytes_passes = {p.name for p in manager.passes if p.may_change_cache_bytes}
    return verified(compiled, reference, int(nsa_options.verify), reports[-1] if reports else None,
                    cache_bytes_passes, nsa_options.layout_decision())


@contextlib.contextmanager
def _rounding_casts_kept():
    """While compiling, keep ``x.to(bf16).float()`` chains: they round, and eager rounds there.

    Inductor's joint-graph ``pointless_convert`` rewrite folds a chain of float conversions into one. Some torch
    releases (2.11, the H200's) fold even a narrowing-then-widening chain, which drops the bf16 rounding of
    ``rotate_activation``'s output before ``act_quant``: measured 239 K-cache bytes and 3% of q's fp8 values off
    eager, while each op compiled alone was bit-exact. Newer releases keep such chains; wrapping is then a no-op.
    """
    from torch._inductor.fx_passes import joint_graph

    fold = joint_graph.pointless_convert
    entries = [entry for group in joint_graph.patterns.patterns.values() for entry in group
               if getattr(entry, "handler", None) is fold]

    def fold_lossless_only(match, arg, dtype1, dtype2):
        source = arg.meta.get("val")
        if isinstance(source, torch.Tensor) and not _lossless_float_cast(source.dtype, dtype1):
            return
        fold(match, arg, dtype1, dtype2)

    for entry in entries:
        entry.handler = fold_lossless_only
    try:
        yield
    finally:
        for entry in entries:
            entry.handler = fold


def _lossless_float_cast(source: torch.dtype, target: torch.dtype) -> bool:
    return source == target or (source.is_floating_point and target.is_floating_point
                                and target.itemsize > source.itemsize)


@contextlib.contextmanager
def _eager_layer_norm(enabled: bool):
    """While compiling, leave ``native_layer_norm`` undecomposed so it runs eager's kernel: Inductor's generated
    reduction sums in another order, which flips the last bf16 bit of some K values before act_quant.

    The default decomposition tables are edited in place for the duration (a custom table passed to ``compile_fx``
    would make the FX graph cache bypass: its entries cannot be pickled into a cache key): the module's table and
    the copy ``select_decomp_table`` caches on the first Inductor compile of the process, which is what Inductor
    reads from then on (measured: after a default-Inductor compile, LayerNorm was Inductor's again).
    """
    if not enabled:
        yield
        return
    from torch._inductor.decomposition import decompositions, select_decomp_table

    _layer_norm_fallback()
    op = torch.ops.aten.native_layer_norm.default
    tables = list({id(table): table for table in (decompositions, select_decomp_table())}.values())
    saved = [table.pop(op, None) for table in tables]
    try:
        yield
    finally:
        for table, entry in zip(tables, saved):
            if entry is not None:
                table[op] = entry


@functools.cache
def _layer_norm_fallback() -> None:
    """Lower an undecomposed ``native_layer_norm`` to the ATen kernel. Other compiles still decompose it before
    lowering, so they never reach this lowering."""
    from torch._inductor.lowering import lowerings, make_fallback

    if torch.ops.aten.native_layer_norm.default not in lowerings:
        make_fallback(torch.ops.aten.native_layer_norm.default, warn=False, override_decomp=True)


class install:
    """Install the nsa pass manager into an Inductor config (default: ``torch._inductor.config``).

    ``nsa_inductor.install()`` installs it for good; ``with nsa_inductor.install():`` restores the previous pass on
    exit. A pass already set there keeps running, after the nsa passes. Like the backend, it turns on
    ``emulate_precision_casts`` so compiled code rounds bf16 intermediates as eager does, and the RoPE fusion
    thresholds (``ROPE_FUSION``).
    """

    def __init__(self, options: dict[str, Any] | None = None, config=None):
        import torch._inductor.config

        nsa_options, inductor_options = parse_options(options)
        if inductor_options:
            raise ValueError(f"install() takes nsa.* options only, got {sorted(inductor_options)}")
        if nsa_options.verify:
            raise ValueError("nsa.verify needs the nsa_rocm backend (torch.compile(fn, backend=\"nsa_rocm\", "
                             "options={\"nsa.verify\": True})): install() only sets a pass, it never sees the calls")
        self.config = config if config is not None else torch._inductor.config
        self.previous = {"post_grad_custom_post_pass": self.config.post_grad_custom_post_pass,
                         **{k: getattr(self.config, k) for k in INDUCTOR_SETTINGS}}
        self.manager = NsaPassManager(nsa_options, inner=self.previous["post_grad_custom_post_pass"])
        self.config.post_grad_custom_post_pass = self.manager
        for key, value in INDUCTOR_SETTINGS.items():
            setattr(self.config, key, value)
        self._active = _ACTIVE.setdefault(id(self.config), [])
        self._active.append(self)

    def __enter__(self) -> NsaPassManager:
        return self.manager

    def __exit__(self, *exc) -> None:
        """Handles may exit in any order: one exiting under a later one hands what it found to that one."""
        if self not in self._active:
            return
        i = self._active.index(self)
        if i + 1 < len(self._active):
            self._active[i + 1].previous = self.previous
        else:
            for key, value in self.previous.items():
                setattr(self.config, key, value)
        self._active.pop(i)


# Handles of ``install`` still active, oldest first, per Inductor config object.
_ACTIVE: dict[int, list[install]] = {}
