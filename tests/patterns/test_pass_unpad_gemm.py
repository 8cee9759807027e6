"""unpad_gemm: a GEMM as Inductor's pad_mm leaves it (operands padded with zeros, the product cut back) becomes the
GEMM of the unpadded operands; near misses (other padding, reads of the padded part) keep it."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings, strategies as st

from nsa_inductor.patterns.unpad_gemm import UnpadGemm, padded, replacement
from helpers.pass_helpers import run_pass


def pads(gm) -> int:
    return sum(n.target is torch.ops.aten.constant_pad_nd.default for n in gm.graph.nodes)


def operands(m, k, n, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k, n, pad_m, pad_k, pad_n", [
    (6, 128, 64, 2, 0, 0),    # rows (tokens), as pad_mm pads the indexer's GEMMs
    (1, 128, 64, 7, 0, 0),    # one token
    (5, 30, 64, 0, 2, 0),     # K
    (5, 128, 30, 0, 0, 2),    # columns
    (5, 30, 7, 3, 2, 1),      # all three
])
def test_padded_gemm_becomes_the_written_one(m, k, n, pad_m, pad_k, pad_n, dtype):
    """Every padding gone, and the result is the unpadded GEMM's, bit for bit."""
    a, b = operands(m, k, n, dtype)
    result, _, after, removed = run_pass(UnpadGemm(), pads, lambda a, b: padded(a, b, pad_m, pad_k, pad_n), a, b)
    assert result.matched == 1 and not result.near_misses, result
    assert removed == 2 and after.shape == (m, n)  # both operands' pads (``padded`` pads each, maybe by 0)
    assert torch.equal(after, replacement(a, b))


@settings(deadline=None, max_examples=25)
@given(batch=st.sampled_from([None, 1, 3]), m=st.integers(1, 9), k=st.integers(1, 40), n=st.integers(1, 9),
       pad_m=st.integers(0, 7), pad_k=st.integers(0, 7), pad_n=st.integers(0, 7),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_any_zero_padding_cut_back_is_undone(batch, m, k, n, pad_m, pad_k, pad_n, dtype):
    """Sizes from 1, any padding of rows, K and columns (none too), ``mm`` or ``bmm``: the result is the unpadded
    GEMM's, bit for bit, and no pad is left. (Padded GEMMs that Inductor's decompositions turn into pointwise
    products, K = 1 or a 1 x 1 result, are no GEMMs left to undo: not drawn.)"""
    assume(k + pad_k > 1 and (m + pad_m > 1 or n + pad_n > 1))
    gen = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    lead = () if batch is None else (batch,)
    a, b = torch.randn(*lead, m, k, generator=gen).to(dtype), torch.randn(*lead, k, n, generator=gen).to(dtype)
    gemm = torch.mm if batch is None else torch.bmm

    def fn(a, b):
        product = gemm(F.pad(a, (0, pad_k, 0, pad_m)), F.pad(b, (0, pad_n, 0, pad_k)))
        return product[..., : product.shape[-2] - pad_m, : product.shape[-1] - pad_n]

    result, _, after, removed = run_pass(UnpadGemm(), pads, fn, a, b)
    assert result.matched == 1 and not result.near_misses and removed == 2, result
    assert torch.equal(after, gemm(a, b))


def test_slices_that_keep_a_dimension_whole_are_seen_through():
    """``res[:-m, :]`` then ``res[:, :-n]`` may leave slices of a whole dimension between the cuts."""
    a, b = operands(6, 128, 30)

    def fn(a, b):
        product = torch.mm(F.pad(a, (0, 0, 0, 2)), F.pad(b, (0, 2)))
        return torch.ops.aten.slice(torch.ops.aten.slice(torch.ops.aten.slice(product, 1, 0, 32), 0, 0, 6), 1, 0, 30)

    result, _, after, removed = run_pass(UnpadGemm(), pads, fn, a, b)
    assert result.matched == 1 and removed == 2
    assert torch.equal(after, replacement(a, b))


def test_batched_product_padded_along_columns():
    """``bmm`` with the second operand's columns padded (the prefill logits' einsum over tokens)."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 4, 16, generator=gen), torch.randn(3, 16, 30, generator=gen)

    def fn(a, b):
        return torch.bmm(a, F.pad(b, (0, 2)))[:, :, :30]

    result, _, after, removed = run_pass(UnpadGemm(), pads, fn, a, b)
    assert result.matched == 1 and removed == 1
    assert torch.equal(after, torch.bmm(a, b))


def _read_past_the_rows(a, b):
    return torch.mm(F.pad(a, (0, 0, 0, 2)), b)[: a.shape[0] + 1]


def _slice_not_from_zero(a, b):
    return torch.mm(F.pad(a, (0, 0, 0, 2)), b)[1: a.shape[0] + 1]


def _padded_product_read_whole(a, b):
    product = torch.mm(F.pad(a, (0, 0, 0, 2)), b)
    return product[: a.shape[0]], product.sum()


def _padded_with_ones(a, b):
    return torch.mm(F.pad(a, (0, 0, 0, 2), value=1.0), b)[: a.shape[0]]


def _padded_on_the_left(a, b):
    return torch.mm(F.pad(a, (0, 0, 2, 0)), b)[2:]


def _k_padded_on_one_side(a, b):
    """``a``'s K padded up to ``b``'s rows (its rows too, cut back): the zero columns multiply ``b``'s last rows, which
    unpadding would drop."""
    return torch.mm(F.pad(a[:, :-2], (0, 2, 0, 2)), b)[: a.shape[0]]


def _columns_padded_on_the_left(a, b):
    return torch.mm(a, F.pad(b, (2, 0)))[:, : b.shape[1]]


def _negative_padding(a, b):
    """K cut by 3 on both sides (a negative pad is a slice): not zero terms added."""
    return torch.mm(F.pad(a, (0, -3)), F.pad(b, (0, 0, 0, -3)))[: a.shape[0]]


def _every_second_row(a, b):
    """As many rows as the unpadded product, but every second one of the padded product."""
    return torch.mm(F.pad(a, (0, 0, 0, a.shape[0])), b)[::2]


NEAR_MISSES = {
    "columns-padded-on-the-left": (_columns_padded_on_the_left, "not zeros on the right of the last two dimensions"),
    "negative-padding": (_negative_padding, "not zeros on the right of the last two dimensions"),
    "every-second-row": (_every_second_row, "to other than its unpadded rows and columns"),
    "read-past-the-rows": (_read_past_the_rows, "to other than its unpadded rows and columns"),
    "slice-not-from-zero": (_slice_not_from_zero, "to other than its unpadded rows and columns"),
    "padded-product-read-whole": (_padded_product_read_whole, "not only through slices back to [6, 64]"),
    "padded-with-ones": (_padded_with_ones, "not zeros on the right of the last two dimensions"),
    "padded-on-the-left": (_padded_on_the_left, "not zeros on the right of the last two dimensions"),
    "k-padded-on-one-side": (_k_padded_on_one_side, "padded along K by 2 and 0"),
}


@pytest.mark.parametrize("case", sorted(NEAR_MISSES))
def test_near_misses_keep_the_padding(case):
    fn, reason = NEAR_MISSES[case]
    a, b = operands(6, 128, 64)
    result, before, after, removed = run_pass(UnpadGemm(), pads, fn, a, b)
    assert result.matched == 0 and removed == 0
    assert any(reason in m["reason"] for m in result.near_misses), result.near_misses
    for got, want in zip(after if isinstance(after, tuple) else (after,),
                         before if isinstance(before, tuple) else (before,)):
        assert torch.equal(got, want)


def test_a_product_the_model_padded_itself_is_left_alone_unreported():
    """Rows padded and kept (no slice cuts them back): not ``pad_mm``'s form, so no near miss either."""
    a, b = operands(6, 128, 64)
    result, before, after, removed = run_pass(UnpadGemm(), pads, lambda a, b: torch.mm(F.pad(a, (0, 0, 0, 2)), b), a, b)
    assert result.matched == 0 and not result.near_misses and removed == 0
    assert torch.equal(after, before) and after.shape == (8, 64)


def test_a_gemm_without_padding_is_left_alone():
    a, b = operands(6, 128, 64)
    result, _, _, _ = run_pass(UnpadGemm(), pads, replacement, a, b)
    assert result.matched == 0 and not result.near_misses
