"""The aiter dispatch against recording stand-ins for aiter's modules (no ROCm needed).

The stand-ins have the signatures published in ROCm/aiter (aiter/ops/cache.py,
aiter/ops/triton/attention/{pa_mqa_logits,fp8_mqa_logits}.py) and record how they were called.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

from nsa_inductor.capability import Capability
from nsa_inductor.lowering import _aiter_common, _common
from nsa_inductor.lowering.gather_k import aiter as gather_k_aiter
from nsa_inductor.lowering.mqa_logits import aiter as mqa_logits_aiter
from nsa_inductor.lowering.paged_mqa_logits import aiter as paged_mqa_logits_aiter
from nsa_inductor.lowering.quant_cache_store import aiter as quant_cache_store_aiter
from helpers.ops64 import FN, FNUZ, random_cache, random_fp8

NEW_TRITON_PKG = "aiter.ops.triton.attention"  # since aiter moved its Triton files into folders (2026-01)
OLD_TRITON_PKG = "aiter.ops.triton"


class Recorder:
    def __init__(self):
        self.calls: list[tuple[str, inspect.BoundArguments]] = []

    def bind(self, fn, *args, **kwargs) -> inspect.BoundArguments:
        bound = inspect.signature(fn).bind(*args, **kwargs)
        self.calls.append((fn.__name__, bound))
        return bound


def _install(monkeypatch, triton_pkg: str, with_clean_logits: bool = True) -> Recorder:
    rec = Recorder()

    def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, preshuffle=False):
        rec.bind(indexer_k_quant_and_cache, k, kv_cache, slot_mapping, quant_block_size, scale_fmt,
                 preshuffle=preshuffle)
        kv_cache[0, 0, 0] = torch.tensor(1.0).to(kv_cache.dtype)  # proves the view aliases the uint8 cache

    def cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, preshuffle=False):
        rec.bind(cp_gather_indexer_k_quant_cache, kv_cache, dst_k, dst_scale, block_table, cu_seq_lens,
                 preshuffle=preshuffle)
        dst_scale[0] = torch.tensor([0.5]).view(torch.uint8)  # through the byte view into the fp32 output

    def deepgemm_fp8_paged_mqa_logits(q_fp8, kv_cache, weights, out_logits, context_lens, kv_indices, max_model_len,
                                      Preshuffle=False, KVBlockSize=1, ChunkK=256, TotalCuCount=None, WavePerEU=2,
                                      VarCtxSchedule=None):
        rec.bind(deepgemm_fp8_paged_mqa_logits, q_fp8, kv_cache, weights, out_logits, context_lens, kv_indices,
                 max_model_len, Preshuffle=Preshuffle, KVBlockSize=KVBlockSize)
        out_logits.fill_(float("nan"))  # what aiter leaves in columns it does not visit: anything
        next_n = q_fp8.shape[1]
        for row in range(out_logits.shape[0]):
            visible = int(context_lens[row // next_n]) - next_n + row % next_n + 1
            out_logits[row, : max(visible, 0)] = 2.0

    def fp8_mqa_logits_new(Q, KV, kv_scales, weights, cu_starts, cu_ends, clean_logits=True):
        rec.bind(fp8_mqa_logits_new, Q, KV, kv_scales, weights, cu_starts, cu_ends, clean_logits=clean_logits)
        aligned = torch.full((Q.shape[0], 256), 3.0)
        return aligned[:, : KV.shape[0]]  # aiter returns a column slice of a 256-aligned buffer

    def fp8_mqa_logits_old(Q, KV, kv_scales, weights, cu_starts, cu_ends):
        rec.bind(fp8_mqa_logits_old, Q, KV, kv_scales, weights, cu_starts, cu_ends)
        return torch.full((Q.shape[0], KV.shape[0]), 3.0)

    fp8_fn = fp8_mqa_logits_new if with_clean_logits else fp8_mqa_logits_old
    fp8_fn.__name__ = "fp8_mqa_logits"
    modules = {
        "aiter": {},
        "aiter.ops": {},
        "aiter.ops.cache": {"indexer_k_quant_and_cache": indexer_k_quant_and_cache,
                            "cp_gather_indexer_k_quant_cache": cp_gather_indexer_k_quant_cache},
        "aiter.ops.triton": {},
        f"{triton_pkg}.pa_mqa_logits": {"deepgemm_fp8_paged_mqa_logits": deepgemm_fp8_paged_mqa_logits},
        f"{triton_pkg}.fp8_mqa_logits": {"fp8_mqa_logits": fp8_fn},
    }
    if triton_pkg == NEW_TRITON_PKG:
        modules[NEW_TRITON_PKG] = {}
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        for key, value in attrs.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, name, module)
    for cached in (_aiter_common.cache_ops, paged_mqa_logits_aiter._paged_logits_fn,
                   mqa_logits_aiter._ragged_logits_fn):
        cached.cache_clear()
    return rec


@pytest.fixture(autouse=True)
def _clear_caches():
    yield
    for cached in (_aiter_common.cache_ops, paged_mqa_logits_aiter._paged_logits_fn,
                   mqa_logits_aiter._ragged_logits_fn, mqa_logits_aiter._accepts_clean_logits):
        cached.cache_clear()


@pytest.mark.parametrize("layout", [(1, False), (64, True), (16, False)])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
def test_quant_cache_store_wiring(monkeypatch, layout, scale_fmt):
    rec = _install(monkeypatch, NEW_TRITON_PKG)
    page_size, preshuffle = layout
    cache = torch.zeros(3, page_size * 132, dtype=torch.uint8)
    k = torch.randn(5, 128).bfloat16()
    slots = torch.tensor([0, 1, -1, 2, 3], dtype=torch.int32)
    quant_cache_store_aiter.quant_cache_store(k, cache, slots, page_size, preshuffle, scale_fmt, FNUZ)
    [(name, call)] = rec.calls
    assert name == "indexer_k_quant_and_cache"
    args = call.arguments
    assert args["k"] is k
    kv = args["kv_cache"]
    assert kv.shape == (3, page_size, 132) and kv.dtype == FNUZ and kv.data_ptr() == cache.data_ptr()
    in_cache = [s if s < 3 * page_size else -1 for s in slots.tolist()]  # out of range: -1, docs/indices.md
    assert args["slot_mapping"].dtype == torch.int64 and args["slot_mapping"].tolist() == in_cache
    assert args["quant_block_size"] == 128 and args["scale_fmt"] == scale_fmt
    assert args.get("preshuffle", False) is preshuffle  # passed only when set: older aiter lacks the parameter
    assert cache[0, 0] == torch.tensor(1.0).to(FNUZ).view(torch.uint8)


def test_quant_cache_store_wiring_applies_the_input_epilogue_first(monkeypatch):
    """aiter quantizes what it is given: the scaled, bf16-rounded K, not the fp32 GEMM output."""
    rec = _install(monkeypatch, NEW_TRITON_PKG)
    y = torch.randn(5, 128) * 30
    quant_cache_store_aiter.quant_cache_store(y, torch.zeros(3, 64 * 132, dtype=torch.uint8), torch.arange(5), 64,
                                              True, "ue8m0", FNUZ, 128**-0.5, torch.bfloat16)
    [(name, call)] = rec.calls
    assert torch.equal(call.arguments["k"], (y * 128**-0.5).bfloat16())


def test_gather_k_wiring(monkeypatch):
    rec = _install(monkeypatch, NEW_TRITON_PKG)
    cache = torch.zeros(4, 64 * 132, dtype=torch.uint8)
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cu = torch.tensor([0, 70, 90], dtype=torch.int32)
    k, scale = gather_k_aiter.gather_k(cache, block_table, cu, 64, True, 96, FN)
    [(name, call)] = rec.calls
    assert name == "cp_gather_indexer_k_quant_cache"
    args = call.arguments
    assert args["kv_cache"].shape == (4, 64, 132) and args["kv_cache"].dtype == FN
    assert args["dst_k"] is k and k.shape == (96, 128) and k.dtype == FN
    assert args["dst_scale"].shape == (96, 4) and args["dst_scale"].dtype == torch.uint8
    assert args["block_table"] is block_table and args["cu_seq_lens"] is cu and args["preshuffle"] is True
    assert scale.dtype == torch.float32 and scale.shape == (96,) and scale[0] == 0.5
    assert not k[90:].view(torch.uint8).any() and not scale[90:].any(), "rows past cu_seqlens[-1] must be zero"


@pytest.mark.parametrize("triton_pkg", [NEW_TRITON_PKG, OLD_TRITON_PKG])
@pytest.mark.parametrize("next_n", [1, 2])
def test_paged_mqa_logits_wiring_and_inf_fill(monkeypatch, triton_pkg, next_n):
    rec = _install(monkeypatch, triton_pkg)
    gen = torch.Generator().manual_seed(0)
    cache = random_cache(4, 64, FN, gen)
    q = random_fp8((2, next_n, 32, 128), FN, gen)
    weights = torch.randn(2 * next_n, 32)
    ctx = torch.tensor([0, 70], dtype=torch.int32)
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    out = paged_mqa_logits_aiter.paged_mqa_logits(q, cache, weights, ctx, block_table, 300, 64, True)
    [(name, call)] = rec.calls
    assert name == "deepgemm_fp8_paged_mqa_logits"
    args = call.arguments
    assert args["q_fp8"] is q and args["weights"] is weights and args["out_logits"] is out
    kv = args["kv_cache"]
    assert kv.shape == (4, 64, 1, 132) and kv.dtype == FN and kv.data_ptr() == cache.data_ptr()
    assert args["context_lens"] is ctx and args["kv_indices"] is block_table and args["max_model_len"] == 300
    assert args["Preshuffle"] is True and args["KVBlockSize"] == 64
    assert out.shape == (2 * next_n, 300)
    for row in range(2 * next_n):
        visible = max(int(ctx[row // next_n]) - next_n + row % next_n + 1, 0)
        assert (out[row, :visible] == 2.0).all() and torch.isneginf(out[row, visible:]).all()


@pytest.mark.parametrize("triton_pkg", [NEW_TRITON_PKG, OLD_TRITON_PKG])
@pytest.mark.parametrize("with_clean_logits", [True, False])
def test_mqa_logits_wiring(monkeypatch, triton_pkg, with_clean_logits):
    rec = _install(monkeypatch, triton_pkg, with_clean_logits)
    gen = torch.Generator().manual_seed(0)
    q, k = random_fp8((6, 16, 128), FN, gen), random_fp8((9, 128), FN, gen)
    k_scale, weights = torch.rand(9), torch.randn(6, 16)
    ks, ke = torch.zeros(6, dtype=torch.int32), torch.arange(1, 7, dtype=torch.int32)
    out = mqa_logits_aiter.mqa_logits(q, k, k_scale, weights, ks, ke)
    [(name, call)] = rec.calls
    assert name == "fp8_mqa_logits"
    args = call.arguments
    assert [args[n] for n in ("Q", "KV", "kv_scales", "weights", "cu_starts", "cu_ends")] == [q, k, k_scale, weights,
                                                                                            ks, ke]
    assert args.get("clean_logits", True) is True
    assert out.shape == (6, 9) and out.is_contiguous()


def test_op_routes_to_aiter(monkeypatch):
    rec = _install(monkeypatch, NEW_TRITON_PKG)
    monkeypatch.setattr(_common, "choose_backend", lambda op, device, fp8_dtype: "aiter")
    gen = torch.Generator().manual_seed(0)
    cache = random_cache(2, 16, FN, gen)
    torch.ops.nsa.quant_cache_store(torch.randn(3, 128).bfloat16(), cache, torch.tensor([0, 1, 2]), 16, True, "ue8m0")
    torch.ops.nsa.paged_mqa_logits(random_fp8((1, 1, 16, 128), FN, gen), cache, torch.randn(1, 16),
                                   torch.tensor([5], dtype=torch.int32), torch.tensor([[1, 0]], dtype=torch.int32),
                                   32, 16, True)
    assert [name for name, _ in rec.calls] == ["indexer_k_quant_and_cache", "deepgemm_fp8_paged_mqa_logits"]


def _capability(platform: str, aiter: bool, fp8: torch.dtype) -> Capability:
    return Capability(platform=platform, device_name="test", aiter_available=aiter, aiter_disabled=False,
                      triton_version="3.6.0", aiter_aot=False, preshuffle_disabled=False, fp8_dtype=fp8)


@pytest.mark.parametrize(
    "platform, aiter, op, fp8, want",
    [
        ("rocm", True, "paged_mqa_logits", FNUZ, "aiter"),
        ("rocm", True, "paged_mqa_logits", FN, "triton"),  # aiter's fp8 type is the platform's
        ("rocm", False, "mqa_logits", FNUZ, "triton"),
        ("cuda", False, "quant_cache_store", FN, "triton"),
        ("cuda", False, "quant_cache_store", FNUZ, "torch"),  # no fnuz in Triton on NVIDIA
        ("cuda", False, "gather_k", FNUZ, "triton"),  # a byte copy
    ],
)
def test_backend_choice(monkeypatch, platform, aiter, op, fp8, want):
    cap = _capability(platform, aiter, FNUZ if platform == "rocm" else FN)
    monkeypatch.setattr(_common, "capability", lambda: cap)
    assert _common.choose_backend(op, torch.device("cuda"), fp8) == want
    assert _common.choose_backend(op, torch.device("cpu"), fp8) == "torch"
