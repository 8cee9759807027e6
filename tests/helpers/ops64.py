"""Helpers for the ``nsa`` op tests: an independent float64 model of the ops, random inputs, small inputs per op.

The model decodes cache bytes with DESIGN §3's view/permute description (not the project's offset formula),
quantizes in float64 and rounds to fp8 by searching the fp8 value table.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
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


def slot_gather64(cache, positions, page_size, preshuffle, block_table=None, seq_ids=None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``nsa.gather_k_slots`` modelled with Python lists: ``(value bytes uint8 [N, 128], scales float64 [N])``, each
    id indexed as Python indexes a list (negative ids wrap), a row whose lookup raises IndexError zero."""
    codes, scales = decode_cache(cache, page_size, preshuffle)
    slots, pages = list(range(codes.shape[0])), list(range(cache.shape[0]))
    rows = block_table.tolist() if block_table is not None else None
    out_codes, out_scales = torch.zeros(len(positions), 128, dtype=torch.uint8), torch.zeros(len(positions),
                                                                                             dtype=torch.float64)
    for n, pos in enumerate(positions.tolist()):
        try:
            if rows is None:
                slot = slots[pos]
            else:
                slot = pages[rows[int(seq_ids[n])][pos // page_size]] * page_size + pos % page_size
        except IndexError:
            continue
        out_codes[n], out_scales[n] = codes[slot], scales[slot]
    return out_codes, out_scales


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
    """Rows that stress the quantizer: amax exactly fmax*2^j, all zeros (floor), ties, -0.0, tiny values, values
    whose quotients by the scale are fp32 subnormals."""
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
        # a large amax beside bf16 values near fp32's smallest normals: their quotients by the scale are subnormal
        torch.cat([torch.tensor([1e4]),
                   torch.tensor([1e-38, -1e-38, 2e-39, -2e-39, 9.2e-41, -9.2e-41]).repeat(22)[:127]]),
    ]
    return torch.stack(rows).bfloat16()


def small_inputs() -> dict[str, tuple]:
    """Tiny valid arguments of each op, by op name (CPU)."""
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
        "batched_mqa_logits": (torch.randn(2, 3, 4, 64, generator=gen).bfloat16(),
                               torch.randn(2, 5, 64, generator=gen).bfloat16(), torch.randn(2, 3, 4, generator=gen),
                               0.125, None, torch.rand(2, 3, 5, generator=gen) < 0.5),
        "quant_cache_store": (torch.randn(6, 128).bfloat16(), cache, torch.tensor([0, 3, -1, 17, 40, 63]), 16, True,
                              "ue8m0", FN),
        "gather_k": (cache, block_table, cu, 16, True, 24, FN),
        "gather_k_slots": (cache, torch.tensor([5, 0, -1, 21, 6]), 16, True, FN, block_table,
                           torch.tensor([0, 1, 1, 0, -2], dtype=torch.int32)),
        "paged_mqa_logits": (q, cache, weights, ctx, block_table, 40, 16, True),
        "mqa_logits": (random_fp8((6, 16, 128), FN, gen), k8, ks8, torch.randn(6, 16, generator=gen), ks, ke),
        "topk_indices": (torch.randn(4, 30, generator=gen), 7, torch.tensor([30, 3, 0, 12], dtype=torch.int32),
                         torch.tensor([0, 1, 2, 3])),
        "head_gate_gemm": (torch.randn(5, 130, generator=gen).bfloat16(), torch.randn(12, 130, generator=gen), 3,
                           False),
        "rotate_act_quant": (torch.randn(2, 3, 128, generator=gen).bfloat16(), torch.randn(128, 128, generator=gen),
                             128**-0.5, False, 64, "ue8m0", FN, 448.0),
        "wk_gate_gemm": (torch.randn(5, 130, generator=gen).bfloat16(), torch.randn(12, 130, generator=gen),
                         torch.randn(20, 130, generator=gen).bfloat16(), 3, 2, False),
    }


def integer_rows(rows: int, gen) -> torch.Tensor:
    """bf16 rows of small integers times a power of two per row: every sum of 128 of them with +-1 signs is exact
    in fp32, so a Hadamard rotation gives eager's bits in any summation order."""
    ints = torch.randint(-16, 17, (rows, 128), generator=gen).float()
    return (ints * torch.exp2(torch.randint(-12, 6, (rows, 1), generator=gen).float())).bfloat16()


def assert_fp8_close(got: tuple, want: tuple, values_frac: float, scales_frac: float,
                     error_below_one: float | None = None) -> None:
    """``(fp8 values [..., G * block], scales [..., G] or [...])`` pairs within the contract of a reordered rotation
    (docs/numerics.md): at most ``scales_frac`` of the groups change scale (the rounded amax crossed a power of two,
    or moved, with fp32 scales); in the other groups at most ``values_frac`` of the values differ, by one fp8 step;
    with ``error_below_one``, values below 1 in units of their scale (where the grid's steps shrink towards
    subnormals) by one step or by at most that many scale units."""
    from nsa_inductor.quant import fp8_ulps

    (values, scales), (want_values, want_scales) = ((v.cpu(), s.cpu()) for v, s in (got, want))
    assert values.shape == want_values.shape and scales.shape == want_scales.shape
    if scales.dim() < values.dim():
        scales, want_scales = scales.unsqueeze(-1), want_scales.unsqueeze(-1)
    same_scale = scales == want_scales
    assert (~same_scale).double().mean() <= scales_frac, f"{int((~same_scale).sum())} of {scales.numel()} scales differ"
    kept = same_scale.repeat_interleave(values.shape[-1] // scales.shape[-1], -1)
    ulps = fp8_ulps(values, want_values)[kept]
    assert (ulps > 0).double().mean() <= values_frac, f"{int((ulps > 0).sum())} of {ulps.numel()} fp8 values differ"
    if error_below_one is not None:
        a, b = values.float()[kept], want_values.float()[kept]
        near = (a.abs() < 1) & (b.abs() < 1) & ((a - b).abs() <= error_below_one)
        ulps = ulps[~near]
    assert ulps.numel() == 0 or int(ulps.max()) <= 1, f"an fp8 value is {int(ulps.max())} steps off"


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


def assert_topk_valid(logits, got, k, lengths=None, offset=None, pad="neg1", sorted_=False) -> None:
    """The op contract checked row by row from the definition, not from any implementation: distinct in-range
    columns; every selected value >= every unselected one of the row's valid columns (NaN ranks highest, as in
    torch.topk); -inf entries -1 (pad "neg1") or -inf columns (pad "column"); descending values when sorted."""
    def rank(v):
        return math.inf if v != v else v

    assert got.dtype == torch.int32 and tuple(got.shape) == (logits.shape[0], k)
    for r, row in enumerate(logits.tolist()):
        n = len(row)
        visible = n if lengths is None else max(0, min(int(lengths[r]), n))
        value = [rank(v) if c < visible else -math.inf for c, v in enumerate(row)]
        shift = 0 if offset is None else int(offset[r])
        entries = got[r].tolist()
        cols = [e + shift for e in entries if not (pad == "neg1" and e == -1)]
        assert len(set(cols)) == len(cols) and all(0 <= c < n for c in cols), (r, entries)
        finite = sum(v != -math.inf for v in value)
        if pad == "neg1":
            assert len(cols) == min(k, finite), (r, entries)
            assert all(value[c] != -math.inf for c in cols)
        else:
            assert len(cols) == k
        chosen = set(cols)
        picked = [value[c] for c in cols]
        rest = [v for c, v in enumerate(value) if c not in chosen]
        if picked and rest:
            assert min(picked) >= max(rest), (r, min(picked), max(rest))
        if sorted_:
            ordered = [value[c] for c in cols]
            assert ordered == sorted(ordered, reverse=True), (r, ordered[:8])
            if pad == "neg1":  # the -1 entries (-inf values, missing columns) come last
                tail = entries[len(cols):]
                assert all(e == -1 for e in tail), (r, entries)


def adversarial_topk_logits(rows, cols, kind, seed) -> torch.Tensor:
    """Rows that stress a select: long runs of ties, all equal, values equal in their top bits but not in the
    low ones, -inf tails, NaN of either sign."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "ties":
        logits = torch.randint(0, 4, (rows, cols), generator=gen).float()
    elif kind == "equal":
        logits = torch.full((rows, cols), 0.5)
    elif kind == "close":  # one exponent, differing only in the last mantissa bits
        logits = (torch.randint(0, 8, (rows, cols), generator=gen) + 0x3F800000).view(torch.float32)
    elif kind == "nan":
        logits = torch.randn(rows, cols, generator=gen)
        logits[:, ::5] = float("nan")
        logits[:, 1::7] = -float("nan")
    else:
        logits = torch.randn(rows, cols, generator=gen)
    tail = torch.randint(0, cols + 1, (rows,), generator=gen)
    return logits.masked_fill(torch.arange(cols)[None, :] >= tail[:, None], float("-inf")) if kind == "tail" \
        else logits


TOPK_CASES = dict(rows=st.integers(1, 5), cols=st.integers(1, 80), k_frac=st.floats(0, 1),
                  inf=st.sampled_from([0, 0.3, 1.0]), with_lengths=st.booleans(), with_offset=st.booleans(),
                  seed=st.integers(0, 99))

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
