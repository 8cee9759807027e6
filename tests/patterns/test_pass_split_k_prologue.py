"""split_k_prologue: the left-to-right sum of split-K partials the K store reads (rounded to bf16, as ``wk_gate_gemm``
leaves the K projection) moves into the store (``k_split_sum``); near misses keep Inductor's sum. The stores are
eager's sum, bf16 cast, LayerNorm, bf16 cast, act_quant and cache write; compiled equals eager byte for byte (the
op's CPU path is the torch reference)."""

import pytest
import torch

from nsa_inductor.layout import KCacheLayout
from nsa_inductor.quant import act_quant
from helpers.pass_helpers import count_ops, pass_entry, pass_graphs, store_pass_graph

FN = torch.float8_e4m3fn
LAYOUT = KCacheLayout(16)
GEN = torch.Generator().manual_seed(6)
WEIGHT = 1 + 0.1 * torch.randn(128, generator=GEN)
BIAS = 0.1 * torch.randn(128, generator=GEN)
PROJECTION = torch.randn(128, 128, generator=GEN).bfloat16()


def _store(k, cache, slots):
    values, scale = act_quant(k.to(torch.bfloat16), 128, "ue8m0", FN)
    LAYOUT.store(cache, slots, values, scale.squeeze(-1))


def _normed(k):
    return torch.nn.functional.layer_norm(k, [128], WEIGHT, BIAS, 1e-6)


def _left_to_right(p):
    total = p[0]
    for s in range(1, p.shape[0]):
        total = total + p[s]
    return total


def summed_then_normed(p, cache, slots):
    _store(_normed(_left_to_right(p).to(torch.bfloat16).float()), cache, slots)


def summed(p, cache, slots):
    _store(_left_to_right(p), cache, slots)


def summed_over_some_splits(p, cache, slots):
    _store(_normed((p[0] + p[1]).to(torch.bfloat16).float()), cache, slots)


def summed_from_two_tensors(p, cache, slots):
    _store(_normed((p[0] + (p * 2)[1] + p[2]).to(torch.bfloat16).float()), cache, slots)


def summed_right_to_left(p, cache, slots):
    _store(_normed((p[0] + (p[1] + p[2])).to(torch.bfloat16).float()), cache, slots)


def summed_by_a_reduction(p, cache, slots):
    _store(_normed(p.sum(0).to(torch.bfloat16).float()), cache, slots)


def projected_by_a_bf16_gemm(p, cache, slots):  # as prefill, where wk_gate_gemm leaves cuBLAS's wk
    _store(_normed((p[0].bfloat16() @ PROJECTION).float()), cache, slots)


def normed_before_rounding(p, cache, slots):
    _store(_normed(_left_to_right(p)), cache, slots)


def summed_and_returned(p, cache, slots):
    total = _left_to_right(p)
    _store(_normed(total.to(torch.bfloat16).float()), cache, slots)
    return total


def inputs(splits: int, tokens: int):
    gen = torch.Generator().manual_seed(10 * splits + tokens)
    p = torch.randn(splits, tokens, 128, generator=gen) * 2 + 0.5
    cache = torch.randint(0, 256, (6, LAYOUT.page_bytes), dtype=torch.uint8, generator=gen)
    return p, cache, torch.randperm(96, generator=gen)[:tokens]


def run(fn, splits, tokens):
    return store_pass_graph(fn, *inputs(splits, tokens))


@pytest.mark.parametrize("fn", [summed_then_normed, summed])
@pytest.mark.parametrize("splits, tokens", [(3, 5), (1, 1), (4, 1)])
def test_the_split_k_sum_moves_into_the_store(fn, splits, tokens):
    graph = run(fn, splits, tokens)
    assert pass_entry(graph, "split_k_prologue")["matched"] == 1
    before, after = pass_graphs(graph, "split_k_prologue")
    assert count_ops(before, "aten.add") == splits - 1 and count_ops(after, "aten.add") == 0
    assert count_ops(after, "aten.select") == 0 and "k_split_sum = True" in after


@pytest.mark.parametrize("fn, reason", [
    (summed_over_some_splits, "adds splits [0, 1] of"),
    (summed_from_two_tensors, "partials of more than one tensor"),
    (summed_right_to_left, "not a split-K partial"),
    (summed_by_a_reduction, "is not a sum of split-K partials"),
    (projected_by_a_bf16_gemm, "is not a sum of split-K partials"),
    (normed_before_rounding, "LayerNorm reads"),
    (summed_and_returned, "also read by"),
])
def test_near_misses_keep_the_sum(fn, reason):
    graph = run(fn, 3, 4)
    entry = pass_entry(graph, "split_k_prologue")
    assert entry["matched"] == 0 and len(entry["near_misses"]) == 1, entry
    assert reason in entry["near_misses"][0]["reason"]
