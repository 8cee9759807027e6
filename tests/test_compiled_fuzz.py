"""Whole compiled decode steps against eager under hypothesis (docs/indices.md), on the one shared compiled model
with fixed shapes (no recompiles): context lengths (0, page edges, full table), padding, shared slots, slots past
the cache, negative page ids (Python wrap-around). Cache bytes, logits and top-k sets as eager's, and no byte
outside the slots the step writes changes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nsa_inductor.workload import Batch, decode_batch
from helpers.models import CACHE_SLOTS, CONFIGS, LAYOUTS, compiled
from helpers.pass_helpers import assert_matches_eager

LAYOUT = LAYOUTS["paged"]
NUM_SLOTS = CACHE_SLOTS


def _written(slots: torch.Tensor) -> torch.Tensor:
    """Slots the store writes: in the cache, each once."""
    return torch.tensor(sorted({int(s) for s in slots if 0 <= s < NUM_SLOTS}), dtype=torch.long)


@settings(max_examples=8)
@given(lens=st.lists(st.sampled_from([0, 1, 15, 16, 17, 33, 48]), min_size=4, max_size=4),
       slot_edit=st.sampled_from(["none", "shared", "padding", "past-cache"]), wrap=st.booleans(),
       seed=st.integers(0, 999))
def test_decode_step_matches_eager(lens, slot_edit, wrap, seed):
    eager_fn, compiled_fn, _ = compiled("deepseek_v32", "paged", "decode")  # B=4, next_n=1, max_len=48 as here
    batch = decode_batch(CONFIGS["deepseek_v32"], LAYOUT, lens, next_n=1, max_len=48, seed=seed,
                         cache_pages=NUM_SLOTS // LAYOUT.page_size)
    args = list(batch.args)
    slots = args[3].clone()
    if slot_edit == "shared":
        slots[1:] = torch.where(slots[1:] >= 0, slots[0], slots[1:])
    elif slot_edit == "padding":
        slots[::2] = -1
    elif slot_edit == "past-cache":
        slots[-1] = NUM_SLOTS + seed
    args[3] = slots
    if wrap:
        args[5] = args[5] - args[4].shape[0]  # every page id p as p - num_pages: eager reads the same pages
    batch = Batch(*args)
    assert_matches_eager(eager_fn, compiled_fn, batch)
    after = batch.clone()
    with torch.no_grad():
        compiled_fn(*after.args)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[_written(slots)] = False
    every = torch.arange(NUM_SLOTS)[untouched]
    for before, now in zip(LAYOUT.load(batch.kv_cache, every, torch.float8_e4m3fn),
                           LAYOUT.load(after.kv_cache, every, torch.float8_e4m3fn)):
        assert torch.equal(before.view(torch.uint8), now.view(torch.uint8)), "a slot the step does not write changed"
