"""The Triton kernels under the Triton interpreter (CPU, tiny shapes) against the torch reference.

TRITON_INTERPRET must be set before triton is first imported, so the kernel tests run in a child pytest process
started by ``test_kernels_in_interpreter_subprocess``; in the parent process they are skipped.
The quantizer rounds onto the fp8 grid itself, so even under the interpreter the cache bytes must match exactly.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

from hypothesis import given

from hypothesis import strategies as st

from nsa_inductor.indexer import hadamard_matrix
from nsa_inductor.layout import KCacheLayout
from helpers.ops64 import FN, FNUZ, HYP, TOPK_CASES, WEIGHT_MODES, adversarial_k, adversarial_topk_logits, \
    assert_fp8_close, assert_rows_close, assert_topk_valid, eager_topk_rows, head_gate_weight64, integer_rows, \
    paged_logits64, random_cache, random_fp8, random_paged_cache, ragged_logits64, tie_weights, topk_case
from helpers.guards import Guarded, bad_ids
from helpers.reference64 import assert_logits_close, batched_logits64

CHILD_FLAG = "NSA_TRITON_INTERPRET_CHILD"
IN_CHILD = os.environ.get(CHILD_FLAG) == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
# The CPU environment's Triton (3.9) interprets these kernels; 3.6's interpreter (the GPU machine's, where they run
# compiled) has no fnuz fp8 type, and with numpy 2.4 fails to index by a one-element block (checked 2026-12-07).
OLD_INTERPRETER = HAS_TRITON and tuple(int(p) for p in importlib.metadata.version("triton").split(".")[:2]) < (3, 9)

child_only = pytest.mark.skipif(not IN_CHILD, reason="runs in the TRITON_INTERPRET=1 child process")


@pytest.mark.skipif(IN_CHILD or not HAS_TRITON or OLD_INTERPRETER,
                    reason="child" if IN_CHILD else "triton not installed" if not HAS_TRITON else
                    "Triton before 3.9: its interpreter cannot run these kernels (no fnuz fp8 type)")
@pytest.mark.parametrize("selection", ["topk and split_path_bounds", "topk and not split_path_bounds", "not topk"])
def test_kernels_in_interpreter_subprocess(selection):
    """The file in three children, each under its own time limit: on a two-core machine the whole file took ~400 s
    of a 600 s limit, ~230 s of it the split path's bounds-launch cases and ~110 s the other top-k cases."""
    env = dict(os.environ, TRITON_INTERPRET="1", **{CHILD_FLAG: "1"})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", selection]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]


def _kernels(op: str):
    """The Triton module of ``op`` (imported here: TRITON_INTERPRET must be set before triton is)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    return importlib.import_module(f"nsa_inductor.lowering.{op}.triton")


LAYOUTS = [(1, False), (16, False), (16, True), (32, True)]


@child_only
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
@pytest.mark.parametrize("dtype", [FN, FNUZ])
def test_quant_cache_store_bytes_match_reference(layout, scale_fmt, dtype):
    from nsa_inductor.lowering.quant_cache_store import reference

    tk = _kernels("quant_cache_store")
    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(7)
    random_rows = (torch.randn(9, 128, generator=gen) * 5).bfloat16()
    k = torch.cat([random_rows, adversarial_k(float(torch.finfo(dtype).max))])
    num_slots = 48
    slots = torch.randperm(num_slots, generator=gen)[: k.shape[0]]
    slots[[2, 11]] = -1
    cache = torch.randint(0, 256, (-(-num_slots // page_size), page_size * 132), dtype=torch.uint8, generator=gen)
    want = cache.clone()
    reference.quant_cache_store(k, want, slots, page_size, preshuffle, scale_fmt, dtype)
    tk.quant_cache_store(k, cache, slots, page_size, preshuffle, scale_fmt, dtype)
    assert torch.equal(cache, want)


@child_only
@HYP
@given(slots=st.lists(st.one_of(bad_ids(32), st.integers(0, 3)), min_size=1, max_size=8),
       layout=st.sampled_from(LAYOUTS), int64=st.booleans(), seed=st.integers(0, 99), tagged=st.booleans())
def test_quant_cache_store_writes_only_inside_the_cache(slots, layout, int64, seed, tagged):
    """Slots outside [0, 32) (one past the end, 10**9, int32 extremes) write nothing, duplicates leave the last
    token's values and scale: cache bytes as the reference writes them, the bytes around the cache unchanged; the
    last tokens found by the scan and by tags (which write nothing outside the slots written either)."""
    from nsa_inductor.lowering.quant_cache_store import reference

    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn(len(slots), 128, generator=gen) * 3).bfloat16()
    slot_mapping = torch.tensor(slots, dtype=torch.int64 if int64 else torch.int32)
    cache = Guarded((32 // page_size, page_size * 132), torch.uint8, gen)
    want = cache.view.clone()
    reference.quant_cache_store(k, want, slot_mapping, page_size, preshuffle, "ue8m0", FN)
    _kernels("quant_cache_store").quant_cache_store(k, cache.view, slot_mapping, page_size, preshuffle, "ue8m0", FN,
                                                    tagged=tagged)
    cache.assert_guards_intact()
    assert torch.equal(cache.view, want)


@child_only
@pytest.mark.parametrize("tagged", [False, True])
def test_quant_cache_store_duplicates_across_programs_and_scan_blocks(tagged):
    """300 tokens on 40 slots: a token's later duplicates sit in its own program, in others and past the
    kernel's first 128-slot scan block; each slot holds the last token's values and scale, as the reference writes
    it, found by the scan or by tags (over garbage scale words, negative ones among them). (The interpreter runs
    programs in order, so it shows a wrong token chosen, not a missing skip: the GPU twin in test_kernels_gpu.py
    shows that.)"""
    from nsa_inductor.lowering.quant_cache_store import reference

    gen = torch.Generator().manual_seed(3)
    k = (torch.randn(300, 128, generator=gen) * 3).bfloat16()
    slots = torch.randint(-2, 40, (300,), generator=gen)
    slots[:4] = 45  # written only by the first program: its last token
    slots[-1] = slots[4]
    cache = torch.randint(0, 256, (3, 16 * 132), dtype=torch.uint8, generator=gen)
    want = cache.clone()
    reference.quant_cache_store(k, want, slots, 16, False, "ue8m0", FN)
    _kernels("quant_cache_store").quant_cache_store(k, cache, slots, 16, False, "ue8m0", FN, tagged=tagged)
    assert torch.equal(cache, want)


@child_only
@pytest.mark.parametrize("block_t, tagged", [(4, False), (64, False), (64, True)])
def test_quant_cache_store_duplicates_past_skipped_scan_blocks(block_t, tagged):
    """A prefill's slot mapping (increasing, padding -1 among it) over 2300 tokens, more than two of the kernel's
    1024-slot scan blocks: most blocks hold no slot between a program's lowest and highest and are skipped, and the
    few later duplicates (in the next block, two blocks on, in the same program) still win their slots. (Programs
    run in order here, so this shows a token wrongly marked overwritten; a missed duplicate shows in the GPU twin,
    test_kernels_gpu.py, where the earliest programs, which scan the most, tend to finish last.)"""
    from nsa_inductor.lowering.quant_cache_store import reference

    gen = torch.Generator().manual_seed(5)
    tokens = 2300
    k = (torch.randn(tokens, 128, generator=gen) * 3).bfloat16()
    slots = torch.arange(tokens) + 7
    slots[::97] = -1
    slots[2250], slots[1500], slots[1030], slots[3] = slots[5], slots[1100], slots[2], slots[2]
    slots[2299] = 10**6  # past the cache: written nowhere, and no reason to scan
    cache = torch.randint(0, 256, (tokens // 16 + 1, 16 * 132), dtype=torch.uint8, generator=gen)
    want = cache.clone()
    reference.quant_cache_store(k, want, slots, 16, False, "ue8m0", FN)
    _kernels("quant_cache_store").quant_cache_store(k, cache, slots, 16, False, "ue8m0", FN, block_t=block_t,
                                                    tagged=tagged)
    assert torch.equal(cache, want)


@child_only
@pytest.mark.parametrize("dtype", [FN, FNUZ])
def test_quant_cache_store_keeps_nan_and_inf_as_the_reference(dtype):
    """Rows with a NaN, with +-inf, and both: values and scale decode as the reference's (NaN where it has NaN)."""
    from nsa_inductor.layout import KCacheLayout
    from nsa_inductor.lowering.quant_cache_store import reference

    k = torch.randn(4, 128, generator=torch.Generator().manual_seed(5))
    k[0, 3], k[1, 7], k[2, 9], k[3, 1], k[3, 2] = float("nan"), float("inf"), float("-inf"), float("nan"), float("inf")
    slots = torch.arange(4)
    cache, want = torch.zeros(1, 16 * 132, dtype=torch.uint8), torch.zeros(1, 16 * 132, dtype=torch.uint8)
    reference.quant_cache_store(k, want, slots, 16, False, "ue8m0", dtype)
    _kernels("quant_cache_store").quant_cache_store(k, cache, slots, 16, False, "ue8m0", dtype)
    layout = KCacheLayout(16)
    (got_v, got_s), (want_v, want_s) = layout.load(cache, slots, dtype), layout.load(want, slots, dtype)
    assert want_v[0].float().isnan().all() and want_s[0].isnan()
    torch.testing.assert_close(got_s, want_s, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(got_v.float(), want_v.float(), equal_nan=True, rtol=0, atol=0)


@child_only
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16, None])
@pytest.mark.parametrize("input_scale", [128**-0.5, 1.0])
def test_quant_cache_store_input_epilogue_matches_reference(input_dtype, input_scale):
    """Random rows plus rows whose low 16 bits are a bf16 tie (0x8000) or just off it."""
    from nsa_inductor.lowering.quant_cache_store import reference

    gen = torch.Generator().manual_seed(9)
    random_rows = torch.randn(8, 128, generator=gen) * torch.logspace(-3, 3, 8)[:, None]
    high = torch.randint(0x3900, 0x4700, (3, 128), generator=gen, dtype=torch.int32) << 16  # fp16 normal range
    signs = torch.randint(0, 2, (3, 128), generator=gen, dtype=torch.int32) << 31
    ties = (high | signs | torch.tensor([0x8000, 0x7FFF, 0x8001], dtype=torch.int32)[:, None]).view(torch.float32)
    y = torch.cat([random_rows, ties])
    slots = torch.randperm(32, generator=gen)[:11]
    slots[4] = -1
    cache = torch.randint(0, 256, (2, 16 * 132), dtype=torch.uint8, generator=gen)
    want = cache.clone()
    reference.quant_cache_store(y, want, slots, 16, False, "ue8m0", FN, input_scale, input_dtype)
    _kernels("quant_cache_store").quant_cache_store(y, cache, slots, 16, False, "ue8m0", FN, input_scale, input_dtype)
    assert torch.equal(cache, want)


@child_only
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_k_matches_reference(layout):
    from nsa_inductor.lowering.gather_k import reference

    tk = _kernels("gather_k")
    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(1)
    lengths = [7, 0, 21, 3]
    cache, block_table = random_paged_cache(lengths, page_size, FN, gen)
    cu = torch.tensor([0, 7, 7, 28, 31], dtype=torch.int32)
    num_tokens = 36
    poisoned = (torch.full((num_tokens, 128), 0x7F, dtype=torch.uint8).view(FN),
                torch.full((num_tokens,), float("nan")))
    k, scale = tk.gather_k(cache, block_table, cu, page_size, preshuffle, num_tokens, FN, out=poisoned)
    want_k, want_scale = reference.gather_k(cache, block_table, cu, page_size, preshuffle, num_tokens, FN)
    assert torch.equal(k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(scale, want_scale)


@child_only
@HYP
@given(pages=st.lists(bad_ids(4), min_size=6, max_size=6), lengths=st.lists(st.integers(0, 40), min_size=2,
       max_size=2), first=st.integers(0, 5), decreasing=st.booleans(), layout=st.sampled_from(LAYOUTS),
       seed=st.integers(0, 99))
def test_gather_k_reads_only_inside_the_cache(pages, lengths, first, decreasing, layout, seed):
    """Block-table entries outside [-4, 4), cu_seqlens not starting at 0: zero rows, as the reference gives, and
    nothing read or written outside the cache and the outputs (guard bytes would show up as values). Decreasing
    cu_seqlens: only the memory guarantee."""
    from nsa_inductor.lowering.gather_k import reference

    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(seed)
    cache = Guarded((4, page_size * 132), torch.uint8, gen)
    block_table = torch.tensor(pages, dtype=torch.int32).view(2, 3)
    cu = torch.tensor([first, first + lengths[0], first + lengths[0] + lengths[1]], dtype=torch.int32)
    if decreasing:
        cu = cu.flip(0)
    num_tokens = int(cu.max()) + 2
    out_k, out_scale = Guarded((num_tokens, 128), torch.uint8, gen), Guarded((num_tokens,), torch.float32, gen)
    k, scale = _kernels("gather_k").gather_k(cache.view, block_table, cu, page_size, preshuffle, num_tokens, FN,
                                             out=(out_k.view.view(FN), out_scale.view))
    for guarded in (cache, out_k, out_scale):
        guarded.assert_guards_intact()
    if not decreasing:
        want_k, want_scale = reference.gather_k(cache.view, block_table, cu, page_size, preshuffle, num_tokens, FN)
        assert torch.equal(k.view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32))


def _slot_gather_ids(by_sequence: bool, n: int, num_pages: int, page_size: int, gen: torch.Generator):
    """``(positions, extra args)`` of ``nsa.gather_k_slots``: ids in range, wrapping and out of range."""
    if not by_sequence:
        num_slots = num_pages * page_size
        return torch.randint(-num_slots - 3, num_slots + 3, (n,), generator=gen), ()
    table = torch.randint(-num_pages - 1, num_pages + 1, (3, 2), generator=gen, dtype=torch.int32)
    seq_ids = torch.randint(-4, 4, (n,), generator=gen, dtype=torch.int32)
    positions = torch.randint(-2 * page_size - 3, 2 * page_size + 3, (n,), generator=gen, dtype=torch.int32)
    return positions, (table, seq_ids)


@child_only
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("by_sequence", [False, True])
@pytest.mark.parametrize("n", [0, 1, 37])
def test_gather_k_slots_matches_reference(layout, by_sequence, n):
    """Every output element written (poisoned outputs), the reference's bytes for every kind of id."""
    from nsa_inductor.lowering.gather_k_slots import reference

    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(n)
    cache = random_cache(4, page_size, FN, gen)
    positions, extra = _slot_gather_ids(by_sequence, n, 4, page_size, gen)
    poisoned = (torch.full((n, 128), 0x7F, dtype=torch.uint8).view(FN), torch.full((n,), float("nan")))
    k, scale = _kernels("gather_k_slots").gather_k_slots(cache, positions, page_size, preshuffle, FN, *extra,
                                                          out=poisoned)
    want_k, want_scale = reference.gather_k_slots(cache, positions, page_size, preshuffle, FN, *extra)
    assert torch.equal(k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(scale, want_scale)


@child_only
@HYP
@given(ids=st.lists(bad_ids(64), min_size=1, max_size=9), seq=st.lists(bad_ids(3), min_size=9, max_size=9),
       pages=st.lists(bad_ids(4), min_size=6, max_size=6), by_sequence=st.booleans(), layout=st.sampled_from(LAYOUTS),
       seed=st.integers(0, 99))
def test_gather_k_slots_reads_only_inside_the_cache(ids, seq, pages, by_sequence, layout, seed):
    """Slots, sequence ids, positions and page ids at and past every edge (int32 extremes included): the
    reference's rows (zero where eager would raise), nothing read or written outside the cache and the outputs."""
    from nsa_inductor.lowering.gather_k_slots import reference

    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(seed)
    cache = Guarded((4, page_size * 132), torch.uint8, gen)
    positions = torch.tensor(ids, dtype=torch.int32)
    extra = (torch.tensor(pages, dtype=torch.int32).view(3, 2), torch.tensor(seq[: len(ids)], dtype=torch.int32)) \
        if by_sequence else ()
    n = len(ids)
    out_k, out_scale = Guarded((n, 128), torch.uint8, gen), Guarded((n,), torch.float32, gen)
    k, scale = _kernels("gather_k_slots").gather_k_slots(cache.view, positions, page_size, preshuffle, FN, *extra,
                                                          out=(out_k.view.view(FN), out_scale.view))
    for guarded in (cache, out_k, out_scale):
        guarded.assert_guards_intact()
    want_k, want_scale = reference.gather_k_slots(cache.view, positions, page_size, preshuffle, FN, *extra)
    assert torch.equal(k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32))


# (chunk, block_n) of the paged logits' tests: chunks of 2 and of 8 blocks, blocks of 16 and of 32 keys (over the
# pages of LAYOUTS, of 1, 16 and 32 keys: a block within one page or over several)
PAGED_TILES = [(32, 16), (128, 16), (256, 32)]


@child_only
@HYP
@given(pages=st.lists(bad_ids(3), min_size=4, max_size=4), ctx=st.lists(st.integers(0, 70), min_size=2, max_size=2),
       layout=st.sampled_from(LAYOUTS), with_factor=st.booleans(), seed=st.integers(0, 99),
       tiles=st.sampled_from(PAGED_TILES))
def test_paged_mqa_logits_reads_only_inside_the_cache(pages, ctx, layout, with_factor, seed, tiles):
    """Block-table entries outside [-3, 3) are -inf keys (negative ids in range wrap), contexts past the table:
    logits as the reference gives them, nothing read or written outside the cache and the output; the weights
    given as two factors and a number, or as one tensor; tiles of ``PAGED_TILES``."""
    from nsa_inductor.lowering.paged_mqa_logits import reference

    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(seed)
    cache = Guarded((3, page_size * 132), torch.uint8, gen, fill=random_cache(3, page_size, FN, gen))
    block_table = torch.tensor(pages, dtype=torch.int32).view(2, 2)
    q = random_fp8((2, 1, 16, 128), FN, gen)
    weights = torch.randn(2, 16, generator=gen)
    max_len = 2 * page_size + 5
    args = (q, cache.view, weights, torch.tensor(ctx, dtype=torch.int32), block_table, max_len, page_size, preshuffle)
    if with_factor:  # the weights as the model computes them: split-K partials, q's scale, a number
        args = (*args[:2], torch.randn(3, 2, 16, generator=gen), *args[3:], torch.rand(2, 16, generator=gen), 0.0884)
    out = Guarded((2, max_len), torch.float32, gen)
    got = _kernels("paged_mqa_logits").paged_mqa_logits(*args, out=out.view, config=_kernels(
        "paged_mqa_logits").PagedConfig(*tiles))
    cache.assert_guards_intact()
    out.assert_guards_intact()
    assert_logits_close(got, reference.paged_mqa_logits(*args), rtol=1e-5)


@child_only
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("next_n, heads", [(1, 32), (2, 16), (2, 24)])
@pytest.mark.parametrize("tiles", PAGED_TILES)
def test_paged_mqa_logits_matches_float64(layout, next_n, heads, tiles):
    tk = _kernels("paged_mqa_logits")
    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(2)
    ctx = [0, 1, 37, 50]
    max_len = 120  # far past the longest context: whole -inf chunks
    cache, block_table = random_paged_cache(ctx, page_size, FN, gen)
    q = random_fp8((len(ctx), next_n, heads, 128), FN, gen)
    weights = torch.randn(len(ctx) * next_n, heads, generator=gen)
    args = (q, cache, weights, torch.tensor(ctx, dtype=torch.int32), block_table, max_len, page_size, preshuffle)
    out = torch.full((len(ctx) * next_n, max_len), float("nan"))
    got = tk.paged_mqa_logits(*args, out=out, config=tk.PagedConfig(*tiles))
    assert_logits_close(got, paged_logits64(*args), rtol=1e-5)


@child_only
@pytest.mark.parametrize("next_n", [1, 2])
def test_paged_mqa_logits_leaves_the_masked_columns_unwritten(next_n):
    """``write_masked=False``: the columns each row may see are the reference's, and nothing is written from the
    first block of BLOCK_N columns past a sequence's context (the NaN the buffer held stays), whole chunks past it
    included."""
    tk = _kernels("paged_mqa_logits")
    gen = torch.Generator().manual_seed(5)
    ctx = [0, 1, 37, 50, 96]
    max_len, block_n = 120, 16
    cache, block_table = random_paged_cache(ctx, 16, FN, gen)
    q = random_fp8((len(ctx), next_n, 16, 128), FN, gen)
    weights = torch.randn(len(ctx) * next_n, 16, generator=gen)
    args = (q, cache, weights, torch.tensor(ctx, dtype=torch.int32), block_table, max_len, 16, False)
    out = torch.full((len(ctx) * next_n, max_len), float("nan"))
    got = tk.paged_mqa_logits(*args, write_masked=False, out=out,
                              config=tk.PagedConfig(chunk=32, block_n=block_n))
    want = paged_logits64(*args)
    for row in range(len(ctx) * next_n):
        c = ctx[row // next_n]
        visible = c - next_n + row % next_n + 1
        assert_logits_close(got[row:row + 1, :max(visible, 0)], want[row:row + 1, :max(visible, 0)], rtol=1e-5)
        assert got[row, -(-c // block_n) * block_n:].isnan().all()


@child_only
@pytest.mark.parametrize("block_m, block_n", [(16, 16), (32, 16)])
def test_mqa_logits_matches_float64(block_m, block_n):
    tk = _kernels("mqa_logits")
    gen = torch.Generator().manual_seed(3)
    tokens, keys, heads = 40, 45, 16
    q = random_fp8((tokens, heads, 128), FN, gen)
    k = random_fp8((keys, 128), FN, gen)
    k_scale = torch.rand(keys, generator=gen) + 0.05
    weights = torch.randn(tokens, heads, generator=gen)
    ks = torch.tensor([0] * 25 + [25] * 15, dtype=torch.int32)  # causal prefill of two sequences
    ke = torch.arange(1, tokens + 1, dtype=torch.int32)
    ke[-3:] = ks[-3:]  # empty windows
    out = torch.full((tokens, keys), float("nan"))
    got = tk.mqa_logits(q, k, k_scale, weights, ks, ke, out=out, config=tk.RaggedConfig(block_m, block_n))
    assert_logits_close(got, ragged_logits64(q, k, k_scale, weights, ks, ke), rtol=1e-5)


@child_only
@pytest.mark.parametrize("rows_in_m, keys_in_m", [(False, True), (False, False), (True, False)])
@pytest.mark.parametrize("batch, tokens, heads, keys, dim, dtype", [
    (2, 1, 4, 37, 64, torch.bfloat16), (1, 3, 3, 5, 32, torch.float16), (3, 2, 16, 20, 16, torch.bfloat16),
    (1, 17, 2, 1, 16, torch.float16), (2, 20, 3, 7, 48, torch.bfloat16)])
def test_batched_mqa_logits_matches_float64(rows_in_m, keys_in_m, batch, tokens, heads, keys, dim, dtype):
    """Both tilings at tile edges (rows, keys, heads, head dims not powers of two; chunks of 32 keys over 37), with and
    without masks (a causal one: tiles dropped whole)."""
    tk = _kernels("batched_mqa_logits")
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(batch, tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(batch, keys, dim, generator=gen).to(dtype)
    weights = torch.randn(batch, tokens, heads, generator=gen)
    config = tk.BatchedConfig(rows_in_m, keys_in_m, block_m=16, block_n=16, chunk=32)
    got = tk.batched_mqa_logits(q, k, weights, 0.3, config=config)
    assert_logits_close(got, batched_logits64(q, k, weights, 0.3), rtol=1e-6)
    got = tk.batched_mqa_logits(q, k, weights, 1.0, torch.tensor(0.3), config=config)  # a 0-d tensor scale
    assert_logits_close(got, batched_logits64(q, k, weights, 0.3), rtol=1e-6)
    causal = torch.arange(keys)[None, None] <= torch.arange(tokens)[None, :, None] + keys - tokens
    for mask in (causal.expand(batch, tokens, keys), torch.rand(batch, tokens, keys, generator=gen) < 0.2):
        got = tk.batched_mqa_logits(q, k, weights, 0.3, None, mask, config=config)  # (tiles kept whole, in part, not)
        assert_logits_close(got, batched_logits64(q, k, weights, 0.3, mask), rtol=1e-6)
        assert torch.equal(tk.batched_mqa_logits(q, k, weights, 0.3, None, mask, -7.5, config=config),
                           got.masked_fill(~mask, -7.5))  # another fill: the same logits elsewhere


@child_only
def test_mqa_logits_leaves_the_tiles_past_every_rows_end_unwritten():
    """``write_masked=False``: every column before a row's ke is the reference's (-inf below ks included), and a tile
    of columns at or past every one of its rows' ke is not written (the NaN the buffer held stays)."""
    tk = _kernels("mqa_logits")
    gen = torch.Generator().manual_seed(6)
    tokens, keys, heads, block_m, block_n = 40, 70, 16, 16, 16
    q, k = random_fp8((tokens, heads, 128), FN, gen), random_fp8((keys, 128), FN, gen)
    k_scale, weights = torch.rand(keys, generator=gen) + 0.05, torch.randn(tokens, heads, generator=gen)
    ks = torch.tensor([0] * 25 + [25] * 15, dtype=torch.int32)  # causal prefill of two sequences
    ke = torch.arange(1, tokens + 1, dtype=torch.int32)
    ke[-3:] = ks[-3:]  # empty windows
    out = torch.full((tokens, keys), float("nan"))
    got = tk.mqa_logits(q, k, k_scale, weights, ks, ke, write_masked=False, out=out,
                        config=tk.RaggedConfig(block_m, block_n))
    want = ragged_logits64(q, k, k_scale, weights, ks, ke)
    for t in range(tokens):
        assert_logits_close(got[t:t + 1, :ke[t]], want[t:t + 1, :ke[t]], rtol=1e-5)
        block_end = int(ke[t // block_m * block_m:(t // block_m + 1) * block_m].max())
        assert got[t, -(-block_end // block_n) * block_n:].isnan().all()


@child_only
def test_fnuz_logits_in_interpreter():
    """fnuz (tl.float8e4b8) is what the kernels use on ROCm gfx942."""
    tk = _kernels("paged_mqa_logits")
    gen = torch.Generator().manual_seed(4)
    cache = random_cache(3, 16, FNUZ, gen)
    block_table = torch.tensor([[2, 0]], dtype=torch.int32)
    q = random_fp8((1, 1, 16, 128), FNUZ, gen)
    weights = torch.randn(1, 16, generator=gen)
    args = (q, cache, weights, torch.tensor([29], dtype=torch.int32), block_table, 40, 16, True)
    got = tk.paged_mqa_logits(*args, config=tk.PagedConfig(chunk=32, block_n=16))
    assert_logits_close(got, paged_logits64(*args), rtol=1e-5)


@child_only
@HYP
@given(**TOPK_CASES)
def test_topk_indices_kernel_is_eager_topk_as_sets(rows, cols, k_frac, inf, with_lengths, with_offset, seed):
    logits, k, lengths, offset = topk_case(rows, cols * 20, k_frac, inf, with_lengths, with_offset, seed)
    got = _kernels("topk_indices").topk_indices(logits, k, lengths, offset)
    assert [sorted(r) for r in got.tolist()] == eager_topk_rows(logits, k, lengths, offset)


@child_only
@HYP
@given(rows=st.integers(1, 3), cols=st.one_of(st.integers(1, 70), st.sampled_from([16, 32, 48, 64])),
       k_frac=st.floats(0, 1), kind=st.sampled_from(["ties", "equal", "close", "nan", "tail", "randn"]),
       pad=st.sampled_from(["neg1", "column"]), sorted_=st.booleans(), with_lengths=st.booleans(),
       block=st.sampled_from([None, 16, 32]),
       sort_chunk=st.sampled_from([None, 4, 16]), interpolation_steps=st.sampled_from([None, 0, 2]),
       seed=st.integers(0, 99))
def test_topk_indices_kernel_meets_the_contract(rows, cols, k_frac, kind, pad, sorted_, with_lengths, block,
                                                sort_chunk, interpolation_steps, seed):
    """The bisection path on ties, all-equal rows, values equal but for their last bits, NaN of either sign, -inf
    tails; rows held in registers (as vectors of 4 columns where the width is a multiple of 16) and rows
    streamed in blocks of 16 or 32 (every block boundary); every output slot written; sorted in the select kernel
    or, for more survivors than a sort chunk, by the chunk sort. The search makes two guided trials, then
    interpolates, then halves: also halving at once (0) or after 2 trials."""
    logits = adversarial_topk_logits(rows, cols, kind, seed)
    k = round(k_frac * cols)
    lengths = torch.randint(0, cols + 2, (rows,), generator=torch.Generator().manual_seed(seed)).int() \
        if with_lengths else None
    offset = -torch.arange(rows)
    out = torch.full((rows, k), 12345, dtype=torch.int32)
    tk = _kernels("topk_indices")
    steps = tk.INTERPOLATION_STEPS if interpolation_steps is None else type(tk.INTERPOLATION_STEPS)(interpolation_steps)
    with mock.patch.object(tk, "INTERPOLATION_STEPS", steps):
        got = tk.topk_indices(logits, k, lengths, offset, pad, sorted_, out=out, block=block, path="bisect",
                              sort_chunk=sort_chunk)
    assert_topk_valid(logits, got, k, lengths, offset, pad, sorted_)


@child_only
@pytest.mark.parametrize("pad", ["neg1", "column"])
def test_topk_rows_held_as_vectors_only_where_whole_vector_loads_are_provable(pad):
    """A row is held as vectors of 4 columns only where Triton can prove its loads whole 16-byte vectors (width and
    row stride multiples of 16, start 16-byte aligned); held either way, a row's selection and its order (the keys
    above the k-th in column order, then its first ties) are the same."""
    tk = _kernels("topk_indices")
    base = (torch.randn(3, 80, generator=torch.Generator().manual_seed(0)) * 2).round()  # ties
    assert tk.vectors_for(base[:, :64])
    assert not tk.vectors_for(base[:, :60])  # width
    assert not tk.vectors_for(torch.zeros(3, 72)[:, :64])  # row stride
    assert not tk.vectors_for(base[:, 1:65])  # start
    logits, lengths = base[:, :64], torch.tensor([64, 30, 0], dtype=torch.int32)
    for k in (1, 17, 40):
        held_as_vectors = tk.topk_indices(logits, k, lengths, None, pad)
        with mock.patch.object(tk, "vectors_for", lambda logits: False):
            assert torch.equal(tk.topk_indices(logits, k, lengths, None, pad), held_as_vectors)
        assert_topk_valid(logits, held_as_vectors, k, lengths, None, pad, False)


@child_only
@pytest.mark.parametrize("path,sizes,sorted_", [("bisect", {}, False), ("bisect", {}, True),
                                                ("radix_split", {"segment": 32}, False),
                                                ("radix_row", {"chunk": 32}, False)])
@pytest.mark.parametrize("kind", ["ties", "tail", "randn"])
def test_topk_scan_runs_thread_by_thread(path, sizes, sorted_, kind):
    """Where a thread holds several of a block's vectors of 4 columns (`_vector_positions`), the writes' prefix sum
    takes groups of a thread's vectors in turn, then the next thread's (`_prefix_sum`): here with 1-2 threads a warp,
    so that 64-column blocks have 4-8 vectors a thread, in groups of 1 or 2; every -inf of a "neg1" row (`tail`) is
    padded after the finite entries; the output's neighbours untouched."""
    import triton.language as tl

    tk = _kernels("topk_indices")
    rows, cols, k = 3, 64, 20
    logits = adversarial_topk_logits(rows, cols, kind, 7)
    lengths = torch.tensor([64, 33, 5], dtype=torch.int32)
    for threads, group, pad in itertools.product((1, 2), (1, 2), ("neg1", "column")):
        guarded = torch.full((rows + 2, k), 12345, dtype=torch.int32)
        with mock.patch.object(tk, "warp_threads", lambda: threads), \
                mock.patch.multiple(tk, SELECT_SCAN_GROUP=tl.constexpr(group), COMPACT_SCAN_GROUP=tl.constexpr(group)):
            got = tk.topk_indices(logits, k, lengths, None, pad, sorted_, out=guarded[1:-1], path=path, **sizes)
        assert_topk_valid(logits, got, k, lengths, None, pad, sorted_)
        assert (guarded[0] == 12345).all() and (guarded[-1] == 12345).all()
        if pad == "neg1" and path == "bisect":
            for entries in got.tolist():
                n = len([e for e in entries if e != -1])
                assert entries[n:] == [-1] * (k - n), entries


@child_only
@HYP
@given(rows=st.integers(1, 3), cols=st.integers(1, 70), k_frac=st.floats(0, 1),
       kind=st.sampled_from(["ties", "equal", "close", "nan", "tail", "randn"]), pad=st.sampled_from(["neg1", "column"]),
       sorted_=st.booleans(), with_lengths=st.booleans(), path=st.sampled_from(["radix_split", "radix_row"]),
       segment=st.sampled_from([16, 32]), block=st.sampled_from([8, 16]), capacity=st.sampled_from([None, 4, 12]),
       sort=st.sampled_from([None, "chunks"]), sort_chunk=st.sampled_from([4, 16]),
       merge_part=st.sampled_from([4, 64]), interpolation_steps=st.sampled_from([None, 0, 2]),
       small_block=st.sampled_from([4, 2048]), programs=st.sampled_from([None, 1, 2, 3]),
       bounds=st.sampled_from([None, True]), window=st.sampled_from([None, True]), seed=st.integers(0, 99))
def test_topk_indices_radix_paths_meet_the_contract(rows, cols, k_frac, kind, pad, sorted_, with_lengths, path,
                                                    segment, block, capacity, sort, sort_chunk, merge_part,
                                                    interpolation_steps, small_block, programs, bounds, window,
                                                    seed):
    """The radix paths (digit histogram, compaction, select among the boundary bin's candidates; over segments of a
    row in two launches, the last program of a row to arrive selecting, or per row in one, in chunks of `segment`
    columns) on the same rows: candidates held in registers (on the split path, in a smaller block where at most 4
    are), streamed, or overflowing their buffer (the row selected again); sorted by ranks (the split path's few
    rows) or by chunks of 4 or 16 entries merged by rank, a chunk's entries placed by one program or by parts of 4;
    the output's neighbours untouched. The candidates' search interpolates its first trials, then halves: also with
    none (0) or 2 before halving."""
    logits = adversarial_topk_logits(rows, cols, kind, seed)
    k = round(k_frac * cols)
    lengths = torch.randint(0, cols + 2, (rows,), generator=torch.Generator().manual_seed(seed)).int() \
        if with_lengths else None
    offset = -torch.arange(rows)
    guarded = torch.full((rows + 2, k), 12345, dtype=torch.int32)
    tk = _kernels("topk_indices")
    constants = {"MERGE_PART": merge_part, "RADIX_SMALL_BLOCK": small_block}
    if interpolation_steps is not None:
        constants["INTERPOLATION_STEPS"] = type(tk.INTERPOLATION_STEPS)(interpolation_steps)
    with mock.patch.multiple(tk, **constants):
        got = tk.topk_indices(logits, k, lengths, offset, pad, sorted_, out=guarded[1:-1], block=block, path=path,
                              segment=segment, chunk=segment, capacity=capacity, sort=sort, sort_chunk=sort_chunk,
                              programs=programs, bounds=bounds, window=window)
    assert_topk_valid(logits, got, k, lengths, offset, pad, sorted_)
    assert (guarded[0] == 12345).all() and (guarded[-1] == 12345).all()


@child_only
def test_topk_search_first_guess_is_the_normal_quantile():
    """The whole-row search's first trial is where a normal puts the k-th value (`_upper_normal_quantile`); a wrong
    coefficient there changes no result, only how many counts a row takes: within 1e-3 of the inverse normal."""
    import triton
    import triton.language as tl

    tk = _kernels("topk_indices")

    @triton.jit
    def upper_quantiles(p_ptr, z_ptr, QUANTILE: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(z_ptr + i, QUANTILE(tl.load(p_ptr + i)))

    p = torch.cat([torch.tensor([1e-6, 1e-3]), torch.linspace(0.01, 0.99, 60), torch.tensor([0.999, 1 - 1e-6])])
    z = torch.empty_like(p)
    upper_quantiles[(1,)](p, z, QUANTILE=tk._upper_normal_quantile, BLOCK=64)
    assert torch.allclose(z.double(), -torch.special.ndtri(p.double()), atol=1e-3, rtol=0)


@child_only
@HYP
@given(used=st.integers(1, 40), bins=st.sampled_from([128, 256]), edge=st.sampled_from([None, 0, 15, 16, 17, -16, -1]),
       before=st.integers(0, 40), seed=st.integers(0, 999))
def test_topk_row_boundary_from_the_segments_counts(used, bins, edge, before, seed):
    """The split path's boundary bin from its segments' counts of columns at or above each bin (``_row_counts``,
    ``_boundary_bin``): the bin, the columns above it and in it, and those of the segments before a compaction
    program's own (``_around_bin``), as numpy finds them in the summed counts. Boundaries at the first and last bins
    and at edges of 16-bin groups, rows of more segments than one block of them, sparse counts (runs of empty bins)."""
    import numpy as np
    import triton
    import triton.language as tl

    tk = _kernels("topk_indices")
    before = min(before, used - 1)

    @triton.jit
    def boundary(hist, used, before, take, out, SEGMENTS_BLOCK: tl.constexpr, BINS: tl.constexpr,
                 ROW_COUNTS: tl.constexpr, BOUNDARY_BIN: tl.constexpr, AROUND_BIN: tl.constexpr):
        total, earlier = ROW_COUNTS(hist, used, before, SEGMENTS_BLOCK, BINS)
        b, above, in_bin = BOUNDARY_BIN(total, take, BINS)
        above_before, in_bin_before = AROUND_BIN(earlier, b, BINS)
        tl.store(out, b)
        tl.store(out + 1, above)
        tl.store(out + 2, in_bin)
        tl.store(out + 3, above_before)
        tl.store(out + 4, in_bin_before)

    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, (used, bins)) * (rng.random((used, bins)) < 0.3)
    at_least = counts[:, ::-1].cumsum(1)[:, ::-1]  # per segment: columns in each bin or above
    row = at_least.sum(0)
    if row[0] == 0:
        counts[0, 0] = at_least[0, 0] = row[0] = 1
    # a take whose boundary is bin `edge` (where that bin holds columns), else any take from 1 to all the row's
    b_edge = None if edge is None else edge % bins
    take = int(row[b_edge]) if b_edge is not None and row[b_edge] > (row[b_edge + 1] if b_edge + 1 < bins else 0) \
        else int(rng.integers(1, row[0] + 1))
    b = int(np.nonzero(row >= take)[0].max())
    above = int(row[b + 1]) if b + 1 < bins else 0
    prefix = at_least[:before].sum(0)
    above_before = int(prefix[b + 1]) if b + 1 < bins else 0
    out = torch.empty(5, dtype=torch.int32)
    boundary[(1,)](torch.from_numpy(np.ascontiguousarray(at_least)).int(), used, before, take, out, SEGMENTS_BLOCK=16,
                   BINS=bins, ROW_COUNTS=tk._row_counts, BOUNDARY_BIN=tk._boundary_bin, AROUND_BIN=tk._around_bin)
    assert out.tolist() == [b, above, int(row[b]) - above, above_before, int(prefix[b]) - above_before]


@child_only
def test_topk_indices_refuses_a_sort_its_path_cannot_make():
    """The rank sort needs the keys only the split radix path writes; the in-register sort is the bisection's."""
    tk = _kernels("topk_indices")
    logits = torch.randn(2, 40)
    with pytest.raises(ValueError, match="'ranks'"):
        tk.topk_indices(logits, 4, None, None, sorted=True, path="bisect", sort="ranks")
    with pytest.raises(ValueError, match="'in_kernel'"):
        tk.topk_indices(logits, 4, None, None, sorted=True, path="radix_row", sort="in_kernel")


@child_only
@pytest.mark.parametrize("k", [0, 1, 6, 7, 8, 20])
def test_topk_indices_kernel_at_length_edges(k):
    """Lengths 0, 1, k-1, k, k+1 and N in one batch, and one past a sort chunk's first slot (9, 17: a chunk holding
    one entry to sort), -inf values inside them (-1 with the neg1 pad, also where a row has at most k columns), both
    pads, both orders, every path, every way each path makes the sorted order."""
    cols = 20
    lengths = torch.tensor([0, 1, max(k - 1, 0), k, min(k + 1, cols), cols, 9, 17], dtype=torch.int32)
    logits = adversarial_topk_logits(8, cols, "randn", k)
    logits[:, [0, 3]] = float("-inf")
    tk = _kernels("topk_indices")
    sizes = dict(block=8, segment=8, chunk=8, sort_chunk=8)
    for path in tk.PATHS:
        for pad in ("neg1", "column"):
            got = tk.topk_indices(logits, k, lengths, None, pad, False, path=path, **sizes)
            assert_topk_valid(logits, got, k, lengths, None, pad, False)
            for sort in [sort for sort, paths in tk.SORTS.items() if path in paths]:
                got = tk.topk_indices(logits, k, lengths, None, pad, True, path=path, sort=sort, **sizes)
                assert_topk_valid(logits, got, k, lengths, None, pad, True)


@child_only
@pytest.mark.parametrize("k", [1, 2, 6])
def test_topk_search_ends_one_key_from_the_bound(k):
    """A search whose bracket holds take + 1 keys at or above its low end or take - 1 above its high end ends in one
    reduction (``_peel_end``), the whole-row search's also two keys from it in two: rows of k + 1 finite values (the
    lowest held once: the keys above it are the k; or twice: it is the k-th), of k + 2 (the lowest once or twice) and
    of several (with k = 1 the highest held once or twice, twice of three so that the keys below it are k; with k = 2
    two keys from the high end), one bin's values (a few ulps apart); every path, in one block and streamed; the
    output's neighbours untouched."""
    cols = 20
    base = torch.tensor(0x3F800000)
    rows = []
    for n_finite, tie in ((k + 1, None), (k + 1, "low"), (k + 2, None), (k + 2, "low"), (5, None), (5, "high"),
                          (3, "high")):
        bits = (base + torch.randperm(n_finite, generator=torch.Generator().manual_seed(n_finite)) * 3).int()
        if tie == "low":
            bits[bits == bits.min()] = bits.sort().values[1]  # the lowest value twice
        elif tie == "high":
            bits[bits == bits.min()] = bits.max()  # the highest value twice
        row = torch.full((cols,), float("-inf"))
        row[torch.randperm(cols, generator=torch.Generator().manual_seed(k))[:n_finite]] = bits.view(torch.float32)
        rows.append(row)
    logits = torch.stack(rows)
    tk = _kernels("topk_indices")
    for path in tk.PATHS:
        for block in (4, 32):
            guarded = torch.full((len(rows) + 2, k), 12345, dtype=torch.int32)
            got = tk.topk_indices(logits, k, None, None, "neg1", False, out=guarded[1:-1], path=path, block=block,
                                  segment=8, chunk=8, capacity=cols)
            assert_topk_valid(logits, got, k)
            assert (guarded[0] == 12345).all() and (guarded[-1] == 12345).all()


@child_only
@pytest.mark.parametrize("programs, segment", [(1, 16), (2, 16), (3, 16), (7, 16), (25, 4), (3, 4)])
def test_topk_split_path_bounds_launch(programs, segment):
    """The split path with its bounds launch (each row's boundary bin and, per segment, the columns above it and in
    it before that segment, read by the compaction programs), with fewer compaction programs a row than segments
    (each taking every programs-th segment; with lengths the histogram loops too) or one a segment: rows of 7
    segments, or of 25 (more than one block of segments' counts: the offsets carried across blocks), lengths ending
    inside a program's first, middle and last segment or none, k at 1, inside the boundary bin and all but one
    column, ties, NaN and random values, the candidates' buffer holding them all or overflowing, both pads, sorted by
    ranks or not; binned by the radix digit or by each row's window; the output's neighbours untouched. Fewer
    programs than segments without the bounds launch is refused, and so is the window without it."""
    cols = 100
    tk = _kernels("topk_indices")
    for kind in ("randn", "ties", "nan"):  # (NaN: boundary in the last bin, none above it)
        logits = adversarial_topk_logits(4, cols, kind, programs)
        for lengths, window in ((None, True), (torch.tensor([cols, 37, 90, 5], dtype=torch.int32), False),
                                (torch.tensor([cols, 37, 90, 5], dtype=torch.int32), True)):
            for k, pad, sorted_, capacity in ((1, "neg1", False, None), (20, "column", True, None),
                                              (20, "neg1", False, 4), (99, "neg1", True, None)):
                guarded = torch.full((6, k), 12345, dtype=torch.int32)
                got = tk.topk_indices(logits, k, lengths, None, pad, sorted_, out=guarded[1:-1], path="radix_split",
                                      segment=segment, block=16, capacity=capacity, programs=programs, bounds=True,
                                      window=window)
                assert_topk_valid(logits, got, k, lengths, None, pad, sorted_)
                assert (guarded[0] == 12345).all() and (guarded[-1] == 12345).all()
    if programs < -(-cols // segment):
        with pytest.raises(ValueError, match="needs bounds"):
            tk.topk_indices(logits, 1, None, None, path="radix_split", segment=segment, block=16, programs=programs,
                            bounds=False)
    with pytest.raises(ValueError, match="needs bounds"):
        tk.topk_indices(logits, 1, None, None, path="radix_split", segment=segment, block=16, bounds=False,
                        window=True)


@child_only
def test_topk_window_bins_are_monotone_and_hold_the_kth_value():
    """The split path's window (`_row_window`, from a sample of the row) and its bins (`_window_digit`), which the
    histogram and the compaction must agree on and order as the values: on rows of random, sorted, huge (beyond
    fp16), tiny (subnormal), mostly -inf, NaN-holding, all-equal and sign-straddling values, every probe value's bin
    is in [1, 31] and never lower than a smaller value's (NaN highest, as torch.topk ranks it). On random and sorted
    rows the window holds the k-th largest value (the sample's margin makes a miss a six-sigma event)."""
    import triton
    import triton.language as tl

    tk = _kernels("topk_indices")

    @triton.jit
    def window_bins(row_ptr, probe_ptr, digit_ptr, window_ptr, length, k, WINDOW: tl.constexpr, DIGIT: tl.constexpr,
                    SAMPLE: tl.constexpr, BINS: tl.constexpr, PROBES: tl.constexpr):
        low, high, scale = WINDOW(row_ptr, length, k, SAMPLE, BINS)
        tl.store(window_ptr + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, low, high))
        i = tl.arange(0, PROBES)
        tl.store(digit_ptr + i, DIGIT(tl.load(probe_ptr + i), low, high, scale))

    gen = torch.Generator().manual_seed(5)
    n, k = 4096, 64
    randn = torch.randn(n, generator=gen)
    rows = {"randn": randn, "sorted": randn.sort().values, "huge": randn * 1e38, "beyond_fp16": randn * 1e6,
            "tiny": randn * 1e-40, "neg_inf": randn.masked_fill(torch.rand(n, generator=gen) < 0.99, float("-inf")),
            "nan": randn.masked_fill(torch.rand(n, generator=gen) < 0.1, float("nan")), "equal": torch.ones(n),
            "straddling": randn - randn.topk(k).values[-1]}
    special = torch.tensor([float("-inf"), -3e38, -1.0, -1e-40, -0.0, 0.0, 1e-45, 1.0, 3e38, float("inf"),
                            float("nan")])
    for name, row in rows.items():
        probes = torch.cat([row, special, randn * row.nan_to_num(0, 0, 0).abs().max()])
        probes = torch.cat([probes[~probes.isnan()].sort().values, probes[probes.isnan()]])  # NaN last
        probes = torch.cat([probes, probes[-1:].expand(16384 - len(probes))])
        digits = torch.empty(len(probes), dtype=torch.int32)
        window = torch.empty(2)
        window_bins[(1,)](row, probes, digits, window, n, k, WINDOW=tk._row_window, DIGIT=tk._window_digit,
                          SAMPLE=tk.RADIX_SAMPLE, BINS=tk.SAMPLE_BINS, PROBES=len(probes))
        assert digits.min() >= 1 and digits.max() <= 31, name
        assert (digits[1:] >= digits[:-1]).all(), name
        if name in ("randn", "sorted"):
            assert window[0] <= row.topk(k).values[-1] < window[1], (name, window)


def _rope_case(tokens: int, rope_dim: int, gen) -> tuple:
    """RoPE tables as strided views of one ``[P, 2, rope_dim/2]`` buffer (``rope_cos_sin``), and positions that
    wrap (-1), fall outside the tables (P, -P-1: NaN rows) or repeat."""
    from nsa_inductor.indexer import rope_cos_sin

    table = rope_cos_sin(rope_dim, 50, 10000.0)
    positions = torch.randint(0, 50, (tokens,), generator=gen)
    positions[: min(tokens, 3)] = torch.tensor([-1, 50, -51])[: min(tokens, 3)]
    return table[:, 0], table[:, 1], positions


def _store_rows_against_reference(k, cache, slots, args, block_t):
    """The store kernel on ``cache`` and the reference on a copy, both with ``args`` after the page size and layout
    (16-token pages): no byte outside the written slots changes; returns ``(got, want, nan)``, the stored rows (fp8
    values, scales) of each and the two rows whose positions fall outside the tables (``_rope_case``)."""
    from nsa_inductor.lowering.quant_cache_store import reference

    want = cache.clone()
    reference.quant_cache_store(k, want, slots, 16, False, *args)
    _kernels("quant_cache_store").quant_cache_store(k, cache, slots, 16, False, *args, block_t=block_t)
    layout = KCacheLayout(16)
    untouched = torch.ones(cache.numel(), dtype=torch.bool)
    untouched[layout.value_offsets(slots).flatten()] = False
    untouched[layout.scale_offsets(slots).flatten()] = False
    assert torch.equal(cache.view(-1)[untouched], want.view(-1)[untouched])
    got, want = layout.load(cache, slots, FN), layout.load(want, slots, FN)
    nan = want[1].isnan()
    assert torch.equal(got[1].isnan(), nan) and nan.sum() == 2
    return got, want, nan


@child_only
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rope_dim", [64, 128, 2])
@pytest.mark.parametrize("tokens, heads, block_m", [(5, 3, None), (1, 1, None), (6, 4, 16), (0, 2, None)])
def test_rotate_act_quant_rope_prologue_matches_reference(interleaved, rope_dim, tokens, heads, block_m):
    """The RoPE prologue's bf16 rows are the reference's (``apply_rope``) bit for bit: with the identity as rotation
    every output is one product, so the bytes match exactly; positions wrap or give NaN rows as the reference."""
    from nsa_inductor.lowering.rotate_act_quant import reference

    gen = torch.Generator().manual_seed(tokens * 7 + rope_dim)
    x = torch.randn(tokens, heads, 128, generator=gen).bfloat16()
    args = (torch.eye(128), 1.0, False, 128, "fp32", FN, 448.0, *_rope_case(tokens, rope_dim, gen), interleaved)
    got = _kernels("rotate_act_quant").rotate_act_quant(x, *args, block_m=block_m)
    want = reference.rotate_act_quant(x, *args)
    nan = want[0].float().isnan()  # (the reference's fp8 NaN is 0xFF, the kernel's 0x7F)
    assert torch.equal(got[1].isnan(), want[1].isnan()) and torch.equal(got[1].nan_to_num(), want[1].nan_to_num())
    assert torch.equal(got[0].float().isnan(), nan)
    assert torch.equal(got[0].view(torch.uint8)[~nan], want[0].view(torch.uint8)[~nan])
    if tokens > 1:
        assert want[1][1].isnan().all() and not want[1][3:].isnan().any()


@child_only
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotation, block_t, round_k", [(None, None, False), ("identity", None, False),
                                                        ("identity", 16, True), ("hadamard32", None, True)])
def test_quant_cache_store_rope_prologue_matches_reference(interleaved, rotation, block_t, round_k):
    """The store's RoPE prologue, alone or before a rotation, on bf16 rows or fp32 rows it rounds first
    (``round_k``): bytes equal to the reference's where every sum is exact (no rotation, the identity); within the
    rotation's contract with a Hadamard."""
    gen = torch.Generator().manual_seed(13)
    k = torch.randn(19, 128, generator=gen) * 3
    k = k if round_k else k.bfloat16()
    slots = torch.randperm(64, generator=gen)[:19]
    cache = torch.randint(0, 256, (4, 16 * 132), dtype=torch.uint8, generator=gen)
    matrix = {None: None, "identity": torch.eye(128), "hadamard32": hadamard_matrix(128)}[rotation]
    args = ("ue8m0", FN, 1.0 if matrix is None else 128**-0.5, torch.bfloat16, False, matrix,
            *_rope_case(19, 64, gen), interleaved, round_k)
    (got_v, got_s), (want_v, want_s), nan = _store_rows_against_reference(k, cache, slots, args, block_t)
    assert got_v[nan].float().isnan().all()
    if rotation == "hadamard32":
        assert_fp8_close((got_v[~nan], got_s[~nan]), (want_v[~nan], want_s[~nan]), values_frac=1e-2, scales_frac=2e-2)
    else:
        assert torch.equal(got_v[~nan].view(torch.uint8), want_v[~nan].view(torch.uint8))
        assert torch.equal(got_s[~nan], want_s[~nan])


@child_only
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotation, block_t", [(None, None), (None, 16), ("hadamard", None), ("hadamard", 16)])
def test_quant_cache_store_layer_norm_prologue_matches_reference(interleaved, rotation, block_t):
    """The store's LayerNorm prologue before rounding, RoPE (the partners normalised as they are loaded) and
    rotation, one token a program and in tiles: within one fp8 step of the reference in few values (the host's
    LayerNorm sums in another order than the kernel's ATen CUDA order; bit-exactness is the GPU test's)."""
    gen = torch.Generator().manual_seed(14)
    k = (torch.randn(19, 128, generator=gen) + torch.randn(19, 1, generator=gen)) * 3
    k[4] = 2.0  # a constant row: variance 0
    weight, bias = 1 + 0.1 * torch.randn(128, generator=gen), 0.1 * torch.randn(128, generator=gen)
    slots = torch.randperm(64, generator=gen)[:19]
    cache = torch.randint(0, 256, (4, 16 * 132), dtype=torch.uint8, generator=gen)
    matrix = None if rotation is None else hadamard_matrix(128)
    args = ("ue8m0", FN, 1.0 if matrix is None else 128**-0.5, torch.bfloat16, False, matrix,
            *_rope_case(19, 64, gen), interleaved, True, weight, bias, 1e-6)
    (got_v, got_s), (want_v, want_s), nan = _store_rows_against_reference(k, cache, slots, args, block_t)
    assert_fp8_close((got_v[~nan], got_s[~nan]), (want_v[~nan], want_s[~nan]), values_frac=1e-2, scales_frac=2e-2)


@child_only
@pytest.mark.parametrize("block_t", [None, 16])
@pytest.mark.parametrize("layer_norm", [False, True])
def test_quant_cache_store_split_k_sum_matches_reference(layer_norm, block_t):
    """``k_split_sum``: the kernel sums 3 fp32 partials left to right and rounds to bf16 before the LayerNorm, RoPE
    (the partners summed as loaded) and rotation prologues; without the LayerNorm and rotation the bytes equal the
    reference's, with them within one fp8 step in few values (the host's LayerNorm and GEMM order)."""
    gen = torch.Generator().manual_seed(15)
    k = (torch.randn(3, 19, 128, generator=gen) + torch.randn(1, 19, 1, generator=gen)) * 3
    weight, bias = 1 + 0.1 * torch.randn(128, generator=gen), 0.1 * torch.randn(128, generator=gen)
    slots = torch.randperm(64, generator=gen)[:19]
    cache = torch.randint(0, 256, (4, 16 * 132), dtype=torch.uint8, generator=gen)
    matrix = hadamard_matrix(128) if layer_norm else None
    ln = (weight, bias, 1e-6) if layer_norm else (None, None, 0.0)
    args = ("ue8m0", FN, 1.0 if matrix is None else 128**-0.5, torch.bfloat16, False, matrix,
            *_rope_case(19, 64, gen), False, True, *ln, True)
    (got_v, got_s), (want_v, want_s), nan = _store_rows_against_reference(k, cache, slots, args, block_t)
    if layer_norm:
        assert_fp8_close((got_v[~nan], got_s[~nan]), (want_v[~nan], want_s[~nan]), values_frac=1e-2, scales_frac=2e-2)
    else:
        assert torch.equal(got_v[~nan].view(torch.uint8), want_v[~nan].view(torch.uint8))
        assert torch.equal(got_s[~nan], want_s[~nan])


@child_only
@pytest.mark.parametrize("mode", sorted(WEIGHT_MODES))
@pytest.mark.parametrize("rows, cols, k, splits, config", [
    (*case, config) for case in [(1, 64, 448, 4), (0, 32, 128, 2), (17, 33, 130, 3), (40, 20, 65, 4), (70, 64, 1000, 1)]
    for config in [None, (64, 32, 3), (1, 8, 3)] if config != (1, 8, 3) or case[0] <= 17])  # one-row tiles: slow
def test_head_gate_gemm_matches_reference(rows, cols, k, splits, mode, config):
    """Ragged M/N/K edges, chunks past K (empty: zeros), every element written (NaN-poisoned output); the default
    tiling for these sizes (the one-row FMA tile at M = 1), the large-M one and the one-row tile at every M."""
    from nsa_inductor.lowering.head_gate_gemm import reference

    tk = _kernels("head_gate_gemm")
    dtype, round_weight = WEIGHT_MODES[mode]
    gen = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    weight = (torch.randn(cols, k, generator=gen) * torch.logspace(-2, 2, cols)[:, None]).to(dtype)
    out = torch.full((splits, rows, cols), float("nan"))
    got = tk.head_gate_gemm(x, weight, splits, round_weight, out=out, config=config and tk.HeadGateConfig(*config))
    assert_rows_close(got, reference.head_gate_gemm(x, weight, splits, round_weight))


@child_only
@pytest.mark.parametrize("round_weight", [False, True])
@pytest.mark.parametrize("config", [None, (1, 8, 3)])
def test_head_gate_gemm_weight_rounding_is_exact(round_weight, config):
    """x = identity: each output is one weight as the kernel split or rounded it, ties and carries included, in the
    dot tiles and the one-row FMA tile."""
    tk = _kernels("head_gate_gemm")
    weight = tie_weights(20, 70, torch.Generator().manual_seed(6))
    got = tk.head_gate_gemm(torch.eye(70).bfloat16(), weight, 2, round_weight,
                            config=config and tk.HeadGateConfig(*config)).sum(0)
    assert torch.equal(got.double(), head_gate_weight64(weight, round_weight).T)


@child_only
def test_head_gate_gemm_strided_operands():
    """A transposed weight view (a frozen model's folded ``W^T``) and a strided x are read in place."""
    from nsa_inductor.lowering.head_gate_gemm import reference

    gen = torch.Generator().manual_seed(8)
    x = torch.randn(200, 24, generator=gen).bfloat16().t()
    weight = torch.randn(200, 40, generator=gen).t()
    got = _kernels("head_gate_gemm").head_gate_gemm(x, weight, 3, False)
    assert_rows_close(got, reference.head_gate_gemm(x, weight, 3, False))


ROTATIONS = {"hadamard32": lambda: hadamard_matrix(128), "hadamard_bf16": lambda: hadamard_matrix(128).bfloat16(),
             "hadamard_t_view": lambda: hadamard_matrix(128).t()}


@child_only
@pytest.mark.parametrize("rotation", sorted(ROTATIONS))
@pytest.mark.parametrize("rows, quant_block, scale, divide, dtype, fmax, block_m",
                         [(1, 128, 128**-0.5, False, FN, 448.0, None), (17, 32, 128**0.5, True, FN, 448.0, 2),
                          (40, 128, 1.0, False, FNUZ, 224.0, 16), (0, 64, 0.5, False, FN, 448.0, None),
                          (33, 16, 128**-0.5, False, FNUZ, 240.0, None), (33, 64, 128**-0.5, False, FN, 448.0, 32)])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
def test_rotate_act_quant_matches_reference_exactly_where_sums_are_exact(rotation, rows, quant_block, scale, divide,
                                                                         dtype, fmax, block_m, scale_fmt):
    """Rows whose +-1 sums are exact in fp32 in any order: the kernel's bytes are the reference's (scale, bf16
    rounding, groups, row edges, a transposed rotation view, both fp8 types, a clamp below the type's max), on the
    fp32 row path (one row a program by default at these sizes, pairs with an odd last one) and the dot tiles."""
    from nsa_inductor.lowering.rotate_act_quant import reference

    x = integer_rows(rows, torch.Generator().manual_seed(rows)).view(rows, 1, 128)
    matrix = ROTATIONS[rotation]()
    got = _kernels("rotate_act_quant").rotate_act_quant(x, matrix, scale, divide, quant_block, scale_fmt, dtype, fmax,
                                                        block_m=block_m)
    want = reference.rotate_act_quant(x, matrix, scale, divide, quant_block, scale_fmt, dtype, fmax)
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape == (rows, 1, 128 // quant_block)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


@child_only
@pytest.mark.parametrize("rotation", ["hadamard32", "hadamard_bf16"])
@pytest.mark.parametrize("block_m", [1, 2, 16])
def test_rotate_act_quant_nan_and_inf_rows_as_the_reference(rotation, block_m):
    """A NaN in a row makes that row's values and scale NaN; an inf makes its scale inf and its values NaN, as the
    reference (fp32 GEMM) computes them, also where the fp32 matrix enters as hi + lo (inf times lo's zeros); a row
    of -0.0 quantizes to +0 as the GEMM's sum is."""
    from nsa_inductor.lowering.rotate_act_quant import reference

    x = integer_rows(5, torch.Generator().manual_seed(3)).view(5, 1, 128)
    x[1, 0, 7], x[2, 0, 100] = float("nan"), float("-inf")
    x[4] = -0.0
    args = (ROTATIONS[rotation](), 128**-0.5, False, 128, "ue8m0", FN, 448.0)
    got = _kernels("rotate_act_quant").rotate_act_quant(x, *args, block_m=block_m)
    want = reference.rotate_act_quant(x, *args)
    assert torch.equal(got[1].isnan(), want[1].isnan()) and torch.equal(got[1].isinf(), want[1].isinf())
    assert torch.equal(got[1][[0, 3, 4]], want[1][[0, 3, 4]]) and want[1][2].isinf().all()
    got_v, want_v = got[0].float(), want[0].float()
    assert torch.equal(got_v.isnan(), want_v.isnan()) and want_v[[1, 2]].isnan().all()
    assert torch.equal(got[0][[0, 3, 4]].view(torch.uint8), want[0][[0, 3, 4]].view(torch.uint8))
    assert (want[0][4].view(torch.uint8) == 0).all()  # +0, not -0
    assert (got[0][[1, 2]].view(torch.uint8) == 0x7F).all()  # the e4m3fn NaN code


@child_only
@pytest.mark.parametrize("block_m", [1, 2, 16])
def test_rotate_act_quant_any_fp32_matrix_within_contract(block_m):
    """A random fp32 matrix: whole on the row path, bf16 hi + lo (~16 bits) in the dot tiles; one fp8 step at most,
    in few values."""
    from nsa_inductor.lowering.rotate_act_quant import reference

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(300, 128, generator=gen).bfloat16()
    matrix = torch.randn(128, 128, generator=gen) / 11
    args = (matrix, 1.0, False, 128, "fp32", FN, 448.0)
    got = _kernels("rotate_act_quant").rotate_act_quant(x, *args, block_m=block_m)
    assert_fp8_close(got, reference.rotate_act_quant(x, *args), values_frac=1e-2, scales_frac=2e-2)


@child_only
@pytest.mark.parametrize("matrix", ["hadamard32", "hadamard_t_view", "random", "random_t_view", "one_lo"])
@pytest.mark.parametrize("rows, block_m", [(16, 16), (37, 16), (64, 32)])
def test_rotate_act_quant_rotation_split_once_gives_the_same_bytes(matrix, rows, block_m, monkeypatch):
    """An fp32 rotation split once before the launch (prefill's path) gives the bytes of the split in every program:
    the same bf16 planes (a +-1 Hadamard: no lo plane read; a random matrix, or one with a single nonzero lo: both
    dots, in the launch whose programs loop over the tiles, here two programs for up to four tiles), NaN and inf rows
    included; the reference's bytes where the sums are exact (a Hadamard)."""
    from nsa_inductor.lowering.rotate_act_quant import reference

    monkeypatch.setattr(_kernels("rotate_act_quant"), "LO_PLANE_PROGRAMS", 2)

    gen = torch.Generator().manual_seed(rows)
    if matrix.startswith("random"):
        rotation = torch.randn(128, 128, generator=gen) / 11
        rotation = rotation.t() if matrix.endswith("t_view") else rotation
        x = torch.randn(rows, 128, generator=gen).bfloat16()
    else:
        rotation = ROTATIONS.get(matrix, ROTATIONS["hadamard32"])()
        if matrix == "one_lo":
            rotation = rotation.clone()
            rotation[5, 9] += 2.0**-12  # below bf16's precision at 1: a lo of its own
        x = integer_rows(rows, gen)
    x[1, 7], x[2, 100] = float("nan"), float("-inf")
    args = (rotation, 128**-0.5, False, 64, "ue8m0", FN, 448.0)
    kernels = _kernels("rotate_act_quant")
    once = kernels.rotate_act_quant(x, *args, block_m=block_m, presplit=True)
    each = kernels.rotate_act_quant(x, *args, block_m=block_m, presplit=False)
    assert torch.equal(once[0].view(torch.uint8), each[0].view(torch.uint8))
    assert torch.equal(once[1].view(torch.int32), each[1].view(torch.int32))
    if matrix.startswith("hadamard"):
        want = reference.rotate_act_quant(x, *args)
        assert torch.equal(once[0][3:].view(torch.uint8), want[0][3:].view(torch.uint8))
        assert torch.equal(once[1][3:], want[1][3:])


@child_only
def test_split_rotation_planes():
    """The planes a split rotation holds: hi (the fp32 bits' top half), lo (the rest rounded to bf16; hi + lo to ~16
    bits), the flag 1 only where some lo is nonzero; a transposed view read through its strides."""
    gen = torch.Generator().manual_seed(2)
    matrix = torch.randn(128, 128, generator=gen)
    for rotation, any_lo in ((matrix, 1.0), (matrix.t(), 1.0), (hadamard_matrix(128), 0.0)):
        planes = _kernels("rotate_act_quant").split_rotation(rotation)
        hi, lo, flag = planes[:16384].view(128, 128), planes[16384:32768].view(128, 128), planes[32768]
        want_hi = (rotation.contiguous().view(torch.int32) & -65536).view(torch.float32)
        assert torch.equal(hi.float(), want_hi)
        assert torch.equal(lo, (rotation - want_hi).bfloat16())
        assert flag.item() == any_lo


@child_only
@pytest.mark.parametrize("layout", [(16, False), (16, True)])
@pytest.mark.parametrize("rotation", sorted(ROTATIONS))
@pytest.mark.parametrize("block_t", [None, 2, 16])
def test_quant_cache_store_rotation_prologue_matches_reference(layout, rotation, block_t):
    """The store's rotation prologue (then the ``/ sqrt(128)`` epilogue and bf16 rounding), padding slots; row path
    (one token a program by default, pairs) and dot tiles."""
    from nsa_inductor.lowering.quant_cache_store import reference

    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(12)
    k = integer_rows(21, gen)
    slots = torch.randperm(64, generator=gen)[:21]
    slots[3] = -1
    cache = torch.randint(0, 256, (4, page_size * 132), dtype=torch.uint8, generator=gen)
    want = cache.clone()
    args = ("ue8m0", FN, 128**0.5, torch.bfloat16, True, ROTATIONS[rotation]())
    reference.quant_cache_store(k, want, slots, page_size, preshuffle, *args)
    _kernels("quant_cache_store").quant_cache_store(k, cache, slots, page_size, preshuffle, *args, block_t=block_t)
    assert torch.equal(cache, want)


@child_only
@pytest.mark.parametrize("mode", sorted(WEIGHT_MODES))
@pytest.mark.parametrize("rows, gate_n, k_n, k, splits, config", [
    (*case, config) for case in [(1, 24, 40, 200, (4, 3)), (0, 16, 32, 128, (2, 2)), (17, 33, 20, 130, (3, 5)),
                                 (5, 16, 48, 65, (1, 4))]
    for config in [None, (16, 32, 16, 128, 4, 2), (1, 8, 16, 64, 8, 3)]
    if config != (1, 8, 16, 64, 8, 3) or case[0] <= 5])  # one-row tiles: slow in the interpreter
def test_wk_gate_gemm_matches_reference(rows, gate_n, k_n, k, splits, mode, config):
    """Both products of one launch: M = 1 and odd M, N and K tails, chunks past K (zeros), different split counts
    per product, every element of both outputs written (NaN-poisoned); the default tiling (the one-row FMA tile at
    M = 1), a wider one and the one-row tile at every M."""
    from nsa_inductor.lowering.wk_gate_gemm import reference

    tk = _kernels("wk_gate_gemm")
    dtype, round_weight = WEIGHT_MODES[mode]
    gen = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    gate_weight = (torch.randn(gate_n, k, generator=gen) * torch.logspace(-2, 2, gate_n)[:, None]).to(dtype)
    k_weight = torch.randn(k_n, k, generator=gen).bfloat16()
    out = (torch.full((splits[0], rows, gate_n), float("nan")), torch.full((splits[1], rows, k_n), float("nan")))
    got = tk.wk_gate_gemm(x, gate_weight, k_weight, *splits, round_weight, out=out,
                          config=config and tk.WkGateConfig(1 << 20, *config))
    want = reference.wk_gate_gemm(x, gate_weight, k_weight, *splits, round_weight)
    for g, w in zip(got, want):
        assert_rows_close(g, w)


@child_only
def test_wk_gate_gemm_strided_weights():
    """Transposed weight views (a frozen model's folded ``W^T``) are read in place."""
    from nsa_inductor.lowering.wk_gate_gemm import reference

    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 200, generator=gen).bfloat16()
    gate_weight, k_weight = torch.randn(200, 16, generator=gen).t(), torch.randn(200, 32, generator=gen).bfloat16().t()
    got = _kernels("wk_gate_gemm").wk_gate_gemm(x, gate_weight, k_weight, 2, 3, False)
    for g, w in zip(got, reference.wk_gate_gemm(x, gate_weight, k_weight, 2, 3, False)):
        assert_rows_close(g, w)
