"""``_triton_common.launch``: Triton's launch without its per-call binding. The key must hold everything Triton
specialises a kernel on (else a repeated key would run a kernel compiled for other arguments), and a repeated key
must launch with this call's arguments, never the first call's."""

from __future__ import annotations

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
    key = common._argument_key
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
