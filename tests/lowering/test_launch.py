"""``_triton_common.launch``: Triton's launch without its per-call binding. The key must hold everything Triton
specialises a kernel on (else a repeated key would run a kernel compiled for other arguments), and a repeated key
must launch with this call's arguments, never the first call's."""

from __future__ import annotations

import types

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from nsa_inductor.lowering import _triton_common as common  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, NEGATE: tl.constexpr = False,
                 PDL: tl.constexpr = False):
    common.wait_for_previous_grid(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    y = tl.load(y_ptr + offs, mask=offs < n)
    out = alpha * x + y
    tl.store(out_ptr + offs, -out if NEGATE else out, mask=offs < n)


def test_the_key_tells_apart_what_triton_specialises_on():
    buf = torch.zeros(64)

    def key(args):
        return common._launch_arguments(args)[0]

    assert key((buf,)) == key((torch.ones(64),))  # another aligned fp32 tensor
    assert key((buf,)) != key((buf[1:],))  # 4 bytes off 16-byte alignment
    assert key((buf,)) != key((buf.half(),))
    assert key((1,)) != key((2,)) != key((16,))
    assert key((16,)) == key((32,)) and key((3,)) == key((5,))
    assert key((2**31 - 16,)) != key((2**31,))  # i32 against i64
    assert key((2**63 - 16,)) != key((2**63,))  # i64 against u64
    assert key((True,)) != key((1,)) and key((True,)) != key((False,))
    assert key((0.5,)) == key((3.0,)) != key((3,))
    assert key((None,)) != key((buf,))
    assert key((torch.nn.Parameter(buf),)) == key((buf,))  # a subclass: the same specialisation


def test_the_launcher_gets_tensors_as_their_addresses():
    buf, half = torch.zeros(64), torch.zeros(8).half()
    _, values = common._launch_arguments((buf, 7, half[1:], 0.5, None, torch.nn.Parameter(buf), True))
    assert values == [buf.data_ptr(), 7, half.data_ptr() + 2, 0.5, None, buf.data_ptr(), True]


class CudaLauncher:
    """Stand-in for Triton 3.6's launcher object (backends/nvidia/driver.py, ``CudaLauncher``; the fast path knows it
    by its name): records what it is called with, as the object and as its C function."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self):
        self.calls = []

    def launch(self, *args):
        self.calls.append(("C function", args))

    def __call__(self, *args):
        self.calls.append(("object", args))


@pytest.mark.parametrize("version, direct", [("3.6.0", True), ("3.9.0", False)])
def test_a_repeated_key_calls_tritons_launcher_with_this_calls_arguments(monkeypatch, version, direct):
    """On a CPU machine, with Triton's launch and the CUDA calls replaced by stand-ins: the second call of a
    signature reaches the launcher (its C function on Triton 3.6) with this call's addresses, sizes and grid, the
    kernel's constexprs, and no hooks while Triton's hook chains are empty."""
    launcher = CudaLauncher()
    compiled = types.SimpleNamespace(run=launcher, function=11, packed_metadata=(4, 1, 0),
                                     launch_metadata=lambda grid, stream, *args: ("described", grid))
    compiles = []
    monkeypatch.setattr(common, "_CUDA_AVAILABLE", True)
    monkeypatch.setattr(common, "_LAUNCHES", {})
    monkeypatch.setattr(common, "_programmatic_launch", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 99, raising=False)
    monkeypatch.setattr(triton, "__version__", version)
    monkeypatch.setattr(_axpy_kernel, "run", lambda *args, grid, warmup, **kw: compiles.append(grid) or compiled)
    x, y, out = torch.zeros(40), torch.zeros(40), torch.zeros(40)
    common.launch(_axpy_kernel, (1,), x, y, out, 40, 2.0, BLOCK=32)
    assert compiles == [(1,)] and not launcher.calls  # the first call: Triton's own launch
    x2 = torch.zeros(48)[8:]  # another address, the same alignment
    common.launch(_axpy_kernel, (2,), x2, y, out, 40, 0.5, BLOCK=32)
    hooks = triton.knobs.runtime
    assert not getattr(hooks.launch_enter_hook, "calls", None)  # (an empty chain, or none)
    seen = []
    hooks.launch_enter_hook.add(seen.append)
    try:
        common.launch(_axpy_kernel, (3,), x2, y, out, 40, 0.5, BLOCK=32)
    finally:
        hooks.launch_enter_hook.remove(seen.append)
    assert compiles == [(1,)]
    arguments = (x2.data_ptr(), y.data_ptr(), out.data_ptr(), 40, 0.5, 32, False, False)  # BLOCK, NEGATE, PDL
    before = (False, True, None, None) if direct else ()
    assert launcher.calls == [
        ("C function" if direct else "object", (2, 1, 1, 99, 11, *before, (4, 1, 0), None, None, None, *arguments)),
        ("C function" if direct else "object", (3, 1, 1, 99, 11, *before, (4, 1, 0), ("described", (3, 1, 1)),
                                                hooks.launch_enter_hook, None, *arguments))]


def _axpy(n: int, offset: int = 0, alpha: float = 2.0, **keywords):
    """``alpha * x + y`` with a power-of-two ``alpha``: exact whether or not the kernel fuses it into an FMA."""
    x, y = (torch.randn(n + offset, device="cuda")[offset:] for _ in range(2))
    out = torch.full((n + offset + 8,), 7.0, device="cuda")[offset:]
    common.launch(_axpy_kernel, (triton.cdiv(n, 32),), x, y, out, n, alpha, BLOCK=32, **keywords)
    want = alpha * x + y
    assert torch.equal(out[:n], -want if keywords.get("NEGATE") else want)
    assert (out[n:] == 7.0).all()  # nothing written past n


@pytest.mark.gpu
@gpu
def test_repeated_keys_launch_with_their_own_arguments():
    common._LAUNCHES.clear()
    cases = [dict(n=100), dict(n=1), dict(n=16), dict(n=17, offset=1), dict(n=100, alpha=-0.25),
             dict(n=64, NEGATE=True), dict(n=100, offset=3)]
    for case in cases:
        _axpy(**case)
    known = len(common._LAUNCHES)
    # five keys on CUDA (alpha's value and the size of a misalignment are not Triton's business); none on ROCm
    assert known == (0 if torch.version.hip else 5)
    for _ in range(2):
        for case in cases:  # the fast path: fresh tensors, the same keys
            _axpy(**case)
    assert len(common._LAUNCHES) == known
    if torch.version.hip is None:
        x, y, out = torch.randn(100), torch.randn(100, device="cuda"), torch.empty(100, device="cuda")
        with pytest.raises((ValueError, RuntimeError), match="cpu tensor"):  # a known key but for the device
            common.launch(_axpy_kernel, (4,), x, y, out, 100, 2.0, BLOCK=32)


@pytest.mark.gpu
@gpu
def test_a_runtime_argument_by_keyword_is_never_a_fixed_tail():
    common._LAUNCHES.clear()
    for n in (40, 40, 9):
        x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        out = torch.empty(n, device="cuda")
        common.launch(_axpy_kernel, (triton.cdiv(n, 32),), x, y, out, n=n, alpha=0.5, BLOCK=32)
        assert torch.equal(out, 0.5 * x + y)
    assert not common._LAUNCHES


@pytest.mark.gpu
@gpu
def test_the_fast_path_is_captured_by_a_cuda_graph():
    n = 300
    x, y, out = torch.randn(n, device="cuda"), torch.randn(n, device="cuda"), torch.empty(n, device="cuda")

    def step():
        common.launch(_axpy_kernel, (triton.cdiv(n, 32),), x, y, out, n, 4.0, BLOCK=32)

    step()
    step()  # known key from here on
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x.copy_(torch.randn(n, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, 4.0 * x + y)
