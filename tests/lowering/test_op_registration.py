"""``import nsa_inductor`` registers every ``torch.ops.nsa`` op without importing triton or aiter; each op's CUDA
kernel runs on its tensors' GPU."""

import contextlib
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import nsa_inductor  # noqa: F401 (registers the ops)
from helpers.ops64 import small_inputs
from nsa_inductor.lowering import _host_plans as host_plans

OPS = ["batched_mqa_logits", "gather_k", "gather_k_slots", "head_gate_gemm", "mqa_logits", "paged_mqa_logits",
       "quant_cache_store", "rotate_act_quant", "topk_indices", "wk_gate_gemm"]


def test_import_registers_every_op_without_triton_or_aiter():
    """In a fresh interpreter where importing triton fails: every op is there and its CPU reference runs."""
    code = textwrap.dedent(f"""
        import sys
        sys.modules["triton"] = None  # any import of triton now raises ImportError
        sys.modules["aiter"] = None
        import torch
        import nsa_inductor
        from helpers.ops64 import small_inputs

        names = sorted(n.removeprefix("nsa::") for n in torch._C._dispatch_get_all_op_names() if n.startswith("nsa::"))
        assert names == {OPS!r}, names
        inputs = small_inputs()
        for name in names:
            getattr(torch.ops.nsa, name)(*inputs[name])
        loaded = [m for m in sys.modules if m.split(".")[0] in ("triton", "aiter") and sys.modules[m] is not None]
        assert not loaded, loaded
        print("ok")
    """)
    tests_dir = pathlib.Path(__file__).resolve().parents[1]  # for helpers; its parent holds this tree's package
    path = [str(tests_dir.parent), str(tests_dir), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "ok"


class _OnGpu1(torch.Tensor):
    """A CPU tensor that says it lives on GPU 1 (what the device guard reads)."""
    __torch_function__ = torch._C._disabled_torch_function_impl

    def get_device(self) -> int:
        return 1


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("current", [0, 1])
def test_cuda_kernel_runs_on_its_first_arguments_gpu(name, current, monkeypatch):
    """The op's CUDA kernel makes its first argument's GPU the current device while it runs, as ATen's do (Triton
    launches on the current device), and leaves the current device as it found it; it switches nothing where that
    GPU is already current. Driven on the CPU: the kernel called through the dispatcher's CUDA key with a first
    argument that says it is on GPU 1, the device switch recorded. (On two GPUs: test_kernels_gpu.py,
    ``test_calls_run_on_their_tensors_gpu_not_the_current_one``.)"""
    state = {"device": current, "switches": [], "seen": []}

    @contextlib.contextmanager
    def device(index):
        state["switches"].append(index)
        before, state["device"] = state["device"], index
        try:
            yield
        finally:
            state["device"] = before

    def run(op, body, args):
        state["seen"].append(state["device"])
        return body(*args)

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: state["device"], raising=False)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(host_plans, "run", run)
    first, *rest = small_inputs()[name]
    cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    getattr(torch.ops.nsa, name).default.redispatch(cuda, first.as_subclass(_OnGpu1), *rest)
    assert state["seen"] == [1]
    assert state["switches"] == ([] if current == 1 else [1])
    assert state["device"] == current
