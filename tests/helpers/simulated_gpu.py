"""An H200 as the nsa ops see it, on a CPU machine: CUDA sm_90, the Triton implementations and the launch cache, with
CPU tensors; Triton's compile and launch replaced, so that nothing runs and every launch is logged. For what runs on
the host around the kernels: the host plans' tests and ``benchmarks/host_python.py``."""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Iterator

import pytest
import torch
import triton

import nsa_inductor.capability as cap_mod
from nsa_inductor.lowering import _common, _host_plans, _triton_common


@contextlib.contextmanager
def simulated_h200() -> Iterator[list[tuple]]:
    """Yields the launch log: (kernel, grid, "Triton's launch") for a launch through Triton's own path (its first of a
    signature), (kernel, grid, arguments with the constexprs after them) for one from the launch cache."""
    log: list[tuple] = []
    cuda = torch.device("cuda")
    choose, triton_or_reference = _common.choose_backend, _common.triton_or_reference

    def compiled_run(kernel, *args, grid, warmup, **keywords):
        def launcher(gx, gy, gz, stream, function, metadata, described, enter, leave, *arguments):
            log.append((function, (gx, gy, gz), arguments))
        log.append((kernel.fn.__name__, grid, "Triton's launch"))
        return types.SimpleNamespace(run=launcher, function=kernel.fn.__name__, packed_metadata=(4, 1, 0),
                                     launch_metadata=lambda *a: None)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(cap_mod, "_platform", lambda: ("cuda", "simulated H200"))
        m.setattr(cap_mod, "_cuda_arch", lambda: 90)
        cap_mod.capability.cache_clear()
        _triton_common._programmatic_launch.cache_clear()
        m.setattr(_common, "choose_backend", lambda op, device, *a, **k: choose(op, cuda, *a, **k))
        for module in [m_ for name, m_ in sys.modules.items() if name.startswith("nsa_inductor.lowering")]:
            if getattr(module, "triton_or_reference", None) is triton_or_reference:
                m.setattr(module, "triton_or_reference",
                          lambda op, device, fp8_dtype=None: triton_or_reference(op, cuda, fp8_dtype))
        m.setattr(_triton_common, "_CUDA_AVAILABLE", True)
        m.setattr(_triton_common, "_LAUNCHES", {})
        m.setattr(torch.cuda, "current_device", lambda: 0)
        m.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        m.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
        m.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
        m.setattr(triton.runtime.JITFunction, "run", compiled_run)
        _host_plans.clear()
        try:
            yield log
        finally:
            _host_plans.clear()
    cap_mod.capability.cache_clear()
    _triton_common._programmatic_launch.cache_clear()
