"""store_input_rounding: the K store's bf16 cast of an fp32 tensor moves into the store (``round_k``); near misses
keep the cast. The stores are eager's act_quant + cache write (the quant_cache_store pass makes the op); compiled
equals eager byte for byte (the op's CPU path is the torch reference)."""

import pytest
import torch

from nsa_inductor.layout import KCacheLayout
from nsa_inductor.quant import act_quant
from helpers.pass_helpers import count_ops, pass_entry, pass_graphs, store_pass_graph

FN = torch.float8_e4m3fn
LAYOUT = KCacheLayout(16)


def _store(k, cache, slots):
    values, scale = act_quant(k, 128, "ue8m0", FN)
    LAYOUT.store(cache, slots, values, scale.squeeze(-1))


def rounded_for_the_store(y, cache, slots):
    _store(y.to(torch.bfloat16), cache, slots)


def normed_then_rounded(y, cache, slots):
    _store(torch.nn.functional.layer_norm(y, [128]).to(torch.bfloat16), cache, slots)


def rounded_and_returned(y, cache, slots):
    k = y.to(torch.bfloat16)
    _store(k, cache, slots)
    return k


def half_rounded(y, cache, slots):
    _store(y.to(torch.float16), cache, slots)


def bf16_input(y, cache, slots):
    _store(y, cache, slots)


def inputs(tokens: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(tokens)
    y = (torch.randn(tokens, 128, generator=gen) * 3).to(dtype)
    cache = torch.randint(0, 256, (6, LAYOUT.page_bytes), dtype=torch.uint8, generator=gen)
    return y, cache, torch.randperm(96, generator=gen)[:tokens]


def run(fn, tokens, dtype=torch.float32):
    return store_pass_graph(fn, *inputs(tokens, dtype))


@pytest.mark.parametrize("tokens", [5, 1])
@pytest.mark.parametrize("fn", [rounded_for_the_store, normed_then_rounded])
def test_the_cast_moves_into_the_store(fn, tokens):
    graph = run(fn, tokens)
    assert pass_entry(graph, "store_input_rounding")["matched"] == 1
    before, after = pass_graphs(graph, "store_input_rounding")
    assert count_ops(before, "prims.convert_element_type") == count_ops(after, "prims.convert_element_type") + 1
    assert "round_k = True" in after


@pytest.mark.parametrize("fn, dtype, reason", [
    (rounded_and_returned, torch.float32, "also read by"),
    (half_rounded, torch.float32, "not a bf16 cast"),
    (bf16_input, torch.bfloat16, "not a bf16 cast"),
    (rounded_for_the_store, torch.float64, "cast from torch.float64"),  # rounding through fp32 may differ
])
def test_near_misses_keep_the_cast(fn, dtype, reason):
    graph = run(fn, 4, dtype)
    entry = pass_entry(graph, "store_input_rounding")
    assert entry["matched"] == 0 and len(entry["near_misses"]) == 1, entry
    assert reason in entry["near_misses"][0]["reason"]
