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
_function = _common._function  # (the real one, where a test replaces it)


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


def _call(op, args, log, monkeypatch, direct: bool) -> tuple:
    """One call, through its plan or (``direct``) the op itself: (its launches as logged, its allocations as
    (address, bytes, sizes, strides, dtype), its outputs the same way or None)."""
    start, allocated, run = len(log), Allocations(), host_plans.run

    def observed(name, body, a):  # inside the op's kernel, where its own ATen ops are seen
        with allocated:
            return body(*a) if direct else run(name, body, a)

    with monkeypatch.context() as m:
        m.setattr(host_plans, "run", observed)
        out = op(*args)

    def described(t):
        return None if t is None else (t.data_ptr(), t.untyped_storage().nbytes(), tuple(t.shape), t.stride(), t.dtype)

    return log[start:], [described(t) for t in allocated.tensors], [
        described(t) for t in (out if isinstance(out, tuple) else (out,))]


def _assert_same_launches(replayed, direct):
    """The replay launched what the op did: the same kernels, grids and literals, the arguments' addresses, and for
    each of the op's allocations one range of one of the replay's, at a fixed shift keeping each address's 16-byte
    alignment, the ranges of different allocations apart; and it returned the same arguments, or allocations of the
    same sizes, strides and dtypes."""
    (r_log, r_allocations, r_outputs), (d_log, d_allocations, d_outputs) = replayed, direct

    def inside(value, allocations):
        if isinstance(value, int) and not isinstance(value, bool):
            for j, (address, size, *_) in enumerate(allocations):
                if address <= value < address + max(size, 1):
                    return j, value - address
        return None

    shifts: dict[int, tuple[int, int]] = {}  # the op's allocation -> (the replay's allocation, shift)

    def same(d_value, r_value) -> bool:
        d, r = inside(d_value, d_allocations), inside(r_value, r_allocations)
        if d is None or r is None:
            return d is None and r is None and d_value == r_value
        shift = (r[0], r[1] - d[1])
        return shifts.setdefault(d[0], shift) == shift and r_value % 16 == d_value % 16  # (what Triton specialised)

    assert len(r_log) == len(d_log)
    for (d_kernel, d_grid, d_arguments), (r_kernel, r_grid, r_arguments) in zip(d_log, r_log):
        assert (d_kernel, d_grid, len(d_arguments)) == (r_kernel, r_grid, len(r_arguments))
        assert all(same(d, r) for d, r in zip(d_arguments, r_arguments)), d_kernel
    ranges = sorted((r, shift, shift + d_allocations[j][1]) for j, (r, shift) in shifts.items())
    assert all(shift >= 0 and end <= r_allocations[r][1] for r, shift, end in ranges)
    assert all(r1 != r2 or end1 <= start2 for (r1, _, end1), (r2, start2, _) in zip(ranges, ranges[1:]))
    assert len(r_outputs) == len(d_outputs)
    for d, r in zip(d_outputs, r_outputs):
        if d is None or inside(d[0], d_allocations) is None:  # None, or an argument
            assert d == r
            continue
        j, r_index = inside(d[0], d_allocations)[0], inside(r[0], r_allocations)[0]
        assert d[1:] == r[1:] and shifts.get(j, (r_index, 0)) == (r_index, 0)


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
        _assert_same_launches(replayed, _call(op, args, launches, monkeypatch, direct=True))
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


def test_threads_record_and_replay_on_their_own(launches, monkeypatch):
    """A recording is its thread's (the dispatch mode and the current recording are thread-local): with calls from
    several threads at once, each a signature's first, second or later, every call makes its own launches, no more
    and no fewer, and the plan left replays what the op launches."""
    import threading

    case, errors = "top-k 8 x 8192 sorted, columns", []

    def calls():
        try:
            for _ in range(5):
                op, args = CASES[case]()
                op(*args)
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=calls) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(launches) == 4 * 5 * 4  # threads x calls x this top-k's launches
    op, args = CASES[case]()
    _assert_same_launches(_call(op, args, launches, monkeypatch, direct=False),
                          _call(op, args, launches, monkeypatch, direct=True))


def test_an_argument_that_cannot_be_hashed_runs_the_op_in_full():
    called = []
    assert host_plans.run("an_op", lambda *a: called.append(a) or 7, (torch.zeros(2), [1, 2])) == 7
    assert len(called) == 1 and not host_plans._SEEN
