"""The ``nsa_rocm`` torch.compile backend and :func:`install` for users who keep their own Inductor config."""

from __future__ import annotations

from typing import Any

import torch

from .options import NsaOptions, parse_options
from .pass_manager import NsaPassManager

# Round bf16 intermediates inside fused kernels as eager does: without it the K fed to act_quant differs in the last
# bf16 bit and the cache bytes stop matching eager. Users may still override it in ``options``.
EAGER_NUMERICS = {"emulate_precision_casts": True}


def nsa_rocm(gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None,
             options: dict[str, Any] | None = None):
    """Inductor with the nsa pass manager as its post-grad custom pass.

    Reached as ``torch.compile(fn, backend="nsa_rocm")`` through the ``torch_dynamo_backends`` entry point.
    ``nsa.*`` options configure the passes; the other options and ``mode`` go to Inductor unchanged.
    """
    import torch._inductor
    from torch._inductor.compile_fx import compile_fx

    nsa_options, inductor_options = parse_options(options)
    patches: dict[str, Any] = dict(EAGER_NUMERICS)
    patches.update(torch._inductor.list_mode_options(mode) if mode else {})
    patches.update(inductor_options)
    existing = inductor_options.get("post_grad_custom_post_pass", torch._inductor.config.post_grad_custom_post_pass)
    patches["post_grad_custom_post_pass"] = NsaPassManager(nsa_options, inner=existing)
    return compile_fx(gm, example_inputs, config_patches=patches, decompositions=_decompositions(nsa_options))


def _decompositions(options: NsaOptions) -> dict:
    """Inductor's decomposition table, less ``native_layer_norm`` when eager's LayerNorm kernel is kept: Inductor's
    generated reduction sums in another order, which flips the last bf16 bit of some K values before act_quant."""
    from torch._inductor.decomposition import select_decomp_table

    table = dict(select_decomp_table())
    if options.eager_layer_norm:
        table.pop(torch.ops.aten.native_layer_norm.default, None)
    return table


class install:
    """Install the nsa pass manager into an Inductor config (default: ``torch._inductor.config``).

    ``nsa_inductor.install()`` installs it for good; ``with nsa_inductor.install():`` restores the previous pass on
    exit. A pass already set there keeps running, after the nsa passes. Like the backend, it turns on
    ``emulate_precision_casts`` so compiled code rounds bf16 intermediates as eager does.
    """

    def __init__(self, options: dict[str, Any] | None = None, config=None):
        import torch._inductor.config

        nsa_options, inductor_options = parse_options(options)
        if inductor_options:
            raise ValueError(f"install() takes nsa.* options only, got {sorted(inductor_options)}")
        self.config = config if config is not None else torch._inductor.config
        self.previous = {"post_grad_custom_post_pass": self.config.post_grad_custom_post_pass,
                         **{k: getattr(self.config, k) for k in EAGER_NUMERICS}}
        self.manager = NsaPassManager(nsa_options, inner=self.previous["post_grad_custom_post_pass"])
        self.config.post_grad_custom_post_pass = self.manager
        for key, value in EAGER_NUMERICS.items():
            setattr(self.config, key, value)

    def __enter__(self) -> NsaPassManager:
        return self.manager

    def __exit__(self, *exc) -> None:
        for key, value in self.previous.items():
            setattr(self.config, key, value)
