"""The ``nsa`` ops on CPU (torch reference path) against an independent float64 model written here.

The model decodes cache bytes with DESIGN §3's view/permute description (not the project's offset formula),
quantizes in float64 and rounds to fp8 by searching the fp8 value table. Other test modules import these helpers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nsa_inductor.lowering  # noqa: F401  (registers torch.ops.nsa)

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
LAYOUTS = [(1, False), (16, False), (64, False), (16, True), (32, True), (64, True)]
AMAX_FLOOR32 = float(np.float32(1e-4))
HYP = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------------------------
# independent float64 model
# ---------------------------------------------------------------------------------------------------------------


def decode_cache(cache: torch.Tensor, page_size: int, preshuffle: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(value bytes uint8 [slots,128], scales float64 [slots])`` of a uint8 cache, slot-major."""
    pages = cache.cpu().reshape(cache.shape[0], page_size * 132)
    values = pages[:, : page_size * 128]
    if preshuffle:  # stored as [P//16, d//16, i%16, d%16] tiles; undo the permute of DESIGN §3
        values = values.reshape(-1, page_size // 16, 8, 16, 16).permute(0, 1, 3, 2, 4)
    values = values.reshape(-1, 128)
    scales = pages[:, page_size * 128 :].contiguous().view(torch.float32).reshape(-1).double()
    return values, scales


def fp8_to_f64(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    table = torch.arange(256, dtype=torch.uint8).view(dtype).double()
    return table[codes.cpu().long()]


def fp8_codes_rne(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Nearest fp8 code of each float64 ``y`` (|y| <= fmax), ties to the even code; fnuz has no -0."""
    codes = torch.arange(128, dtype=torch.uint8)
    vals = codes.view(dtype).double()
    finite = ~vals.isnan()
    codes, vals = codes[finite], vals[finite]
    a = y.abs()
    idx = torch.searchsorted(vals, a).clamp(1, len(vals) - 1)
    lo, hi = vals[idx - 1], vals[idx]
    up, down = hi - a, a - lo
    pick_hi = (up < down) | ((up == down) & (codes[idx] % 2 == 0))
    code = torch.where(pick_hi, codes[idx], codes[idx - 1])
    negative = torch.signbit(y)
    if dtype == FNUZ:
        negative &= code != 0
    return torch.where(negative, code | 0x80, code)


def quant64(k: torch.Tensor, scale_fmt: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Expected ``(fp8 codes [T,128], fp32-valued scales [T] float64)`` of act_quant, computed in float64."""
    fmax = float(torch.finfo(dtype).max)
    x = k.double()
    amax = x.abs().amax(dim=1).clamp(min=AMAX_FLOOR32)
    scale = (amax / fmax).float().double()  # one fp32 rounding of the quotient, like torch on the host
    if scale_fmt == "ue8m0":
        scale = torch.tensor([2.0 ** math.ceil(math.log2(s)) for s in scale.tolist()], dtype=torch.float64)
    y = (x / scale[:, None]).float().double().clamp(-fmax, fmax)  # act_quant divides in fp32, then casts
    return fp8_codes_rne(y, dtype), scale


def slot_of(block_table: torch.Tensor, b: int, n: int, page_size: int) -> int:
    return int(block_table[b, n // page_size]) * page_size + n % page_size


def paged_logits64(q, cache, weights, ctx, block_table, max_len, page_size, preshuffle) -> torch.Tensor:
    batch, next_n, heads, _ = q.shape
    codes, scales = decode_cache(cache, page_size, preshuffle)
    values = fp8_to_f64(codes, q.dtype)
    q64, w64 = fp8_to_f64(q.view(torch.uint8), q.dtype), weights.double().cpu()
    out = torch.full((batch * next_n, max_len), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        for j in range(next_n):
            visible = min(int(ctx[b]) - next_n + j + 1, max_len)
            if visible <= 0:
                continue
            slots = [slot_of(block_table, b, n, page_size) for n in range(visible)]
            scores = (q64[b, j] @ values[slots].T) * scales[slots]
            out[b * next_n + j, :visible] = (scores.relu() * w64[b * next_n + j, :, None]).sum(0)
    return out


def ragged_logits64(q, k, k_scale, weights, ks, ke) -> torch.Tensor:
    q64 = fp8_to_f64(q.view(torch.uint8), q.dtype)
    k64 = fp8_to_f64(k.view(torch.uint8), k.dtype)
    scores = torch.einsum("thd,nd->thn", q64, k64) * k_scale.double().cpu()
    logits = (scores.relu() * weights.double().cpu()[:, :, None]).sum(1)
    n = torch.arange(k.shape[0])
    inside = (n[None, :] >= ks.cpu().long()[:, None]) & (n[None, :] < ke.cpu().long()[:, None])
    return torch.where(inside, logits, float("-inf"))


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-3) -> None:
    """Identical -inf masks, finite values within ``rtol`` relative (norm-wise) of the float64 model."""
    got = got.cpu().double()
    assert got.shape == want.shape
    assert not got.isnan().any(), "NaN in logits (an element was not written?)"
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf masks differ"
    fin = torch.isfinite(want)
    err = (got[fin] - want[fin]).norm() / want[fin].norm().clamp(min=1e-30)
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


# ---------------------------------------------------------------------------------------------------------------
# random inputs
# ---------------------------------------------------------------------------------------------------------------


def random_fp8(shape, dtype, gen) -> torch.Tensor:
    """Random finite fp8 values (codes drawn uniformly among the finite ones)."""
    table = torch.arange(256, dtype=torch.uint8)
    finite = table[~table.view(dtype).float().isnan()]
    return finite[torch.randint(len(finite), shape, generator=gen)].view(dtype)


def random_cache(num_pages, page_size, dtype, gen) -> torch.Tensor:
    """A cache whose every slot holds finite fp8 values and a positive scale."""
    values = random_fp8((num_pages, page_size * 128), dtype, gen).view(torch.uint8)
    scales = (torch.rand(num_pages, page_size, generator=gen) + 0.05).view(torch.uint8).reshape(num_pages, -1)
    return torch.cat([values, scales], dim=1).contiguous()


def random_block_table(batch, max_pages, num_pages, gen) -> torch.Tensor:
    return torch.randperm(num_pages, generator=gen)[: batch * max_pages].reshape(batch, max_pages).int()


def random_paged_cache(lengths, page_size, dtype, gen, spare_pages=1) -> tuple[torch.Tensor, torch.Tensor]:
    """A random cache and a block table giving each sequence of ``lengths`` its own shuffled pages, with
    ``spare_pages`` pages nobody owns."""
    max_pages = max(1, -(-max(lengths) // page_size))
    num_pages = len(lengths) * max_pages + spare_pages
    return random_cache(num_pages, page_size, dtype, gen), random_block_table(len(lengths), max_pages, num_pages, gen)




def adversarial_k(fmax: float) -> torch.Tensor:
    """Rows that stress the quantizer: amax exactly fmax*2^j, all zeros (floor), ties, -0.0, tiny values."""
    base = torch.linspace(-1, 1, 128)
    rows = [
        base * fmax * 2.0**-3,
        base * fmax * 2.0**5,
        torch.zeros(128),
        torch.full((128,), -0.0),
        torch.full((128,), 3e-5),
        torch.cat([torch.tensor([fmax]), torch.tensor([1.0625, 1.1875, -1.0625, 9.0, 17.0, 0.0, -0.0]),
                   torch.full((120,), 2.0**-8)]),
        torch.cat([torch.tensor([448.0 * 2**-9]), torch.full((127,), 2.0**-18)]),
        base * 1e4,
    ]
    return torch.stack(rows).bfloat16()


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
    slots = torch.tensor([3, 0, 15, 7, -1, 9, 12, 1])
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
# fakes, opcheck, compile
# ---------------------------------------------------------------------------------------------------------------


def _small_inputs():
    gen = torch.Generator().manual_seed(3)
    cache = random_cache(4, 16, FN, gen)
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cu = torch.tensor([0, 5, 20], dtype=torch.int32)
    q = random_fp8((2, 2, 32, 128), FN, gen)
    weights = torch.randn(4, 32, generator=gen)
    ctx = torch.tensor([5, 20], dtype=torch.int32)
    k8, ks8 = random_fp8((9, 128), FN, gen), torch.rand(9, generator=gen) + 0.1
    ks, ke = torch.zeros(6, dtype=torch.int32), torch.arange(1, 7, dtype=torch.int32)
    return {
        "quant_cache_store": (torch.randn(6, 128).bfloat16(), cache, torch.tensor([0, 3, -1, 17, 40, 63]), 16, True,
                              "ue8m0", FN),
        "gather_k": (cache, block_table, cu, 16, True, 24, FN),
        "paged_mqa_logits": (q, cache, weights, ctx, block_table, 40, 16, True),
        "mqa_logits": (random_fp8((6, 16, 128), FN, gen), k8, ks8, torch.randn(6, 16, generator=gen), ks, ke),
        "topk_indices": (torch.randn(4, 30, generator=gen), 7, torch.tensor([30, 3, 0, 12], dtype=torch.int32),
                         torch.tensor([0, 1, 2, 3])),
        "head_gate_gemm": (torch.randn(5, 130, generator=gen).bfloat16(), torch.randn(12, 130, generator=gen), 3,
                           False),
    }


@pytest.mark.parametrize(
    "name", ["quant_cache_store", "gather_k", "paged_mqa_logits", "mqa_logits", "topk_indices", "head_gate_gemm"]
)
def test_opcheck(name):
    utils = ("test_schema", "test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    if name in ("paged_mqa_logits", "mqa_logits"):
        utils = utils[1:]  # opcheck's schema check runs allclose on the fp8 inputs, which CPU torch cannot do
    torch.library.opcheck(getattr(torch.ops.nsa, name).default, _small_inputs()[name], test_utils=utils)


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    inputs = _small_inputs()
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = {name: tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
                for name, args in inputs.items()}
        assert torch.ops.nsa.quant_cache_store(*fake["quant_cache_store"]) is None
        k, s = torch.ops.nsa.gather_k(*fake["gather_k"])
        assert (k.shape, k.dtype, s.shape, s.dtype) == ((24, 128), FN, (24,), torch.float32)
        out = torch.ops.nsa.paged_mqa_logits(*fake["paged_mqa_logits"])
        assert (out.shape, out.dtype) == ((4, 40), torch.float32)
        out = torch.ops.nsa.mqa_logits(*fake["mqa_logits"])
        assert (out.shape, out.dtype) == ((6, 9), torch.float32)
        out = torch.ops.nsa.topk_indices(*fake["topk_indices"])
        assert (out.shape, out.dtype) == ((4, 7), torch.int32)
        out = torch.ops.nsa.head_gate_gemm(*fake["head_gate_gemm"])
        assert (out.shape, out.dtype) == ((3, 5, 12), torch.float32)


def test_quant_cache_store_is_declared_mutating():
    schema = torch.ops.nsa.quant_cache_store.default._schema
    assert [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write] == ["cache"]
    assert len(schema.returns) == 0


def test_ops_under_torch_compile():
    inputs = _small_inputs()

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
        ("paged_mqa_logits", 0, torch.zeros(2, 2, 32, 128), r"q_fp8 must be float8_e4m3fn or float8_e4m3fnuz"),
        ("paged_mqa_logits", 2, torch.zeros(2, 32), r"weights must be float32 \[B\*next_n=4, H=32\], got .*\[2, 32\]"),
        ("paged_mqa_logits", 3, torch.zeros(2, dtype=torch.int64), r"context_lens must be int32 \[B=2\], got int64"),
        ("paged_mqa_logits", 4, torch.zeros(3, 2, dtype=torch.int32), r"block_table must be int32 \[B=2, max_pages\]"),
        ("mqa_logits", 1, torch.zeros(9, 128, dtype=FNUZ), r"k_fp8 must be float8_e4m3fn \[N, 128\]"),
        ("mqa_logits", 2, torch.zeros(9, 1), r"k_scale must be float32 \[N=9\], got float32 \[9, 1\]"),
        ("mqa_logits", 5, torch.zeros(6, dtype=torch.int64), r"ke must be int32 \[T=6\], got int64 \[6\]"),
        ("topk_indices", 0, torch.zeros(4, 30).bfloat16(), r"logits must be float32 \[R, N\], got bfloat16"),
        ("topk_indices", 1, 31, r"k must be in \[0, N=30\], got 31"),
        ("topk_indices", 2, torch.zeros(3, dtype=torch.int32), r"lengths must be int32 or int64 \[R=4\]"),
        ("topk_indices", 3, torch.zeros(4, 1, dtype=torch.int64), r"offset must be int32 or int64 \[R=4\]"),
        ("head_gate_gemm", 0, torch.zeros(5, 130), r"x must be bfloat16 \[M, K\], got float32 \[5, 130\]"),
        ("head_gate_gemm", 0, torch.zeros(5, 2, 65).bfloat16(), r"x must be bfloat16 \[M, K\], got .*\[5, 2, 65\]"),
        ("head_gate_gemm", 1, torch.zeros(12, 129), r"weight must be .*bfloat16 \[N, K=130\], got .*\[12, 129\]"),
        ("head_gate_gemm", 1, torch.zeros(12, 130).half(), r"weight must be float32 or bfloat16 .* got float16"),
        ("head_gate_gemm", 2, 0, r"splits must be >= 1, got 0"),
    ],
)
def test_validation_errors_name_the_tensor(name, index, value, message):
    args = _replace(_small_inputs()[name], index, value)
    with pytest.raises(ValueError, match=message):
        getattr(torch.ops.nsa, name)(*args)


def test_preshuffle_needs_page_multiple_of_16():
    args = _replace(_small_inputs()["quant_cache_store"], 3, 8)
    args = _replace(args, 1, torch.zeros(8, 8 * 132, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 16"):
        torch.ops.nsa.quant_cache_store(*args)


# ---------------------------------------------------------------------------------------------------------------
# top-k
# ---------------------------------------------------------------------------------------------------------------


def eager_topk_rows(logits, k, lengths=None, offset=None) -> list[list[int]]:
    """What the indexer computes eagerly, found by sorting each row in Python (columns past ``lengths`` count as
    -inf; finite values must be distinct): the k largest columns minus the offset, -1 for -inf ones, sorted."""
    rows = []
    for r, row in enumerate(logits.tolist()):
        visible = len(row) if lengths is None else max(0, min(int(lengths[r]), len(row)))
        ranked = sorted(((v if c < visible else -math.inf, c) for c, v in enumerate(row)), key=lambda vc: -vc[0])
        shift = 0 if offset is None else int(offset[r])
        rows.append(sorted(-1 if v == -math.inf else c - shift for v, c in ranked[:k]))
    return rows


def topk_logits(rows, cols, neg_inf_fraction, seed) -> torch.Tensor:
    """Distinct values (no ties at the k-th value), some -inf."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randperm(rows * cols, generator=gen).float().view(rows, cols) / 7 - rows * cols / 14
    return logits.masked_fill(torch.rand(rows, cols, generator=gen) < neg_inf_fraction, float("-inf"))


def topk_case(rows, cols, k_frac, inf, with_lengths, with_offset, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, cols + 3, (rows,), generator=gen).int() if with_lengths else None
    offset = torch.randint(0, 5, (rows,), generator=gen) if with_offset else None
    return topk_logits(rows, cols, inf, seed), round(k_frac * cols), lengths, offset


TOPK_CASES = dict(rows=st.integers(1, 5), cols=st.integers(1, 80), k_frac=st.floats(0, 1),
                  inf=st.sampled_from([0, 0.3, 1.0]), with_lengths=st.booleans(), with_offset=st.booleans(),
                  seed=st.integers(0, 99))


@HYP
@given(**TOPK_CASES)
def test_topk_indices_reference_is_eager_topk_as_sets(rows, cols, k_frac, inf, with_lengths, with_offset, seed):
    logits, k, lengths, offset = topk_case(rows, cols, k_frac, inf, with_lengths, with_offset, seed)
    got = torch.ops.nsa.topk_indices(logits, k, lengths, offset)
    assert got.dtype == torch.int32 and got.shape == (rows, k)
    assert [sorted(r) for r in got.tolist()] == eager_topk_rows(logits, k, lengths, offset)


# ---------------------------------------------------------------------------------------------------------------
# head-gate GEMM
# ---------------------------------------------------------------------------------------------------------------


def bf16_bits64(v: torch.Tensor, rounding) -> torch.Tensor:
    """float64 ``v`` cut to bf16's 8 significant bits by ``rounding`` (``torch.trunc``, or ``torch.round``: ties to
    even) of the mantissa scaled to [128, 256)."""
    mantissa, exponent = torch.frexp(v)
    return torch.ldexp(rounding(mantissa * 256), exponent - 8)


def head_gate_weight64(weight: torch.Tensor, round_weight: bool) -> torch.Tensor:
    """The weight the op multiplies by, in float64: bf16 as is; fp32 rounded to bf16, or ``hi`` (truncated to bf16)
    plus ``lo`` (the rest, rounded to bf16)."""
    w = weight.double().cpu()
    if weight.dtype == torch.bfloat16:
        return w
    if round_weight:
        return bf16_bits64(w, torch.round)
    hi = bf16_bits64(w, torch.trunc)
    return hi + bf16_bits64(w - hi, torch.round)


def head_gate_partials64(x, weight, splits, round_weight) -> torch.Tensor:
    """``[splits, M, N]`` float64: chunks of ``ceil(ceil(K / splits) / 64) * 64`` columns, the last ones short/empty."""
    k = x.shape[1]
    chunk = math.ceil(math.ceil(k / splits) / 64) * 64
    x64, w64 = x.double().cpu(), head_gate_weight64(weight, round_weight)
    return torch.stack([x64[:, s * chunk:(s + 1) * chunk] @ w64[:, s * chunk:(s + 1) * chunk].T for s in range(splits)])


def tie_weights(rows: int, k: int, gen) -> torch.Tensor:
    """fp32 weights whose bf16 roundings are ties or carries: low 16 bits 0x8000 (a tie when rounding W),
    0x7FFF / 0x8001 (just off it), 0xFFFF (rounding carries into the exponent), 0x0080 / 0x0180 (``W - hi`` is a
    tie for ``lo``), random; random signs and exponents, zeros and -0.0."""
    high = torch.randint(0x3A00, 0x4300, (rows, k), generator=gen, dtype=torch.int32) << 16
    signs = torch.randint(0, 2, (rows, k), generator=gen, dtype=torch.int32) << 31
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0xFFFF, 0x0080, 0x0180], dtype=torch.int32)
    low = torch.cat([low, torch.randint(0, 0x10000, (64,), generator=gen, dtype=torch.int32)])
    w = (high | signs | low[torch.randint(len(low), (rows, k), generator=gen)]).view(torch.float32)
    w[0, :2] = torch.tensor([0.0, -0.0])
    return w


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    """Every row of every partial within ``rtol`` of the expected row's norm (an empty chunk's row: exactly 0)."""
    got, want = got.cpu().double(), want.cpu().double()
    assert got.shape == want.shape
    assert not got.isnan().any(), "NaN in the partials (an element was not written?)"
    err, scale = (got - want).norm(dim=-1), want.norm(dim=-1)
    bad = (err > rtol * scale).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} rows off, first (split, row) {bad[0].tolist()}"


WEIGHT_MODES = {"split": (torch.float32, False), "round": (torch.float32, True), "bf16": (torch.bfloat16, False)}


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


def test_head_gate_gemm_round_weight_needs_fp32_weight():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, weight, weight32 = torch.zeros(2, 64).bfloat16(), torch.zeros(3, 64).bfloat16(), torch.zeros(3, 64)
    with pytest.raises(ValueError, match=r"round_weight needs a float32 weight .* got bfloat16 \[3, 64\]"):
        torch.ops.nsa.head_gate_gemm(x, weight, 1, True)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=r"splits must be >= 1, got 0"):
        torch.ops.nsa.head_gate_gemm(mode.from_tensor(x), mode.from_tensor(weight32), 0, False)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=r"round_weight needs a float32 weight"):
        torch.ops.nsa.head_gate_gemm(mode.from_tensor(x), mode.from_tensor(weight), 1, True)
