"""layer_norm_prologue: the LayerNorm of the rows the K store rounds moves into the store (``ln_weight``,
``ln_bias``, ``ln_eps``); near misses keep ATen's LayerNorm. The stores are eager's LayerNorm, bf16 cast, act_quant
and cache write; compiled equals eager byte for byte (the op's CPU path is the torch reference)."""

import pytest
import torch

from nsa_inductor.layout import KCacheLayout
from nsa_inductor.quant import act_quant
from helpers.pass_helpers import count_ops, pass_entry, pass_graphs, store_pass_graph

FN = torch.float8_e4m3fn
LAYOUT = KCacheLayout(16)
GEN = torch.Generator().manual_seed(5)
WEIGHT = 1 + 0.1 * torch.randn(128, generator=GEN)
BIAS = 0.1 * torch.randn(128, generator=GEN)


def _store(k, cache, slots):
    values, scale = act_quant(k.to(torch.bfloat16), 128, "ue8m0", FN)
    LAYOUT.store(cache, slots, values, scale.squeeze(-1))


def normed(y, cache, slots):
    _store(torch.nn.functional.layer_norm(y, [128], WEIGHT, BIAS, 1e-6), cache, slots)


def normed_without_affine(y, cache, slots):
    _store(torch.nn.functional.layer_norm(y, [128]), cache, slots)


def normed_with_bias_only(y, cache, slots):
    _store(torch.nn.functional.layer_norm(y, [128], None, BIAS, 1e-6), cache, slots)


def normed_over_halves(y, cache, slots):
    _store(torch.nn.functional.layer_norm(y.view(-1, 2, 64), [64], WEIGHT[:64], BIAS[:64]).view(-1, 128), cache,
           slots)


def normed_over_all_rows(y, cache, slots):
    _store(torch.nn.functional.layer_norm(y, list(y.shape)), cache, slots)


def normed_and_returned(y, cache, slots):
    k = torch.nn.functional.layer_norm(y, [128], WEIGHT, BIAS, 1e-6)
    _store(k, cache, slots)
    return k


def inputs(tokens: int):
    gen = torch.Generator().manual_seed(tokens)
    y = torch.randn(tokens, 128, generator=gen) * 3 + 1
    cache = torch.randint(0, 256, (6, LAYOUT.page_bytes), dtype=torch.uint8, generator=gen)
    return y, cache, torch.randperm(96, generator=gen)[:tokens]


def run(fn, tokens):
    return store_pass_graph(fn, *inputs(tokens))


@pytest.mark.parametrize("tokens", [5, 1])
def test_the_layer_norm_moves_into_the_store(tokens):
    graph = run(normed, tokens)
    assert pass_entry(graph, "layer_norm_prologue")["matched"] == 1
    before, after = pass_graphs(graph, "layer_norm_prologue")
    assert count_ops(before, "aten.native_layer_norm") == 1 and count_ops(after, "aten.native_layer_norm") == 0
    assert "ln_eps = 1e-06" in after


@pytest.mark.parametrize("fn, reason", [
    (normed_without_affine, "no weight or no bias"),
    (normed_with_bias_only, "no weight or no bias"),
    (normed_over_halves, "is not a LayerNorm's output"),
    (normed_over_all_rows, "normalises [4, 128]"),
    (normed_and_returned, "also read by"),
])
def test_near_misses_keep_the_layer_norm(fn, reason):
    graph = run(fn, 4)
    entry = pass_entry(graph, "layer_norm_prologue")
    assert entry["matched"] == 0 and len(entry["near_misses"]) == 1, entry
    assert reason in entry["near_misses"][0]["reason"]
