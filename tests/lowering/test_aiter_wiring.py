"""The ROCm aiter dispatch against a stand-in built from aiter's source (``tests/helpers/fake_aiter.py``).

The ops run through their real dispatch (``choose_backend`` on a simulated machine) with CPU tensors: a call routed to
aiter runs the stand-in, which checks what aiter checks and computes what aiter computes (including its wrong reads);
a call routed to Triton runs the torch reference (same contract). Every result is compared with the reference, so a
call aiter cannot serve fails here unless the dispatch sends it to Triton.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nsa_inductor import capability as cap_mod
from nsa_inductor.lowering import _aiter_common, _common
from nsa_inductor.lowering.gather_k import aiter as gather_k_aiter
from nsa_inductor.lowering.gather_k.reference import gather_k as gather_ref
from nsa_inductor.lowering.mqa_logits import aiter as mqa_logits_aiter
from nsa_inductor.lowering.mqa_logits.reference import mqa_logits as ragged_ref
from nsa_inductor.lowering.paged_mqa_logits import aiter as paged_mqa_logits_aiter
from nsa_inductor.lowering.paged_mqa_logits.reference import paged_mqa_logits as paged_ref
from nsa_inductor.lowering.quant_cache_store.reference import quant_cache_store as store_ref
from nsa_inductor.lowering.topk_indices import aiter as topk_aiter
from nsa_inductor.indexer import hadamard_matrix
from helpers.fake_aiter import AiterFault, Machine, install
from helpers.ops64 import FN, FNUZ, adversarial_topk_logits, assert_topk_valid, random_fp8, random_paged_cache

# One machine per aiter release family (what changed between them, read in aiter's tags).
FAMILIES = {
    "0.1.7": Machine((0, 1, 7)),     # cache ops without preshuffle; paged logits without Preshuffle/KVBlockSize
    "0.1.9": Machine((0, 1, 9)),     # Preshuffle/KVBlockSize; modules still at aiter.ops.triton.<name>
    "0.1.12": Machine((0, 1, 12)),   # modules in aiter.ops.triton.attention; cache ops still without preshuffle
    "0.1.14": Machine((0, 1, 14)),   # cache ops with preshuffle; fp8_mqa_logits without clean_logits; top-k k=
    "0.1.17": Machine((0, 1, 17)),   # clean_logits (0.1.15); top-k decode always one block per row, plain Python
    "0.1.20": Machine((0, 1, 20)),   # top-k stable=, int32 words read from any seqLens
}


def _capability(machine: Machine, inspect_signatures: bool = False, **overrides) -> cap_mod.Capability:
    """The Capability of ``machine`` (fields the Capability of this checkout does not know are left out)."""
    values = dict(
        platform="rocm", device_name="simulated", aiter_available=True, aiter_disabled=False,
        triton_version=".".join(map(str, machine.triton)) + ".0", aiter_aot=machine.aot, preshuffle_disabled=False,
        fp8_dtype=FNUZ if machine.gfx_arch == "gfx942" else FN, aiter_version=".".join(map(str, machine.version)),
        gfx_arch=machine.gfx_arch, aiter_aot_bundle=machine.aot,
        aiter_params=cap_mod._aiter_params() if inspect_signatures else None,
    )
    values.update(overrides)
    known = {f.name for f in dataclasses.fields(cap_mod.Capability)}
    return cap_mod.Capability(**{k: v for k, v in values.items() if k in known})


def _clear_aiter_caches():
    for cached in (_aiter_common.cache_ops, paged_mqa_logits_aiter._paged_logits_fn,
                   mqa_logits_aiter._ragged_logits_fn, topk_aiter._topk_ops):
        cached.cache_clear()


@pytest.fixture(autouse=True)
def _clear_caches():
    _clear_aiter_caches()
    yield
    _clear_aiter_caches()
    cap_mod._select_layout.cache_clear()


def _simulate(monkeypatch, machine: Machine, inspect_signatures: bool = False) -> tuple[list, list]:
    """Install ``machine``'s aiter and route the ops' dispatch as on that machine; Triton runs the reference."""
    calls = install(monkeypatch, machine)
    cap = _capability(machine, inspect_signatures)
    monkeypatch.setattr(_common, "capability", lambda: cap)
    monkeypatch.setattr(cap_mod, "capability", lambda: cap)
    routes: list[tuple[str, str]] = []
    choose, function = _common.choose_backend, _common._function

    def routed_choose(op, device, fp8_dtype, **static):
        backend = choose(op, torch.device("cuda"), fp8_dtype, **static)
        routes.append((op, backend))
        return backend

    monkeypatch.setattr(_common, "choose_backend", routed_choose)
    monkeypatch.setattr(_common, "_function", lambda op, backend: function(op, "torch" if backend == "triton"
                                                                              else backend))
    return calls, routes


LAYOUTS = [(1, False), (16, False), (64, False), (64, True), (16, True), (48, True), (256, True)]


def _run_all_ops(fp8):
    """Each op on each layout through the dispatch; every result equal to the reference's."""
    gen = torch.Generator().manual_seed(0)
    for page_size, preshuffle in LAYOUTS:
        lengths = [70, 5]
        cache, block_table = random_paged_cache(lengths, page_size, fp8, gen)
        # store: padding slot, last slot of the cache
        k = torch.randn(4, 128, generator=gen).bfloat16() * 3
        capacity = cache.shape[0] * page_size
        slots = torch.tensor([3, -1, capacity - 1, 0])
        want = cache.clone()
        store_ref(k, want, slots, page_size, preshuffle, "ue8m0", fp8)
        got = cache.clone()
        torch.ops.nsa.quant_cache_store(k, got, slots, page_size, preshuffle, "ue8m0", fp8)
        assert torch.equal(got, want), f"quant_cache_store bytes differ for page_size={page_size} {preshuffle=}"
        # gather: 96 rows for 75 tokens (the op allows num_tokens > cu_seqlens[-1]; spare rows are zero)
        cu = torch.tensor([0, 70, 75], dtype=torch.int32)
        for rows in (75, 96):
            want_k, want_s = gather_ref(cache, block_table, cu, page_size, preshuffle, rows, fp8)
            got_k, got_s = torch.ops.nsa.gather_k(cache, block_table, cu, page_size, preshuffle, rows, fp8)
            assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8)) and torch.equal(got_s, want_s)
        # paged logits, next_n 2, 16 heads (aiter's tile) and 24 (not a power of two)
        for heads in (16, 24):
            q = random_fp8((2, 2, heads, 128), fp8, gen)
            weights = torch.randn(4, heads, generator=gen)
            ctx = torch.tensor(lengths, dtype=torch.int32)
            want = paged_ref(q, cache, weights, ctx, block_table, 80, page_size, preshuffle)
            got = torch.ops.nsa.paged_mqa_logits(q, cache, weights, ctx, block_table, 80, page_size, preshuffle)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=False)
    # ragged logits: 16 heads and 24 heads
    for heads in (16, 24):
        q, kv = random_fp8((6, heads, 128), fp8, gen), random_fp8((9, 128), fp8, gen)
        k_scale, weights = torch.rand(9, generator=gen) + 0.1, torch.randn(6, heads, generator=gen)
        ks, ke = torch.tensor([0, 0, 2, 3, 9, 4], dtype=torch.int32), torch.tensor([1, 4, 5, 9, 9, 2], dtype=torch.int32)
        got = torch.ops.nsa.mqa_logits(q, kv, k_scale, weights, ks, ke)
        assert got.is_contiguous()
        torch.testing.assert_close(got, ragged_ref(q, kv, k_scale, weights, ks, ke), rtol=1e-4, atol=1e-4)
    _run_topk_calls()


# (pad, sorted) of the top-k calls _run_topk_calls makes, in order
TOPK_CALLS = [("neg1", False), ("column", False), ("neg1", True)]


def _run_topk_calls():
    """Rows shorter and longer than k, a length past N, -inf inside a row, an offset (prefill: the columns before a
    row's offset are -inf); every result a valid top-k."""
    logits = adversarial_topk_logits(5, 40, "tail", 4)
    lengths = torch.tensor([3, 40, 25, 0, 70], dtype=torch.int32)
    offset = torch.tensor([0, 2, 5, 1, 7])
    logits[1, 3:9] = float("-inf")
    logits.masked_fill_(torch.arange(40)[None, :] < offset[:, None], float("-inf"))
    for pad, sorted_ in TOPK_CALLS:
        got = torch.ops.nsa.topk_indices(logits, 12, lengths, offset, pad, sorted_)
        assert_topk_valid(logits, got, 12, lengths, offset, pad, sorted_)


# Which calls each family serves with aiter (op, page_size, preshuffle) on gfx942 with Triton 3.5; top-k: which
# (pad, sorted) calls.
SERVED = {
    "0.1.7": {"quant_cache_store": {(1, False), (16, False), (64, False)}, "paged_mqa_logits": set(),
              "mqa_logits": "pow2"},
    "0.1.9": {"quant_cache_store": {(1, False), (16, False), (64, False)}, "paged_mqa_logits": {(1, False)},
              "mqa_logits": "pow2"},
    "0.1.12": {"quant_cache_store": {(1, False), (16, False), (64, False)}, "paged_mqa_logits": {(1, False)},
               "mqa_logits": "pow2"},
    "0.1.14": {"quant_cache_store": set(LAYOUTS), "paged_mqa_logits": {(1, False), (64, True), (16, True), (256, True)},
               "mqa_logits": "pow2"},
    "0.1.17": {"quant_cache_store": set(LAYOUTS), "paged_mqa_logits": {(1, False), (64, True), (16, True), (256, True)},
               "mqa_logits": "pow2", "topk_indices": {("neg1", False), ("column", False)}},
    "0.1.20": {"quant_cache_store": set(LAYOUTS), "paged_mqa_logits": {(1, False), (64, True), (16, True), (256, True)},
               "mqa_logits": "pow2", "topk_indices": {("neg1", False), ("column", False)}},
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_aiter_release_family(monkeypatch, family):
    """One test per aiter release family: every op on every layout gives the reference's result, and aiter serves
    exactly the calls that release can serve (the rest run the Triton kernel)."""
    machine = FAMILIES[family]
    calls, routes = _simulate(monkeypatch, machine)
    _run_all_ops(FNUZ)
    served = SERVED[family]
    got_store = [layout for layout, (op, backend) in zip(
        [lay for lay in LAYOUTS], [r for r in routes if r[0] == "quant_cache_store"]) if backend == "aiter"]
    assert set(got_store) == served["quant_cache_store"]
    assert all(backend != "aiter" for op, backend in routes if op == "gather_k")
    paged = [r for r in routes if r[0] == "paged_mqa_logits"]
    aiter_paged = {LAYOUTS[i // 2] for i, (_, backend) in enumerate(paged) if backend == "aiter"}
    assert aiter_paged == served["paged_mqa_logits"]
    assert all(paged[i][1] != "aiter" for i in range(1, len(paged), 2)), "24 heads never go to aiter"
    ragged = [backend for op, backend in routes if op == "mqa_logits"]
    assert ragged == ["aiter", "triton"]
    assert {name for name, _ in calls} >= {"indexer_k_quant_and_cache", "fp8_mqa_logits"}
    topk = [backend for op, backend in routes if op == "topk_indices"]
    assert {call for call, backend in zip(TOPK_CALLS, topk) if backend == "aiter"} == served.get("topk_indices", set())
    assert ("top_k_per_row_decode" in {name for name, _ in calls}) == bool(served.get("topk_indices"))


def test_empty_calls_do_not_reach_aiter(monkeypatch):
    """An empty batch's op calls (no token, no row, no key) return their empty results without calling aiter, whose
    kernels would launch empty grids; top-k as well (its adapter returned early before)."""
    calls, routes = _simulate(monkeypatch, FAMILIES["0.1.20"])
    gen = torch.Generator().manual_seed(3)
    cache, block_table = random_paged_cache([5], 1, FNUZ, gen)  # flat: a layout 0.1.20 serves for both ops
    before = cache.clone()
    torch.ops.nsa.quant_cache_store(torch.zeros(0, 128).bfloat16(), cache, torch.zeros(0, dtype=torch.long), 1,
                                    False, "ue8m0", FNUZ)
    assert torch.equal(cache, before)
    q = random_fp8((0, 1, 16, 128), FNUZ, gen)
    got = torch.ops.nsa.paged_mqa_logits(q, cache, torch.zeros(0, 16), torch.zeros(0, dtype=torch.int32),
                                         block_table[:0], 80, 1, False)
    assert got.shape == (0, 80)
    for rows, keys in ((0, 9), (6, 0)):
        ks = torch.zeros(rows, dtype=torch.int32)
        got = torch.ops.nsa.mqa_logits(random_fp8((rows, 16, 128), FNUZ, gen), random_fp8((keys, 128), FNUZ, gen),
                                       torch.ones(keys), torch.zeros(rows, 16), ks, ks)
        assert got.shape == (rows, keys)
    assert torch.ops.nsa.topk_indices(torch.zeros(0, 4096), 2048, None).shape == (0, 2048)
    assert {op for op, backend in routes if backend == "aiter"} == {"quant_cache_store", "paged_mqa_logits",
                                                                    "mqa_logits", "topk_indices"}
    assert calls == [], calls


def test_aiter_paged_logits_leave_the_masked_columns(monkeypatch):
    """``write_masked=False`` through aiter: the columns each row sees are the reference's, and the -inf fill after
    aiter's call (a pass over the whole output) is not made: past the chunks aiter visits (256 columns), what the
    output held stays (the stand-in's NaN)."""
    _, routes = _simulate(monkeypatch, FAMILIES["0.1.20"])
    gen = torch.Generator().manual_seed(7)
    lengths = [70, 5]
    cache, block_table = random_paged_cache(lengths, 1, FNUZ, gen)
    q, weights = random_fp8((2, 2, 16, 128), FNUZ, gen), torch.randn(4, 16, generator=gen)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    want = paged_ref(q, cache, weights, ctx, block_table, 300, 1, False)
    got = torch.ops.nsa.paged_mqa_logits(q, cache, weights, ctx, block_table, 300, 1, False, write_masked=False)
    assert routes == [("paged_mqa_logits", "aiter")]
    for row in range(4):
        seen = lengths[row // 2] - 2 + row % 2 + 1
        torch.testing.assert_close(got[row, :seen], want[row, :seen], rtol=1e-4, atol=1e-4)
        assert got[row, 256:].isnan().all()


@pytest.mark.parametrize("family", ["0.1.9", "0.1.14", "0.1.20"])
def test_signature_inspection_agrees_with_the_version_table(monkeypatch, family):
    """The capability read from the installed (stand-in) aiter's signatures routes exactly as its version says."""
    install(monkeypatch, FAMILIES[family])
    by_sig = _capability(FAMILIES[family], inspect_signatures=True)
    by_version = _capability(FAMILIES[family])
    assert by_sig.aiter_params is not None
    for feature in cap_mod.AITER_FEATURES:
        assert by_sig.aiter_has(feature) == by_version.aiter_has(feature), feature
    # a new aiter release whose version string we cannot parse is still read right from its signatures
    assert _capability(FAMILIES[family], inspect_signatures=True, aiter_version="git").aiter_has("paged_logits") \
        == by_version.aiter_has("paged_logits")


@pytest.mark.parametrize("machine, served", [
    (Machine((0, 1, 20), "gfx950", (3, 6)), True),
    (Machine((0, 1, 20), "gfx90a", (3, 6)), False),   # no gluon kernels on MI250
    (Machine((0, 1, 20), "gfx942", (3, 4)), False),   # Triton 3.4: neither JIT gluon (>= 3.5) nor AOT (< 3.4)
    (Machine((0, 1, 20), "gfx942", (3, 4), aot=True), False),
    (Machine((0, 1, 20), "gfx942", (3, 3), aot=True), True),   # AOT bundle on Triton < 3.4
    (Machine((0, 1, 20), "gfx942", (3, 3)), False),
])
def test_preshuffle_paged_logits_need_gluon(monkeypatch, machine, served):
    """aiter's preshuffle kernel is gluon only; elsewhere the Triton kernel serves the preshuffle layout."""
    fp8 = FNUZ if machine.gfx_arch == "gfx942" else FN
    _, routes = _simulate(monkeypatch, machine)
    gen = torch.Generator().manual_seed(1)
    cache, block_table = random_paged_cache([70, 5], 64, fp8, gen)
    q, weights, ctx = random_fp8((2, 1, 16, 128), fp8, gen), torch.randn(2, 16), torch.tensor([70, 5], dtype=torch.int32)
    got = torch.ops.nsa.paged_mqa_logits(q, cache, weights, ctx, block_table, 80, 64, True)
    torch.testing.assert_close(got, paged_ref(q, cache, weights, ctx, block_table, 80, 64, True), rtol=1e-4, atol=1e-4)
    assert routes == [("paged_mqa_logits", "aiter" if served else "triton")]


def test_gfx1250_preshuffle_pages_above_256_go_to_triton(monkeypatch):
    machine = Machine((0, 1, 20), "gfx1250", (3, 6))
    _, routes = _simulate(monkeypatch, machine)
    gen = torch.Generator().manual_seed(2)
    for page_size, want in ((256, "aiter"), (512, "triton")):
        cache, block_table = random_paged_cache([300], page_size, FN, gen)
        q, weights, ctx = random_fp8((1, 1, 16, 128), FN, gen), torch.randn(1, 16), torch.tensor([300], dtype=torch.int32)
        got = torch.ops.nsa.paged_mqa_logits(q, cache, weights, ctx, block_table, 300, page_size, True)
        torch.testing.assert_close(got, paged_ref(q, cache, weights, ctx, block_table, 300, page_size, True),
                                   rtol=1e-4, atol=1e-4)
        assert routes[-1] == ("paged_mqa_logits", want)


def test_the_stand_in_makes_aiters_checks(monkeypatch):
    """The defects the dispatch avoids are real in the stand-in: calling aiter directly fails as aiter would."""
    install(monkeypatch, FAMILIES["0.1.20"])
    gen = torch.Generator().manual_seed(3)
    cache, block_table = random_paged_cache([70, 20], 64, FNUZ, gen)
    with pytest.raises(AiterFault, match="uninitialised batch index"):
        gather_k_aiter.gather_k(cache, block_table, torch.tensor([0, 70, 90], dtype=torch.int32), 64, False, 96, FNUZ)
    k, s = gather_k_aiter.gather_k(cache, block_table, torch.tensor([0, 70, 90], dtype=torch.int32), 64, True, 90, FNUZ)
    want_k, want_s = gather_ref(cache, block_table, torch.tensor([0, 70, 90], dtype=torch.int32), 64, True, 90, FNUZ)
    assert torch.equal(k.view(torch.uint8), want_k.view(torch.uint8)) and torch.equal(s, want_s)
    q, weights, ctx = random_fp8((2, 1, 16, 128), FNUZ, gen), torch.randn(2, 16), torch.tensor([70, 20], dtype=torch.int32)
    with pytest.raises(AiterFault, match="past the table"):  # row-major pages read one slot per token
        paged_mqa_logits_aiter.paged_mqa_logits(q, cache, weights, ctx, block_table, 80, 64, False)
    with pytest.raises(AiterFault, match="ChunkK"):
        cache48, bt48 = random_paged_cache([70, 20], 48, FNUZ, gen)
        paged_mqa_logits_aiter.paged_mqa_logits(q, cache48, weights, ctx, bt48, 80, 48, True)
    with pytest.raises(AiterFault, match="power of 2"):
        mqa_logits_aiter.mqa_logits(random_fp8((2, 24, 128), FNUZ, gen), random_fp8((3, 128), FNUZ, gen),
                                    torch.rand(3), torch.randn(2, 24), torch.zeros(2, dtype=torch.int32),
                                    torch.ones(2, dtype=torch.int32))


def test_quant_cache_store_wiring_applies_the_input_epilogue_first(monkeypatch):
    """aiter quantizes what it is given: the scaled, bf16-rounded K, not the fp32 GEMM output."""
    calls, _ = _simulate(monkeypatch, FAMILIES["0.1.20"])
    y = torch.randn(5, 128) * 30
    cache = torch.zeros(3, 64 * 132, dtype=torch.uint8)
    torch.ops.nsa.quant_cache_store(y, cache, torch.arange(5), 64, True, "ue8m0", FNUZ, 128**-0.5, torch.bfloat16)
    [(name, call)] = calls
    assert name == "indexer_k_quant_and_cache" and torch.equal(call["k"], (y * 128**-0.5).bfloat16())
    assert call["kv_cache"].data_ptr() == cache.data_ptr()


@pytest.mark.parametrize(
    "platform, aiter, op, fp8, want",
    [
        ("rocm", True, "paged_mqa_logits", FNUZ, "aiter"),
        ("rocm", True, "paged_mqa_logits", FN, "triton"),  # aiter's fp8 type is the platform's
        ("rocm", False, "mqa_logits", FNUZ, "triton"),
        ("cuda", False, "quant_cache_store", FN, "triton"),
        ("cuda", False, "quant_cache_store", FNUZ, "torch"),  # no fnuz in Triton on NVIDIA
        ("cuda", False, "gather_k", FNUZ, "triton"),  # a byte copy
        ("rocm", True, "gather_k", FNUZ, "triton"),  # aiter's gather needs rows == cu_seqlens[-1]
    ],
)
def test_backend_choice(monkeypatch, platform, aiter, op, fp8, want):
    cap = _capability(FAMILIES["0.1.20"], platform=platform, aiter_available=aiter,
                      fp8_dtype=FNUZ if platform == "rocm" else FN, gfx_arch="gfx942" if platform == "rocm" else "")
    monkeypatch.setattr(_common, "capability", lambda: cap)
    assert _common.choose_backend(op, torch.device("cuda"), fp8) == want
    assert _common.choose_backend(op, torch.device("cpu"), fp8) == "torch"


def _topk_inputs(rows, cols, seed):
    """Logits with -inf tails and -inf before each row's offset (as the ragged logits write them); lengths past N."""
    gen = torch.Generator().manual_seed(seed)
    logits = adversarial_topk_logits(rows, cols, "tail", seed)
    offset = torch.randint(0, 4, (rows,), generator=gen)
    logits.masked_fill_(torch.arange(cols)[None, :] < offset[:, None], float("-inf"))
    lengths = torch.randint(0, cols + 20, (rows,), generator=gen)
    return logits, lengths, offset


@pytest.mark.parametrize("family", ["0.1.17", "0.1.20"])
def test_topk_wiring_adapts_aiter_to_the_op_contract(monkeypatch, family):
    """aiter returns absolute columns, -1 only past a row's length, and reads row r at ``r * stride0`` ignoring
    ``stride1``: the module subtracts the offset, maps -inf entries to -1 (or pads with columns), clamps lengths to N
    (int64 ones too) and passes row-contiguous logits with NaN canonicalised."""
    calls = install(monkeypatch, FAMILIES[family])
    logits, lengths, offset = _topk_inputs(6, 48, 5)
    transposed = logits.t().contiguous().t()  # same values, stride (1, 6): aiter would read the wrong elements
    padded = torch.full((6, 64), 7.0)[:, :48]  # rows 64 apart; columns past 48 are 7.0, above every logit
    padded.copy_(logits)
    nan_rows = logits.clone()
    nan_rows[:, 10::9] = float("nan")  # NaN of either sign ranks highest, as in torch.topk
    nan_rows[:, 14::9] = -float("nan")
    for values in (logits, transposed, padded, nan_rows):
        for pad in ("neg1", "column"):
            for k in (1, 20, 48):
                got = topk_aiter.topk_indices(values, k, lengths, offset, pad)
                assert_topk_valid(values, got, k, lengths, offset, pad)
                assert calls[-1][1]["stride0"] == 48  # the row-contiguous copy
                assert calls[-1][1]["seqLens"].dtype == torch.int32
    got = topk_aiter.topk_indices(logits, 20, None, None, "neg1")  # no lengths: whole rows
    assert_topk_valid(logits, got, 20)


@pytest.mark.parametrize("family", ["0.1.17", "0.1.20"])
def test_topk_wiring_size_one(monkeypatch, family):
    """One row, one column (Dynamo specialises them): k = 1 with length 1, 0 and past the row."""
    install(monkeypatch, FAMILIES[family])
    for value in (2.5, float("-inf")):
        logits = torch.full((1, 1), value)
        for length in (1, 0, 3):
            lengths = torch.tensor([length], dtype=torch.int32)
            for pad in ("neg1", "column"):
                got = topk_aiter.topk_indices(logits, 1, lengths, torch.zeros(1, dtype=torch.int32), pad)
                assert_topk_valid(logits, got, 1, lengths, None, pad)
    assert topk_aiter.topk_indices(torch.zeros(0, 5), 3, None, None).shape == (0, 3)


def test_the_stand_in_makes_aiters_topk_checks(monkeypatch):
    """What a naive wiring would meet: before 0.1.14 k is fixed at 2048 (no keyword; 2048 entries written per row),
    int64 lengths are refused before 0.1.20 and read as int32 words from it, a length past N reads past the tensor."""
    install(monkeypatch, FAMILIES["0.1.12"])
    topk = __import__("aiter.ops.topk", fromlist=["top_k_per_row_decode"])
    logits, out = torch.randn(2, 4000), torch.empty(2, 12, dtype=torch.int32)
    with pytest.raises(TypeError, match="unexpected keyword argument 'k'"):
        topk.top_k_per_row_decode(logits, 1, torch.tensor([4000, 4000], dtype=torch.int32), out, 2, 4000, 1, k=12)
    with pytest.raises(AiterFault, match="writes past indices"):
        topk.top_k_per_row_decode(logits, 1, torch.tensor([4000, 4000], dtype=torch.int32), out, 2, 4000, 1)
    with pytest.raises(AiterFault, match="expected scalar type Int"):
        topk.top_k_per_row_decode(logits, 1, torch.tensor([4000, 4000]), out, 2, 4000, 1)
    install(monkeypatch, FAMILIES["0.1.20"])
    topk = __import__("aiter.ops.topk", fromlist=["top_k_per_row_decode"])
    with pytest.raises(AiterFault, match="read past the logits"):
        topk.top_k_per_row_decode(logits, 1, torch.tensor([4000, 4100], dtype=torch.int32), out, 2, 4000, 1, k=12)
    topk.top_k_per_row_decode(logits, 1, torch.tensor([4000, 20]), out, 2, 4000, 1, k=12)  # int64: words 4000, 0
    assert (out[1] == -1).all()


def test_rotate_activation_numerics_against_eager(monkeypatch):
    """aiter's rotate_activation (as read: fp32 butterflies, times 1/sqrt(128) in fp32, one rounding to bf16) against
    the eager rotation ``(x.float() @ H * 128**-0.5).to(bf16)``: the two fp32 sums differ only in their order, so
    the bf16 results differ by at most one ulp, and rarely (docs/rocm.md)."""
    install(monkeypatch, FAMILIES["0.1.20"])
    quant = __import__("aiter.ops.quant", fromlist=["rotate_activation"])
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(4096, 128, generator=gen) * torch.logspace(-3, 3, 4096)[:, None]).bfloat16()
    out = torch.empty_like(x)
    quant.rotate_activation(out, x)
    eager = (x.float() @ hadamard_matrix(128) * 128**-0.5).to(torch.bfloat16)
    ulps = (out.view(torch.int16).int() - eager.view(torch.int16).int()).abs()
    assert ulps.max() <= 1 and (ulps > 0).float().mean() < 1e-4


def test_a_store_with_a_rotation_prologue_runs_triton_not_aiter(monkeypatch):
    """aiter's indexer_k_quant_and_cache has no rotation prologue: with one, the store goes to the Triton kernel
    (here the reference), never to aiter; describe() says which calls aiter serves."""
    from nsa_inductor.layout import KCacheLayout

    calls, routes = _simulate(monkeypatch, FAMILIES["0.1.20"])
    cap = _common.capability()
    assert cap_mod.aiter_refusal(cap, "quant_cache_store", page_size=64, preshuffle=True, prologue=True)
    routes_text = cap_mod.aiter_routes(cap, KCacheLayout(64, True))
    assert "quant_cache_store=aiter [without a rotation or RoPE prologue]" in routes_text
    cache = torch.zeros(3, 64 * 132, dtype=torch.uint8)
    want = cache.clone()
    k = torch.randn(5, 128).bfloat16()
    args = (torch.arange(5), 64, True, "ue8m0", FNUZ, 128**-0.5, torch.bfloat16, False, hadamard_matrix(128))
    torch.ops.nsa.quant_cache_store(k, cache, *args)
    store_ref(k, want, *args)
    assert calls == [] and routes == [("quant_cache_store", "triton")]
    assert torch.equal(cache, want)
