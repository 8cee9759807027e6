"""The ``nsa`` ops on CPU (torch reference path) against the independent float64 model of ``helpers.ops64``;
fakes, opcheck, compile and the argument checks' error messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import nsa_inductor  # noqa: F401  (registers torch.ops.nsa)
from nsa_inductor.lowering.topk_indices import PADS
from helpers.ops64 import FN, FNUZ, HYP, TOPK_CASES, WEIGHT_MODES, adversarial_k, adversarial_topk_logits, \
    assert_rows_close, assert_topk_valid, decode_cache, eager_topk_rows, head_gate_partials64, head_gate_weight64, paged_logits64, quant64, ragged_logits64, \
    random_fp8, random_paged_cache, slot_gather64, slot_of, small_inputs, tie_weights, topk_case
from helpers.reference64 import assert_logits_close, batched_logits64

LAYOUTS = [(1, False), (16, False), (64, False), (16, True), (32, True), (64, True)]


# ---------------------------------------------------------------------------------------------------------------
# quant_cache_store
# ---------------------------------------------------------------------------------------------------------------


def _check_store(k, page_size, preshuffle, scale_fmt, dtype, slots, num_pages, gen):
    cache = torch.randint(0, 256, (num_pages, page_size * 132), dtype=torch.uint8, generator=gen)
    before = cache.clone()
    torch.ops.nsa.quant_cache_store(k, cache, slots, page_size, preshuffle, scale_fmt, dtype)
    got_codes, got_scales = decode_cache(cache, page_size, preshuffle)
    old_codes, old_scales = decode_cache(before, page_size, preshuffle)
    want_codes, want_scales = quant64(k, scale_fmt, dtype)
    written = torch.zeros(num_pages * page_size, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        written[slot] = True
        assert torch.equal(got_codes[slot], want_codes[t]), f"row {t} slot {slot}: fp8 bytes differ"
        assert got_scales[slot] == want_scales[t], f"row {t}: scale {got_scales[slot]} != {want_scales[t]}"
    assert torch.equal(got_codes[~written], old_codes[~written]), "bytes of unwritten slots changed"
    assert torch.equal(got_scales[~written].view(torch.int64), old_scales[~written].view(torch.int64))


@HYP
@given(
    layout=st.sampled_from(LAYOUTS),
    tokens=st.integers(1, 12),
    scale_fmt=st.sampled_from(["ue8m0", "fp32"]),
    dtype=st.sampled_from([FN, FNUZ]),
    magnitude=st.sampled_from([1e-3, 1.0, 37.0, 3e3]),
    pad_every=st.integers(0, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_quant_cache_store_matches_float64(layout, tokens, scale_fmt, dtype, magnitude, pad_every, seed):
    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(seed)
    num_pages = max(1, -(-(tokens + 3) // page_size))
    k = (torch.randn(tokens, 128, generator=gen) * magnitude).bfloat16()
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens]
    if pad_every:
        slots[::pad_every] = -1
    _check_store(k, page_size, preshuffle, scale_fmt, dtype, slots, num_pages, gen)


@pytest.mark.parametrize("dtype", [FN, FNUZ])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
@pytest.mark.parametrize("layout", [(1, False), (16, True)])
def test_quant_cache_store_adversarial_values(dtype, scale_fmt, layout):
    k = adversarial_k(float(torch.finfo(dtype).max))
    gen = torch.Generator().manual_seed(0)
    page_size, preshuffle = layout
    num_pages = -(-16 // page_size)
    slots = torch.tensor([3, 0, 15, 7, -1, 9, 12, 1, 5])
    _check_store(k, page_size, preshuffle, scale_fmt, dtype, slots, num_pages, gen)


@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16, None])
def test_quant_cache_store_input_epilogue(input_dtype):
    """``input_scale``/``input_dtype`` store exactly what storing ``(y * scale).to(dtype)`` stores."""
    gen = torch.Generator().manual_seed(4)
    y = torch.randn(9, 128, generator=gen) * torch.logspace(-3, 3, 9)[:, None]
    slots = torch.tensor([3, 0, 15, 7, -1, 9, 12, 1, 30])
    cache = torch.randint(0, 256, (2, 16 * 132), dtype=torch.uint8, generator=gen)
    want, got = cache.clone(), cache.clone()
    k = y * 128**-0.5
    torch.ops.nsa.quant_cache_store(k if input_dtype is None else k.to(input_dtype), want, slots, 16, True, "ue8m0")
    torch.ops.nsa.quant_cache_store(y, got, slots, 16, True, "ue8m0", FN, 128**-0.5, input_dtype)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="input_dtype must be None or one of"):
        torch.ops.nsa.quant_cache_store(y, got, slots, 16, True, "ue8m0", FN, 1.0, FN)


def test_quant_cache_store_rotation_prologue_stores_eagers_rotation():
    """``rotation=H`` stores exactly what storing ``((k.float() @ H) * c).to(bf16)`` stores (the reference is eager's
    own GEMM); a rotation needs bf16 rows."""
    from nsa_inductor.indexer import hadamard_matrix

    gen = torch.Generator().manual_seed(5)
    k = (torch.randn(9, 128, generator=gen) * torch.logspace(-3, 3, 9)[:, None]).bfloat16()
    h = hadamard_matrix(128)
    slots = torch.tensor([3, 0, 15, 7, -1, 9, 12, 1, 30])
    cache = torch.randint(0, 256, (2, 16 * 132), dtype=torch.uint8, generator=gen)
    want, got = cache.clone(), cache.clone()
    torch.ops.nsa.quant_cache_store((k.float() @ h / 128**0.5).bfloat16(), want, slots, 16, True, "ue8m0")
    torch.ops.nsa.quant_cache_store(k, got, slots, 16, True, "ue8m0", FN, 128**0.5, torch.bfloat16, True, h.t())
    torch.ops.nsa.quant_cache_store(k, cache, slots, 16, True, "ue8m0", FN, 128**0.5, torch.bfloat16, True, h)
    assert torch.equal(got, want) and torch.equal(cache, want)  # H is symmetric: the transposed view is H too
    with pytest.raises(ValueError, match=r"k must be bfloat16 \[T, 128\] \(the rotation prologue"):
        torch.ops.nsa.quant_cache_store(k.float(), got, slots, 16, True, "ue8m0", FN, 1.0, None, False, h)
    with pytest.raises(ValueError, match=r"rotation must be .*\[128, 128\]"):  # also where round_k rounds fp32 rows
        torch.ops.nsa.quant_cache_store(k.float(), got, slots, 16, True, "ue8m0", FN, 1.0, None, False, h[:64],
                                        round_k=True)


def test_quant_cache_store_layer_norm_prologue_is_eagers_layer_norm():
    """``ln_weight``/``ln_bias``/``ln_eps`` store what storing ``F.layer_norm(k, [128], w, b, eps)`` (rounded to
    bf16) stores; the prologue needs both tensors as fp32 [128], fp32 rows and ``round_k``."""
    gen = torch.Generator().manual_seed(6)
    k = torch.randn(9, 128, generator=gen) * 5 + 2
    w, b = 1 + 0.1 * torch.randn(128, generator=gen), 0.1 * torch.randn(128, generator=gen)
    slots = torch.tensor([3, 0, 15, 7, -1, 9, 12, 1, 30])
    cache = torch.randint(0, 256, (2, 16 * 132), dtype=torch.uint8, generator=gen)
    want, got = cache.clone(), cache.clone()
    normed = torch.nn.functional.layer_norm(k, [128], w, b, 1e-6)
    torch.ops.nsa.quant_cache_store(normed.bfloat16(), want, slots, 16, True, "ue8m0")
    torch.ops.nsa.quant_cache_store(k, got, slots, 16, True, "ue8m0", round_k=True, ln_weight=w, ln_bias=b,
                                    ln_eps=1e-6)
    assert torch.equal(got, want)
    call = dict(round_k=True, ln_weight=w, ln_bias=b)
    for change, message in [({"ln_bias": None}, "ln_weight and ln_bias go together"),
                            ({"round_k": False}, "needs round_k=True"),
                            ({"ln_weight": w[:64]}, r"ln_weight must be float32 \[128\]"),
                            ({"ln_bias": b.double()}, r"ln_bias must be float32 \[128\]")]:
        with pytest.raises(ValueError, match=message):
            torch.ops.nsa.quant_cache_store(k, got, slots, 16, True, "ue8m0", **{**call, **change})


def test_quant_cache_store_split_k_sum_is_the_rounded_sum():
    """``k_split_sum`` stores what storing the partials' left-to-right sum rounded to bf16 stores (with and without
    the LayerNorm prologue, one partial too); it needs fp32 [S, T, 128] partials, S >= 1, and ``round_k``."""
    gen = torch.Generator().manual_seed(8)
    w, b = 1 + 0.1 * torch.randn(128, generator=gen), 0.1 * torch.randn(128, generator=gen)
    slots = torch.tensor([3, 0, 15, 7, -1, 9, 12, 1, 30])
    cache = torch.randint(0, 256, (2, 16 * 132), dtype=torch.uint8, generator=gen)
    for splits in (3, 1):
        p = torch.randn(splits, 9, 128, generator=gen) * 4 + 1
        total = p[0]
        for partial in p[1:]:
            total = total + partial
        for ln in ({}, {"ln_weight": w, "ln_bias": b, "ln_eps": 1e-6}):
            want, got = cache.clone(), cache.clone()
            torch.ops.nsa.quant_cache_store(total.bfloat16().float(), want, slots, 16, True, "ue8m0", round_k=True,
                                            **ln)
            torch.ops.nsa.quant_cache_store(p, got, slots, 16, True, "ue8m0", round_k=True, k_split_sum=True, **ln)
            assert torch.equal(got, want)
    assert not torch.equal(got, cache)
    for k, change, message in [(p[0], {}, r"k must be float32 \[S, T, 128\]"),
                               (p.bfloat16(), {}, r"k must be float32 \[S, T, 128\]"),
                               (p[:0], {}, "at least one split-K partial"),
                               (p, {"round_k": False}, "k_split_sum needs round_k=True"),
                               (p[:, :4], {}, r"slot_mapping must be .*\[T=4\]")]:
        with pytest.raises(ValueError, match=message):
            torch.ops.nsa.quant_cache_store(k, cache, slots, 16, True, "ue8m0", **{"round_k": True,
                                            "k_split_sum": True, **change})


def test_quant_cache_store_all_padding_writes_nothing():
    cache = torch.randint(0, 256, (2, 16 * 132), dtype=torch.uint8)
    before = cache.clone()
    torch.ops.nsa.quant_cache_store(torch.randn(5, 128).bfloat16(), cache, torch.full((5,), -1), 16, True, "ue8m0")
    assert torch.equal(cache, before)


# ---------------------------------------------------------------------------------------------------------------
# gather_k
# ---------------------------------------------------------------------------------------------------------------


@HYP
@given(
    layout=st.sampled_from(LAYOUTS),
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    spare=st.integers(0, 5),
    dtype=st.sampled_from([FN, FNUZ]),
    seed=st.integers(0, 2**31 - 1),
)
def test_gather_k_matches_decoded_cache(layout, lengths, spare, dtype, seed):
    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(seed)
    cache, block_table = random_paged_cache(lengths, page_size, dtype, gen)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    total = int(cu[-1])
    k, scale = torch.ops.nsa.gather_k(cache, block_table, cu, page_size, preshuffle, total + spare, dtype)
    assert k.shape == (total + spare, 128) and k.dtype == dtype and scale.dtype == torch.float32
    codes, scales = decode_cache(cache, page_size, preshuffle)
    for b, length in enumerate(lengths):
        for n in range(length):
            slot, row = slot_of(block_table, b, n, page_size), int(cu[b]) + n
            assert torch.equal(k[row].view(torch.uint8), codes[slot]), f"seq {b} token {n}"
            assert scale[row].item() == scales[slot].item()
    assert not k[total:].view(torch.uint8).any() and not scale[total:].any(), "rows past cu_seqlens[-1] not zero"


# ---------------------------------------------------------------------------------------------------------------
# gather_k_slots
# ---------------------------------------------------------------------------------------------------------------


@HYP
@given(layout=st.sampled_from(LAYOUTS), by_sequence=st.booleans(), n=st.sampled_from([0, 1, 7, 30]),
       int64=st.booleans(), dtype=st.sampled_from([FN, FNUZ]), seed=st.integers(0, 2**31 - 1))
def test_gather_k_slots_matches_list_indexing(layout, by_sequence, n, int64, dtype, seed):
    """Ids in range, negative ones wrapping, and out of range (zero rows), by slot and by sequence and position."""
    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(seed)
    cache, block_table = random_paged_cache([40, 17, 5], page_size, dtype, gen, spare_pages=2)
    id_type = torch.int64 if int64 else torch.int32
    if by_sequence:
        span = block_table.shape[1] * page_size
        args = (block_table.to(id_type), torch.randint(-4, 4, (n,), generator=gen, dtype=id_type))
        positions = torch.randint(-span - 3, span + 3, (n,), generator=gen, dtype=id_type)
    else:
        num_slots = cache.shape[0] * page_size
        args = ()
        positions = torch.randint(-num_slots - 3, num_slots + 3, (n,), generator=gen, dtype=id_type)
    k, scale = torch.ops.nsa.gather_k_slots(cache, positions, page_size, preshuffle, dtype, *args)
    assert k.shape == (n, 128) and k.dtype == dtype and scale.shape == (n,) and scale.dtype == torch.float32
    codes, scales = slot_gather64(cache, positions, page_size, preshuffle, *args)
    assert torch.equal(k.view(torch.uint8), codes)
    assert torch.equal(scale.double(), scales)


# ---------------------------------------------------------------------------------------------------------------
# logits
# ---------------------------------------------------------------------------------------------------------------


@HYP
@given(
    layout=st.sampled_from(LAYOUTS),
    heads=st.sampled_from([16, 32, 64]),
    next_n=st.sampled_from([1, 2]),
    ctx=st.lists(st.integers(0, 70), min_size=1, max_size=3),
    extra_len=st.integers(0, 40),
    dtype=st.sampled_from([FN, FNUZ]),
    seed=st.integers(0, 2**31 - 1),
)
def test_paged_mqa_logits_matches_float64(layout, heads, next_n, ctx, extra_len, dtype, seed):
    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(seed)
    batch = len(ctx)
    cache, block_table = random_paged_cache(ctx, page_size, dtype, gen, spare_pages=2)
    q = random_fp8((batch, next_n, heads, 128), dtype, gen)
    weights = torch.randn(batch * next_n, heads, generator=gen)
    context_lens = torch.tensor(ctx, dtype=torch.int32)
    max_len = max(ctx) + extra_len
    args = (q, cache, weights, context_lens, block_table, max_len, page_size, preshuffle)
    got = torch.ops.nsa.paged_mqa_logits(*args)
    assert got.shape == (batch * next_n, max_len) and got.dtype == torch.float32
    assert_logits_close(got, paged_logits64(*args), rtol=1e-5)
    factor = torch.rand(batch * next_n, heads, generator=gen)
    parts = torch.randn(3, batch * next_n, heads, generator=gen)  # split-K partials of the weights
    factored = torch.ops.nsa.paged_mqa_logits(q, cache, parts, *args[3:], factor, 0.25)  # (p0 + p1 + p2) * f * 0.25
    want = paged_logits64(q, cache, (parts[0] + parts[1] + parts[2]) * factor * 0.25, *args[3:])
    assert_logits_close(factored, want, rtol=1e-5)


@HYP
@given(
    tokens=st.integers(1, 24),
    keys=st.integers(1, 40),
    heads=st.sampled_from([16, 32, 64]),
    dtype=st.sampled_from([FN, FNUZ]),
    seed=st.integers(0, 2**31 - 1),
)
def test_mqa_logits_matches_float64(tokens, keys, heads, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = random_fp8((tokens, heads, 128), dtype, gen)
    k = random_fp8((keys, 128), dtype, gen)
    k_scale = torch.rand(keys, generator=gen) + 0.01
    weights = torch.randn(tokens, heads, generator=gen)
    ks = torch.randint(0, keys + 1, (tokens,), generator=gen, dtype=torch.int32)
    ke = torch.minimum(ks + torch.randint(0, keys + 1, (tokens,), generator=gen, dtype=torch.int32),
                       torch.tensor(keys, dtype=torch.int32))
    got = torch.ops.nsa.mqa_logits(q, k, k_scale, weights, ks, ke)
    assert_logits_close(got, ragged_logits64(q, k, k_scale, weights, ks, ke), rtol=1e-5)


@given(
    batch=st.integers(0, 3),
    tokens=st.integers(0, 5),
    heads=st.integers(1, 9),
    keys=st.integers(0, 40),
    dim=st.sampled_from([0, 1, 16, 48, 128]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_batched_mqa_logits_matches_float64(batch, tokens, heads, keys, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(batch, keys, dim, generator=gen).to(dtype)
    weights = torch.randn(batch, tokens, heads, generator=gen)
    got = torch.ops.nsa.batched_mqa_logits(q, k, weights, 0.125)
    assert (got.shape, got.dtype) == ((batch, tokens, keys), torch.float32)
    assert_logits_close(got, batched_logits64(q, k, weights, 0.125), rtol=1e-6)
    scaled = torch.ops.nsa.batched_mqa_logits(q, k, weights, 1.0, torch.tensor(0.125))
    assert_logits_close(scaled, batched_logits64(q, k, weights, 0.125), rtol=1e-6)
    mask = torch.rand(batch, 1, keys, generator=gen).expand(batch, tokens, keys) < 0.5  # (a broadcast mask)
    masked = torch.ops.nsa.batched_mqa_logits(q, k, weights, 0.125, None, mask)
    assert_logits_close(masked, batched_logits64(q, k, weights, 0.125, mask), rtol=1e-6)
    least = torch.finfo(torch.float32).min  # another fill
    filled = torch.ops.nsa.batched_mqa_logits(q, k, weights, 0.125, None, mask, least)
    assert torch.equal(filled, masked.masked_fill(~mask, least))


def test_mqa_logits_causal_prefill():
    gen = torch.Generator().manual_seed(1)
    tokens, heads = 20, 32
    q, k = random_fp8((tokens, heads, 128), FN, gen), random_fp8((tokens, 128), FN, gen)
    k_scale, weights = torch.rand(tokens, generator=gen) + 0.1, torch.randn(tokens, heads, generator=gen)
    ks = torch.tensor([0] * 12 + [12] * 8, dtype=torch.int32)  # two sequences of 12 and 8 tokens
    ke = torch.arange(1, tokens + 1, dtype=torch.int32)
    got = torch.ops.nsa.mqa_logits(q, k, k_scale, weights, ks, ke)
    assert_logits_close(got, ragged_logits64(q, k, k_scale, weights, ks, ke), rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# top-k
# ---------------------------------------------------------------------------------------------------------------


@HYP
@given(**TOPK_CASES)
def test_topk_indices_reference_is_eager_topk_as_sets(rows, cols, k_frac, inf, with_lengths, with_offset, seed):
    logits, k, lengths, offset = topk_case(rows, cols, k_frac, inf, with_lengths, with_offset, seed)
    got = torch.ops.nsa.topk_indices(logits, k, lengths, offset)
    assert got.dtype == torch.int32 and got.shape == (rows, k)
    assert [sorted(r) for r in got.tolist()] == eager_topk_rows(logits, k, lengths, offset)


@HYP
@given(rows=st.integers(1, 3), cols=st.integers(1, 40), k_frac=st.floats(0, 1),
       kind=st.sampled_from(["ties", "equal", "close", "nan", "tail", "randn"]), pad=st.sampled_from(PADS),
       sorted_=st.booleans(), with_lengths=st.booleans(), seed=st.integers(0, 99))
def test_topk_indices_reference_meets_the_contract(rows, cols, k_frac, kind, pad, sorted_, with_lengths, seed):
    logits = adversarial_topk_logits(rows, cols, kind, seed)
    k = round(k_frac * cols)
    lengths = torch.randint(0, cols + 2, (rows,), generator=torch.Generator().manual_seed(seed)).int() \
        if with_lengths else None
    offset = -torch.arange(rows)  # columns shift up: no finite value maps to -1
    got = torch.ops.nsa.topk_indices(logits, k, lengths, offset, pad, sorted_)
    assert_topk_valid(logits, got, k, lengths, offset, pad, sorted_)


def test_topk_indices_rejects_an_unknown_pad():
    with pytest.raises(ValueError, match=r"pad must be one of \('neg1', 'column'\), got 'zero'"):
        torch.ops.nsa.topk_indices(torch.zeros(2, 4), 2, None, None, "zero")


# ---------------------------------------------------------------------------------------------------------------
# head-gate GEMM
# ---------------------------------------------------------------------------------------------------------------


@HYP
@given(
    rows=st.integers(0, 40),
    cols=st.integers(1, 70),
    k=st.integers(0, 300),
    splits=st.integers(1, 4),
    mode=st.sampled_from(sorted(WEIGHT_MODES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_head_gate_gemm_matches_float64(rows, cols, k, splits, mode, seed):
    """Products of the bf16 values are exact in fp32, so each partial is off by fp32 summation alone:
    at most about ``K * 2^-24`` times the sum of ``|x * w|``."""
    dtype, round_weight = WEIGHT_MODES[mode]
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=gen) * 3).bfloat16()
    weight = (torch.randn(cols, k, generator=gen) * torch.logspace(-2, 2, cols)[:, None]).to(dtype)
    got = torch.ops.nsa.head_gate_gemm(x, weight, splits, round_weight)
    assert got.shape == (splits, rows, cols) and got.dtype == torch.float32
    want = head_gate_partials64(x, weight, splits, round_weight)
    magnitude = x.double().abs() @ head_gate_weight64(weight, round_weight).abs().T
    slack = (k + splits) * 2.0**-24
    assert ((got.double() - want).abs() <= slack * magnitude).all()
    assert ((got.double().sum(0) - want.sum(0)).abs() <= slack * magnitude).all()


@pytest.mark.parametrize("k, splits, empty", [(65, 4, [2, 3]), (130, 3, []), (64, 4, [1, 2, 3]), (0, 2, [0, 1])])
def test_head_gate_gemm_chunks(k, splits, empty):
    """Chunks are multiples of 64 columns; the ones past K hold zeros."""
    gen = torch.Generator().manual_seed(k)
    x, weight = torch.randn(3, k, generator=gen).bfloat16(), torch.randn(5, k, generator=gen)
    got = torch.ops.nsa.head_gate_gemm(x, weight, splits, False)
    assert torch.equal(got[empty], torch.zeros(len(empty), 3, 5))
    assert_rows_close(got, head_gate_partials64(x, weight, splits, False))


@pytest.mark.parametrize("round_weight", [False, True])
def test_head_gate_gemm_weight_rounding_is_exact(round_weight):
    """x = identity: every output is one weight as the op sees it (hi + lo, or bf16(W)), ties and carries included."""
    gen = torch.Generator().manual_seed(5)
    weight = tie_weights(6, 200, gen)
    got = torch.ops.nsa.head_gate_gemm(torch.eye(200).bfloat16(), weight, 3, round_weight).sum(0)
    assert torch.equal(got.double(), head_gate_weight64(weight, round_weight).T)


@HYP
@given(
    rows=st.integers(0, 20),
    gate_n=st.integers(1, 40),
    k_n=st.integers(1, 40),
    k=st.integers(0, 300),
    gate_splits=st.integers(1, 5),
    k_splits=st.integers(1, 5),
    mode=st.sampled_from(sorted(WEIGHT_MODES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_wk_gate_gemm_matches_float64(rows, gate_n, k_n, k, gate_splits, k_splits, mode, seed):
    """Both products against the float64 model, each with its own split count (the same bound as the head gate's:
    products of bf16 values are exact in fp32); the K product's sum rounded to bf16 is within one bf16 rounding of
    the exact product (one bf16 ulp)."""
    dtype, round_weight = WEIGHT_MODES[mode]
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=gen) * 3).bfloat16()
    gate_weight = (torch.randn(gate_n, k, generator=gen) * torch.logspace(-2, 2, gate_n)[:, None]).to(dtype)
    k_weight = torch.randn(k_n, k, generator=gen).bfloat16()
    gates, keys = torch.ops.nsa.wk_gate_gemm(x, gate_weight, k_weight, gate_splits, k_splits, round_weight)
    assert gates.shape == (gate_splits, rows, gate_n) and keys.shape == (k_splits, rows, k_n)
    for got, weight, splits, rounded in ((gates, gate_weight, gate_splits, round_weight),
                                         (keys, k_weight, k_splits, False)):
        want = head_gate_partials64(x, weight, splits, rounded)
        magnitude = x.double().abs() @ head_gate_weight64(weight, rounded).abs().T
        slack = (k + splits) * 2.0**-24
        assert ((got.double() - want).abs() <= slack * magnitude).all()
        assert ((got.double().sum(0) - want.sum(0)).abs() <= slack * magnitude).all()
    exact = want.sum(0)
    bf16 = keys.sum(0).bfloat16().double()
    assert ((bf16 - exact).abs() <= 2.0**-8 * exact.abs() + (k + k_splits) * 2.0**-24 * magnitude).all()


def test_head_gate_gemm_round_weight_needs_fp32_weight():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, weight, weight32 = torch.zeros(2, 64).bfloat16(), torch.zeros(3, 64).bfloat16(), torch.zeros(3, 64)
    with pytest.raises(ValueError, match=r"round_weight needs a float32 weight .* got bfloat16 \[3, 64\]"):
        torch.ops.nsa.head_gate_gemm(x, weight, 1, True)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=r"splits must be >= 1, got 0"):
        torch.ops.nsa.head_gate_gemm(mode.from_tensor(x), mode.from_tensor(weight32), 0, False)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=r"round_weight needs a float32 weight"):
        torch.ops.nsa.head_gate_gemm(mode.from_tensor(x), mode.from_tensor(weight), 1, True)


# ---------------------------------------------------------------------------------------------------------------
# fakes, opcheck, compile
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["quant_cache_store", "gather_k", "gather_k_slots", "paged_mqa_logits", "mqa_logits", "topk_indices",
             "head_gate_gemm", "wk_gate_gemm", "batched_mqa_logits"]
)
def test_opcheck(name):
    utils = ("test_schema", "test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    if name in ("paged_mqa_logits", "mqa_logits"):
        utils = utils[1:]  # opcheck's schema check runs allclose on the fp8 inputs, which CPU torch cannot do
    torch.library.opcheck(getattr(torch.ops.nsa, name).default, small_inputs()[name], test_utils=utils)


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    inputs = small_inputs()
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = {name: tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
                for name, args in inputs.items()}
        assert torch.ops.nsa.quant_cache_store(*fake["quant_cache_store"]) is None
        k, s = torch.ops.nsa.gather_k(*fake["gather_k"])
        assert (k.shape, k.dtype, s.shape, s.dtype) == ((24, 128), FN, (24,), torch.float32)
        k, s = torch.ops.nsa.gather_k_slots(*fake["gather_k_slots"])
        assert (k.shape, k.dtype, s.shape, s.dtype) == ((5, 128), FN, (5,), torch.float32)
        out = torch.ops.nsa.paged_mqa_logits(*fake["paged_mqa_logits"])
        assert (out.shape, out.dtype) == ((4, 40), torch.float32)
        out = torch.ops.nsa.mqa_logits(*fake["mqa_logits"])
        assert (out.shape, out.dtype) == ((6, 9), torch.float32)
        out = torch.ops.nsa.topk_indices(*fake["topk_indices"])
        assert (out.shape, out.dtype) == ((4, 7), torch.int32)
        out = torch.ops.nsa.head_gate_gemm(*fake["head_gate_gemm"])
        assert (out.shape, out.dtype) == ((3, 5, 12), torch.float32)
        out = torch.ops.nsa.batched_mqa_logits(*fake["batched_mqa_logits"])
        assert (out.shape, out.dtype) == ((2, 3, 5), torch.float32)
        gates, k = torch.ops.nsa.wk_gate_gemm(*fake["wk_gate_gemm"])
        assert (gates.shape, gates.dtype, k.shape, k.dtype) == ((3, 5, 12), torch.float32, (2, 5, 20), torch.float32)


def test_quant_cache_store_is_declared_mutating():
    schema = torch.ops.nsa.quant_cache_store.default._schema
    assert [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write] == ["cache"]
    assert len(schema.returns) == 0


def test_ops_under_torch_compile():
    inputs = small_inputs()

    def step(k, cache, slots, q, weights, ctx, block_table):
        torch.ops.nsa.quant_cache_store(k, cache, slots, 16, True, "ue8m0")
        return torch.ops.nsa.paged_mqa_logits(q, cache, weights, ctx, block_table, 40, 16, True)

    k, cache, slots = inputs["quant_cache_store"][:3]
    q, _, weights, ctx, block_table = inputs["paged_mqa_logits"][:5]
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    want = step(k, eager_cache, slots, q, weights, ctx, block_table)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(k, compiled_cache, slots, q, weights, ctx,
                                                                   block_table)
    assert torch.equal(compiled_cache, eager_cache)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------------------
# validation errors
# ---------------------------------------------------------------------------------------------------------------


def _replace(args: tuple, index: int, value) -> tuple:
    return args[:index] + (value,) + args[index + 1 :]


@pytest.mark.parametrize(
    "name, index, value, message",
    [
        ("quant_cache_store", 0, torch.randn(6, 64).bfloat16(), r"k must be .*\[T, 128\], got bfloat16 \[6, 64\]"),
        ("quant_cache_store", 1, torch.zeros(4, 100, dtype=torch.uint8), r"cache must be uint8 \[num_pages, 2112\]"),
        ("quant_cache_store", 1, torch.zeros(4, 2112), r"cache must be uint8 .* got float32 \[4, 2112\]"),
        ("quant_cache_store", 2, torch.zeros(5, dtype=torch.int64), r"slot_mapping must be .*\[T=6\].* got int64"),
        ("quant_cache_store", 2, torch.zeros(6), r"slot_mapping must be int32 or int64 .* got float32 \[6\]"),
        ("quant_cache_store", 5, "e8m0", r"scale_fmt must be one of"),
        ("quant_cache_store", 6, torch.bfloat16, r"fp8_dtype must be one of"),
        ("gather_k", 1, torch.zeros(2, 2, dtype=torch.int64), r"block_table must be int32 \[B, max_pages\], got int64"),
        ("gather_k", 2, torch.zeros(4, dtype=torch.int32), r"cu_seqlens must be int32 \[B\+1=3\].* got int32 \[4\]"),
        ("gather_k_slots", 1, torch.zeros(5, 1, dtype=torch.int64),
         r"positions must be int32 or int64 \[N\], got int64 \[5, 1\]"),
        ("gather_k_slots", 6, torch.zeros(4, dtype=torch.int32),
         r"seq_ids must be .*\[N=5\] \(N of positions\), got int32 \[4\]"),
        ("gather_k_slots", 6, None, r"block_table and seq_ids go together: give both"),
        ("paged_mqa_logits", 0, torch.zeros(2, 2, 32, 128), r"q_fp8 must be float8_e4m3fn or float8_e4m3fnuz"),
        ("paged_mqa_logits", 2, torch.zeros(2, 32),
         r"weights must be float32 \[B\*next_n=4, H=32\] \(B, next_n, H of q_fp8\), got .*\[2, 32\]"),
        ("paged_mqa_logits", 8, torch.zeros(4, 31), r"weights_factor must be float32 \[B\*next_n=4, H=32\] \(as "
                                                   r"weights\), got float32 \[4, 31\]"),
        ("paged_mqa_logits", 2, torch.zeros(2, 3, 32),
         r"weights must be float32 \[S, B\*next_n=4, H=32\] \(split-K partials; B, next_n, H of q_fp8\)"),
        ("paged_mqa_logits", 3, torch.zeros(2, dtype=torch.int64),
         r"context_lens must be int32 \[B=2\] \(B of q_fp8\), got int64"),
        ("paged_mqa_logits", 4, torch.zeros(3, 2, dtype=torch.int32), r"block_table must be int32 \[B=2, max_pages\]"),
        ("mqa_logits", 1, torch.zeros(9, 128, dtype=FNUZ), r"k_fp8 must be float8_e4m3fn \[N, 128\]"),
        ("mqa_logits", 2, torch.zeros(9, 1), r"k_scale must be float32 \[N=9\] \(N of k_fp8\), got float32 \[9, 1\]"),
        ("mqa_logits", 5, torch.zeros(6, dtype=torch.int64),
         r"ke must be int32 \[T=6\] \(T of q_fp8\), got int64 \[6\]"),
        ("topk_indices", 0, torch.zeros(4, 30).bfloat16(), r"logits must be float32 \[R, N\], got bfloat16"),
        ("topk_indices", 1, 31, r"k must be in \[0, N=30\], got 31"),
        ("topk_indices", 2, torch.zeros(3, dtype=torch.int32), r"lengths must be int32 or int64 \[R=4\]"),
        ("topk_indices", 3, torch.zeros(4, 1, dtype=torch.int64), r"offset must be int32 or int64 \[R=4\]"),
        ("head_gate_gemm", 0, torch.zeros(5, 130), r"x must be bfloat16 \[M, K\], got float32 \[5, 130\]"),
        ("head_gate_gemm", 0, torch.zeros(5, 2, 65).bfloat16(), r"x must be bfloat16 \[M, K\], got .*\[5, 2, 65\]"),
        ("head_gate_gemm", 1, torch.zeros(12, 129), r"weight must be .*bfloat16 \[N, K=130\], got .*\[12, 129\]"),
        ("head_gate_gemm", 1, torch.zeros(12, 130).half(), r"weight must be float32 or bfloat16 .* got float16"),
        ("head_gate_gemm", 2, 0, r"splits must be >= 1, got 0"),
        ("rotate_act_quant", 0, torch.zeros(2, 3, 128), r"x must be bfloat16 \[\.\.\., 128\], got float32 \[2, 3, 128\]"),
        ("rotate_act_quant", 1, torch.zeros(128, 64), r"rotation must be .* \[128, 128\], got float32 \[128, 64\]"),
        ("rotate_act_quant", 1, torch.zeros(128, 128).half(), r"rotation must be float32 or bfloat16 .* got float16"),
        ("rotate_act_quant", 4, 8, r"quant_block must be one of \(16, 32, 64, 128\)"),
        ("rotate_act_quant", 7, 500.0, r"fp8_max must be in \(0, 448.0\] for torch.float8_e4m3fn, got 500.0"),
        ("wk_gate_gemm", 0, torch.zeros(5, 130), r"x must be bfloat16 \[M, K\], got float32 \[5, 130\]"),
        ("wk_gate_gemm", 1, torch.zeros(12, 129), r"gate_weight must be .*\[N, K=130\], got float32 \[12, 129\]"),
        ("wk_gate_gemm", 2, torch.zeros(20, 130), r"k_weight must be bfloat16 \[N, K=130\], got float32 \[20, 130\]"),
        ("wk_gate_gemm", 4, 0, r"k_splits must be >= 1, got 0"),
        ("wk_gate_gemm", 1, torch.zeros(12, 130).bfloat16(), None),
        ("batched_mqa_logits", 0, torch.zeros(2, 3, 4, 64),
         r"q must be bfloat16 or float16 \[B, S, H, D\], got float32"),
        ("batched_mqa_logits", 1, torch.zeros(2, 5, 64).half(), r"k must be bfloat16 \[B=2, T, D=64\] \(same dtype as "
                                                                r"q\), got float16"),
        ("batched_mqa_logits", 1, torch.zeros(3, 5, 64).bfloat16(), r"k must be bfloat16 \[B=2, T, D=64\]"),
        ("batched_mqa_logits", 2, torch.zeros(2, 3, 5), r"weights must be float32 \[B=2, S=3, H=4\], got float32 "
                                                        r"\[2, 3, 5\]"),
        ("batched_mqa_logits", 3, float("inf"), r"scale must be finite, got inf"),
        ("batched_mqa_logits", 4, torch.tensor([0.5]),
         r"scale_tensor must be float32 \[\] \(one value\), got float32 \[1\]"),
        ("batched_mqa_logits", 5, torch.ones(2, 3, 6), r"mask must be bool \[B=2, S=3, T=5\] \(any strides: a "
                                                      r"broadcast mask expanded\), got float32 \[2, 3, 6\]"),
    ],
)
def test_validation_errors_name_the_tensor(name, index, value, message):
    args = _replace(small_inputs()[name], index, value)
    if message is None:  # round_weight with a bf16 gate weight
        args, message = _replace(args, 5, True), r"round_weight needs a float32 gate_weight .* got bfloat16 \[12, 130\]"
    with pytest.raises(ValueError, match=message):
        getattr(torch.ops.nsa, name)(*args)


_TABLE = torch.zeros(40, 32)


@pytest.mark.parametrize("name", ["rotate_act_quant", "quant_cache_store"])
@pytest.mark.parametrize("rope, message", [
    ((_TABLE, _TABLE, None), r"rope_cos, rope_sin and positions come together"),
    ((_TABLE.double(), _TABLE, "positions"), r"rope_cos must be float32 \[positions, rope_dim // 2\], got float64"),
    ((torch.zeros(40, 65), torch.zeros(40, 65), "positions"), r"rope_cos must have 1 to 64 columns"),
    ((_TABLE, torch.zeros(40, 31), "positions"), r"rope_sin must be float32 \[40, 32\] \(as rope_cos\)"),
    ((_TABLE, _TABLE, torch.zeros(7, dtype=torch.int64)), r"positions must be int32 or int64 \[T=\d\] \(one position "
                                                           r"per token of x\), got int64 \[7\]"),
    ((_TABLE, _TABLE, torch.zeros(1)), r"positions must be int32 or int64"),
])
def test_rope_prologue_arguments_are_checked(name, rope, message):
    args = small_inputs()[name]
    positions = rope[2] if rope[2] != "positions" else torch.zeros(args[0].shape[0], dtype=torch.int32)
    kwargs = dict(zip(("rope_cos", "rope_sin", "positions"), (*rope[:2], positions)))
    with pytest.raises(ValueError, match=message):
        getattr(torch.ops.nsa, name)(*args, **kwargs)


def test_rope_prologue_needs_bf16_rows():
    args = _replace(small_inputs()["quant_cache_store"], 0, torch.randn(6, 128))
    with pytest.raises(ValueError, match=r"a RoPE prologue rotates bf16 rows \[T, \.\.\., 128\], got float32"):
        torch.ops.nsa.quant_cache_store(*args, rope_cos=_TABLE, rope_sin=_TABLE, positions=torch.zeros(6).long())


def test_preshuffle_needs_page_multiple_of_16():
    args = _replace(small_inputs()["quant_cache_store"], 3, 8)
    args = _replace(args, 1, torch.zeros(8, 8 * 132, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 16"):
        torch.ops.nsa.quant_cache_store(*args)
