"""gather_k_slots pass: the K operands of ``nsa.mqa_logits`` read from the cache through maps given as inputs (by
slot, or by sequence and position through the block table; page views or byte offsets) become one
``nsa.gather_k_slots``, with the same result, the facts taken as given in the report; look-alikes whose offsets do
not follow the layout stay as they are, with the reason. Runs the pass on functional graphs (no Inductor compile)."""

from __future__ import annotations

import pytest
import torch

import nsa_inductor  # noqa: F401  (registers torch.ops.nsa)
from nsa_inductor.capability import LayoutDecision
from nsa_inductor.layout import KCacheLayout
from nsa_inductor.patterns.base import PassContext
from nsa_inductor.patterns.mqa.slot_gather import GatherKSlots
from helpers.ops64 import FN, random_cache, random_fp8
from helpers.pass_helpers import run_pass

P = 16
TOKENS, HEADS = 5, 16


def count_index(gm) -> int:
    return sum(n.target is torch.ops.aten.index.Tensor for n in gm.graph.nodes)


def gather_k_slots_pass(layout: KCacheLayout):
    """The pass with the compile-time layout ``layout`` (only the decision is read)."""
    ctx = PassContext(None, LayoutDecision(layout, "test"), None)
    return lambda graph, _: GatherKSlots()(graph, ctx)


def page_views(cache):
    return cache[:, : P * 128].unflatten(1, (P, 128)), cache[:, P * 128:].view(torch.float32)


def logits(k8, k_scale, q, w, ks, ke):
    return torch.ops.nsa.mqa_logits(q, k8, k_scale, w, ks, ke)


# the model's gathers (args: q, w, ks, ke, cache, then the maps) -------------------------------------------------


def engine_page_views(q, w, ks, ke, cache, block_table, seq_ids, positions):
    """tests/helpers/engine_indexer.py's spelling."""
    values, scales = page_views(cache)
    page = block_table[seq_ids, positions // P].long()
    return logits(values[page, positions % P].view(FN), scales[page, positions % P], q, w, ks, ke)


def sequence_byte_offsets(layout):
    def fn(q, w, ks, ke, cache, block_table, seq_ids, positions):
        slots = block_table[seq_ids, positions // P].long() * P + positions % P
        return logits(*layout.load(cache, slots, FN), q, w, ks, ke)
    return fn


def slot_byte_offsets(layout, shift=0):
    """vLLM/SGLang: one slot per token; ``shift`` makes a read that does not follow the slot."""
    def fn(q, w, ks, ke, cache, slots):
        return logits(*layout.load(cache, slots + shift, FN), q, w, ks, ke)
    return fn


def scale_read_elsewhere(how):
    """K read at the slot's offsets; k_scale (``how``) from ``cache2`` (a second input of the same shape), at the
    next slot's scale, or from the slot's scale bytes in the order 0, 2, 1, 3: the op reads the slot's own scale."""
    layout = KCacheLayout(P)

    def fn(q, w, ks, ke, cache, slots, cache2):
        k8, k_scale = layout.load(cache, slots, FN)
        if how == "second_cache":
            k_scale = layout.load(cache2, slots, FN)[1]
        elif how == "next_slot":
            k_scale = layout.load(cache, slots + 1, FN)[1]
        else:
            j = torch.arange(4)
            byte = layout.scale_offsets(slots)[:, :1] + torch.where((j == 1) | (j == 2), 3 - j, j)
            k_scale = cache.view(-1)[byte].contiguous().view(torch.float32).squeeze(-1)
        return logits(k8, k_scale, q, w, ks, ke)
    return fn


def slot_page_views(q, w, ks, ke, cache, slots):
    values, scales = page_views(cache)
    return logits(values[slots // P, slots % P].view(FN), scales[slots // P, slots % P], q, w, ks, ke)


def other_page_size(q, w, ks, ke, cache, block_table, seq_ids, positions):
    """The block-table column from 32-token pages, the position in the page from the cache's 16."""
    values, scales = page_views(cache)
    page = block_table[seq_ids, positions // (2 * P)].long()
    return logits(values[page, positions % P].view(FN), scales[page, positions % P], q, w, ks, ke)


def inputs(keys: int, by_sequence: bool, seed: int = 0):
    """``(q, w, ks, ke, cache, maps...)``: ids eager accepts, some negative (they wrap as Python indices)."""
    gen = torch.Generator().manual_seed(seed)
    cache = random_cache(6, P, FN, gen)
    head = (random_fp8((TOKENS, HEADS, 128), FN, gen), torch.randn(TOKENS, HEADS, generator=gen),
            torch.zeros(TOKENS, dtype=torch.int32), torch.randint(0, keys + 1, (TOKENS,), generator=gen).int())
    if not by_sequence:
        return (*head, cache, torch.randint(-6 * P, 6 * P, (keys,), generator=gen))
    table = torch.randperm(6, generator=gen)[:6].view(2, 3).int() - 2
    return (*head, cache, table, torch.randint(-2, 2, (keys,), generator=gen).int(),
            torch.randint(-3 * P, 3 * P, (keys,), generator=gen))


FIRES = {  # name: (function, compile-time layout, by sequence)
    "engine_page_views": (engine_page_views, KCacheLayout(P), True),
    "sequence_byte_offsets_preshuffle": (sequence_byte_offsets(KCacheLayout(P, True)), KCacheLayout(P, True), True),
    "slot_byte_offsets": (slot_byte_offsets(KCacheLayout(P)), KCacheLayout(P), False),
    "slot_page_views_guard_prefers_64": (slot_page_views, KCacheLayout(64), False),
}


@pytest.mark.parametrize("keys", [1, 7])
@pytest.mark.parametrize("name", sorted(FIRES))
def test_fires_on_gathers_through_maps(name, keys):
    fn, layout, by_sequence = FIRES[name]
    args = inputs(keys, by_sequence, seed=keys)
    result, before, after, removed = run_pass(gather_k_slots_pass(layout), count_index, fn, *args)
    assert result.matched == 1, result.near_misses
    assert removed >= 2  # the model's K and k_scale reads (and its page lookup) are gone
    assert torch.equal(before, after)
    (given,) = result.taken_as_given
    form = "position" if by_sequence else "slot"
    assert form in given["facts"][0] and any("data" in fact for fact in given["facts"])


NEAR_MISSES = {  # name: (function, compile-time layout, by sequence, words of the reason)
    "other_page_size": (other_page_size, KCacheLayout(P), True, "offsets"),
    "shifted_slot": (slot_byte_offsets(KCacheLayout(P), shift=1), KCacheLayout(P), False, "offsets"),
    "scale_from_a_second_cache": (scale_read_elsewhere("second_cache"), KCacheLayout(P), False, "one K cache"),
    "scale_of_the_next_slot": (scale_read_elsewhere("next_slot"), KCacheLayout(P), False, "k_scale's bytes"),
    "scale_bytes_out_of_order": (scale_read_elsewhere("bytes_swapped"), KCacheLayout(P), False, "not consecutive"),
    "row_major_read_preshuffle_layout": (slot_byte_offsets(KCacheLayout(P)), KCacheLayout(P, True), False,
                                         "preshuffle"),
}


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_leaves_lookalikes_alone(name):
    fn, layout, by_sequence, words = NEAR_MISSES[name]
    args = inputs(7, by_sequence)
    if name.startswith("scale_"):  # a second cache of the first's shape (only the first holds K)
        args = (*args, random_cache(6, P, FN, torch.Generator().manual_seed(9)))
    result, before, after, removed = run_pass(gather_k_slots_pass(layout), count_index, fn, *args)
    assert result.matched == 0 and removed == 0 and torch.equal(before, after)
    reasons = [m["reason"] for m in result.near_misses]
    assert reasons and all(words in r for r in reasons), reasons
    assert not result.taken_as_given


def test_k_given_as_an_input_is_not_a_candidate():
    """K gathered outside the graph (no cache read): nothing to prove, no near miss."""
    q, w, ks, ke, *_ = inputs(7, False)
    gen = torch.Generator().manual_seed(1)
    k8, k_scale = random_fp8((7, 128), FN, gen), torch.rand(7, generator=gen)
    result, *_, removed = run_pass(gather_k_slots_pass(KCacheLayout(P)), count_index, logits, k8, k_scale, q, w, ks, ke)
    assert result.matched == 0 and not result.near_misses and removed == 0
