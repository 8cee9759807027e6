"""Host plans (``lowering/_host_plans.py``): from the third call of a signature an op replays what its second call
launched. On the CPU, with the machine made an H200 as the ops see it and Triton's launch replaced by a log (nothing
runs), each op's replay must launch exactly what the op itself launches for the same arguments: the same kernels,
grids, constexprs and arguments, each address the same argument's or the same allocation's, and return the same
allocations; calls a plan cannot stand for must run in full. The GPU test (``test_kernels_gpu.py``) checks replayed
results against the kernels'."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import nsa_inductor.capability as cap_mod  # noqa: E402
from nsa_inductor.lowering import _common, _host_plans as host_plans  # noqa: E402
from helpers.op_calls import CASES, lengths as _lengths  # noqa: E402
from helpers.simulated_gpu import simulated_h200  # noqa: E402

nsa = torch.ops.nsa


@pytest.fixture
def launches():
    """The launch log of a simulated H200 (``helpers.simulated_gpu``)."""
    with simulated_h200() as log:
        yield log


class Allocations(TorchDispatchMode):
    """The tensors a call allocates, in order."""

    def __init__(self):
        super().__init__()
        self.tensors: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in host_plans._ALLOCATIONS:
            self.tensors.append(out)
        return out


def _described(value, allocations: list[torch.Tensor]):
    """A launch argument or an output with the call's allocations named by their order: an address inside
    allocation j as ("allocation", j, offset); anything else (sizes, the arguments' addresses) as it is."""
    if isinstance(value, torch.Tensor):
        value = value.data_ptr()
    if isinstance(value, int) and not isinstance(value, bool):
        for j, t in enumerate(allocations):
            if t.data_ptr() <= value < t.data_ptr() + max(t.numel() * t.element_size(), 1):
                return "allocation", j, value - t.data_ptr()
    return value


def _call(op, args, log, monkeypatch, direct: bool) -> tuple:
    """One call, through its plan or (``direct``) the op itself: (its launches, its allocations' sizes, strides and
    dtypes, its outputs), allocations named."""
    start, allocated, run = len(log), Allocations(), host_plans.run

    def observed(name, body, a):  # inside the op's kernel, where its own ATen ops are seen
        with allocated:
            return body(*a) if direct else run(name, body, a)

    with monkeypatch.context() as m:
        m.setattr(host_plans, "run", observed)
        out = op(*args)
    tensors = allocated.tensors
    launched = [(kernel, grid, tuple(_described(v, tensors) for v in arguments))
                for kernel, grid, arguments in log[start:]]
    outputs = [_described(t, tensors) if t is not None else None for t in (out if isinstance(out, tuple) else (out,))]
    return launched, [(tuple(t.shape), t.stride(), t.dtype) for t in tensors], outputs


@pytest.mark.parametrize("case", list(CASES))
def test_a_replayed_call_launches_what_the_op_launches(launches, monkeypatch, case):
    op, args = CASES[case]()
    op(*args)  # compiles (Triton's launch)
    op(*CASES[case]()[1])  # recorded
    key = host_plans.signature(str(op).split(".")[1], args)
    assert isinstance(host_plans._PLANS.get(key), host_plans.Plan), case
    replays = []
    replay = host_plans.Plan.replay
    monkeypatch.setattr(host_plans.Plan, "replay", lambda plan, a: replays.append(1) or replay(plan, a))
    for _ in range(2):  # other tensors, the same signature
        args = CASES[case]()[1]
        replayed = _call(op, args, launches, monkeypatch, direct=False)
        assert replayed == _call(op, args, launches, monkeypatch, direct=True)  # the op itself, same arguments
        assert replayed[0]
    assert replays == [1, 1]


def test_a_plan_is_recorded_at_the_second_call_and_replayed_from_the_third(launches, monkeypatch):
    op, args = CASES["paged logits"]()
    key = host_plans.signature("paged_mqa_logits", args)
    replays = []
    replay = host_plans.Plan.replay
    monkeypatch.setattr(host_plans.Plan, "replay", lambda plan, a: replays.append(1) or replay(plan, a))
    op(*args)
    assert key in host_plans._SEEN and key not in host_plans._PLANS
    op(*args)
    assert isinstance(host_plans._PLANS[key], host_plans.Plan) and not replays
    op(*args)
    assert replays == [1]


def _decided(op, args) -> object:
    for _ in range(3):
        op(*args)
    return host_plans._PLANS.get(host_plans.signature(str(op).split(".")[1], args), "undecided")


@pytest.mark.parametrize("case", ["copied input", "one tensor twice", "a view returned", "empty tensors"])
def test_a_call_a_plan_cannot_stand_for_runs_in_full(launches, monkeypatch, caplog, case):
    """Empty tensors share their (null) storage address: which one a launch or an output is, is unknown."""
    logits, lengths = torch.empty(64, 8192), _lengths(64, 1, 8192)
    if case == "empty tensors":
        op, args = nsa.topk_indices, (torch.empty(0, 4096), 2048)
    elif case == "copied input":  # logits.contiguous() copies: an ATen op the plan would not replay
        op, args = nsa.topk_indices, (torch.empty(8192, 64).t(), 2048, lengths)
    elif case == "one tensor twice":  # lengths and offset one tensor: which one a launch took is unknown
        op, args = nsa.topk_indices, (logits, 2048, lengths, lengths)
    else:
        head_gate = nsa.head_gate_gemm.default
        monkeypatch.setattr(_common, "_function", lambda op, backend: (
            lambda *a: _function(op, backend)(*a)[:, :1]) if op == "head_gate_gemm" else _function(op, backend))
        op, args = head_gate, (torch.empty(64, 7168, dtype=torch.bfloat16), torch.empty(64, 7168), 4, False)
    with caplog.at_level("INFO", logger="nsa_inductor"):
        assert _decided(op, args) is None
    why = {"copied input": "aten.clone", "one tensor twice": "of several", "a view returned": "an output",
           "empty tensors": "an output"}[case]
    assert [r.getMessage() for r in caplog.records if "no host plan" in r.getMessage() and why in r.getMessage()]
    before = len(launches)
    op(*args)
    assert len(launches) > before or case == "empty tensors"  # the op itself ran


_function = _common._function


def test_the_torch_reference_never_has_a_plan(caplog):
    """On a CPU machine the ops run their references: recorded once (their ATen ops), never replayed, and not
    logged as a call without a plan (there is nothing to say)."""
    host_plans.clear()
    logits = torch.randn(4, 300)
    want = torch.topk(logits, 20).indices.sort(dim=1).values
    with caplog.at_level("INFO", logger="nsa_inductor"):
        for _ in range(3):
            got = nsa.topk_indices(logits, 20)
            assert torch.equal(got.long().sort(dim=1).values, want)
    assert host_plans._PLANS[host_plans.signature("topk_indices", (logits, 20))] is None
    assert not [r for r in caplog.records if "no host plan" in r.getMessage()]
    host_plans.clear()


@pytest.mark.parametrize("when", ["a launch hook is set", "a graph is captured", "another device is current"])
def test_a_plan_is_not_replayed(launches, monkeypatch, when):
    op, args = CASES["top-k 64 x 8192 sorted"]()
    for _ in range(2):
        op(*args)
    if when == "a launch hook is set":
        hook = triton.knobs.runtime.launch_enter_hook
        monkeypatch.setattr(hook, "calls", [lambda metadata: None])
    elif when == "a graph is captured":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: True, raising=False)
    else:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
        monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    monkeypatch.setattr(host_plans.Plan, "replay", lambda plan, a: pytest.fail("replayed"))
    before = len(launches)
    op(*args)
    assert len(launches) == before + 3  # the sorted 64 x 8192 top-k's launches, made by the op itself


def test_another_alignment_is_another_signature(launches):
    logits = torch.empty(64 * 8192 + 1)
    aligned, off = logits[:64 * 8192].view(64, 8192), logits[1:].view(64, 8192)
    assert host_plans.signature("topk_indices", (aligned, 2048)) != host_plans.signature("topk_indices", (off, 2048))


def test_the_switch_turns_plans_off(launches, monkeypatch):
    monkeypatch.setenv(cap_mod.ENV_DISABLE_HOST_PLANS, "1")
    cap_mod.capability.cache_clear()
    op, args = CASES["gather"]()
    for _ in range(3):
        op(*args)
    assert not host_plans._PLANS and not host_plans._SEEN
    assert "host_plans=off" in cap_mod.describe()


def test_a_tensor_inside_an_argument_is_its_address_plus_an_offset():
    buf, other = torch.zeros(100), torch.zeros(8)
    recording = host_plans.Recording((other, buf, 5))
    assert recording._where(buf[10:].view(torch.int32)) == (host_plans.ARGUMENT, 1, 40)
    assert recording._where(buf) == (host_plans.ARGUMENT, 1, 0)
    assert recording._where(torch.zeros(3)) is None  # of no argument or allocation


def test_an_aiter_call_never_has_a_plan(launches, monkeypatch):
    """aiter's kernels launch outside ``launch``: a call routed to aiter never records, even one whose every launch
    went through it (here the Triton function stands in for aiter's)."""
    monkeypatch.setattr(_common, "choose_backend", lambda op, device, *a, **k: "aiter")
    monkeypatch.setattr(_common, "_function", lambda op, backend: _function(op, "triton"))
    assert _decided(*CASES["top-k 64 x 8192 set"]()) is None


def test_index_checks_keep_running_every_call(launches, monkeypatch):
    """With NSA_INDUCTOR_CHECKS the op asserts its indices (ATen ops reading device values): no plan skips them."""
    monkeypatch.setenv(cap_mod.ENV_CHECKS, "1")
    cap_mod.capability.cache_clear()
    assert _decided(*CASES["paged logits"]()) is None
