"""The per-call host path of the nsa ops: argument checks run once per call signature on real tensors, and in full
for fake tensors; host-side launch arithmetic equals Triton's."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from nsa_inductor.lowering._common import once_per_signature
from nsa_inductor.lowering.quant_cache_store.reference import quant_cache_store as reference


def _counting():
    calls = []

    @once_per_signature
    def validate(x, cache, n):
        calls.append(n)
        if x.dtype != torch.float32:
            raise ValueError(f"x must be float32, got {x.dtype}")

    return validate, calls


def test_a_repeated_signature_is_checked_once():
    validate, calls = _counting()
    x, cache = torch.zeros(4, 8), torch.zeros(2, 132, dtype=torch.uint8)
    for _ in range(3):
        validate(x, cache, 5)
    validate(torch.ones(4, 8), cache.clone(), 5)  # other tensors, same signature
    assert calls == [5]


@pytest.mark.parametrize("change", ["shape", "dtype", "contiguity", "scalar", "size-1"])
def test_another_signature_is_checked_again(change):
    validate, calls = _counting()
    x, cache = torch.zeros(4, 8), torch.zeros(2, 132, dtype=torch.uint8)
    validate(x, cache, 5)
    other = {"shape": (torch.zeros(5, 8), cache, 5), "dtype": (x, cache.to(torch.int8), 5),
             "contiguity": (x, torch.zeros(132, 2, dtype=torch.uint8).t(), 5), "scalar": (x, cache, 6),
             "size-1": (torch.zeros(1, 8), cache, 5)}[change]
    validate(*other)
    assert len(calls) == 2


def test_a_failing_signature_fails_every_time():
    validate, calls = _counting()
    bad = torch.zeros(4, 8, dtype=torch.float16)
    for _ in range(2):
        with pytest.raises(ValueError, match="float32"):
            validate(bad, torch.zeros(1), 5)
    assert len(calls) == 2


def test_fake_tensors_are_always_checked():
    validate, calls = _counting()
    with FakeTensorMode():
        x, cache = torch.zeros(4, 8), torch.zeros(2, 132, dtype=torch.uint8)
        validate(x, cache, 5)
        validate(x, cache, 5)
    assert len(calls) == 2


def test_symbolic_sizes_are_always_checked():
    """Under symbolic tracing (a compile with dynamic shapes) an argument may be a SymInt, which cannot be hashed."""
    from torch.fx.experimental.proxy_tensor import make_fx

    validate, calls = _counting()
    cache = torch.zeros(2, 132, dtype=torch.uint8)

    def traced(x):
        validate(x, cache, x.shape[0])
        validate(x, cache, x.shape[0])
        return x + 1

    make_fx(traced, tracing_mode="symbolic")(torch.zeros(4, 8))
    assert len(calls) == 2


def test_an_op_still_refuses_bad_arguments_after_good_calls():
    q = torch.zeros(2, 1, 16, 128, dtype=torch.float8_e4m3fn)
    cache = torch.zeros(4, 64 * 132, dtype=torch.uint8)
    weights, lens = torch.zeros(2, 16), torch.full((2,), 64, dtype=torch.int32)
    table = torch.zeros(2, 2, dtype=torch.int32)
    for _ in range(2):
        torch.ops.nsa.paged_mqa_logits(q, cache, weights, lens, table, 128, 64, False)
    with pytest.raises(ValueError, match="context_lens"):
        torch.ops.nsa.paged_mqa_logits(q, cache, weights, lens.long(), table, 128, 64, False)


def test_host_launch_arithmetic_equals_triton():
    triton = pytest.importorskip("triton")
    from nsa_inductor.lowering._triton_common import cdiv, next_power_of_2

    assert all(next_power_of_2(n) == triton.next_power_of_2(n) for n in range(1, 4097))
    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 300) for b in range(1, 40))


def test_quant_cache_store_bumps_the_cache_version_once_per_call():
    """A plain dispatcher kernel (``nsa_op``) bumps the mutated argument's version itself, once however many writes
    its body makes: the mutation stays visible to autograd's version check, the bytes land in the cache, the other
    arguments keep their versions; by keyword too."""
    cache = torch.zeros(2, 64 * 132, dtype=torch.uint8)
    k, slots = torch.randn(3, 128), torch.tensor([0, 5, 70])
    versions = cache._version, k._version, slots._version
    torch.ops.nsa.quant_cache_store(k, cache, slots, 64, False, "ue8m0")
    assert (cache._version, k._version, slots._version) == (versions[0] + 1, *versions[1:])
    expected = torch.zeros_like(cache)
    reference(k, expected, slots, 64, False, "ue8m0", torch.float8_e4m3fn)
    assert torch.equal(cache, expected)
    torch.ops.nsa.quant_cache_store(k=k, cache=cache, slot_mapping=slots, page_size=64, preshuffle=False,
                                    scale_fmt="ue8m0")
    assert cache._version == versions[0] + 2
