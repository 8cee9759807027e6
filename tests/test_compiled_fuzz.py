"""Whole compiled decode steps against eager under hypothesis (docs/indices.md), on the one shared compiled model
with fixed shapes (no recompiles): context lengths (0, page edges, full table), padding, shared slots, slots past
the cache, negative page ids (Python wrap-around). Cache bytes, logits and top-k sets as eager's, and no byte
outside the slots the step writes changes. Under ``nsa.checks`` the same step raises exactly on out-of-contract ids."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nsa_inductor.workload import Batch, decode_batch
from helpers.models import CACHE_SLOTS, CONFIGS, LAYOUTS, compile_indexer, compiled
from helpers.pass_helpers import assert_matches_eager

LAYOUT = LAYOUTS["paged"]
NUM_SLOTS = CACHE_SLOTS


def _written(slots: torch.Tensor) -> torch.Tensor:
    """Slots the store writes: in the cache, each once."""
    return torch.tensor(sorted({int(s) for s in slots if 0 <= s < NUM_SLOTS}), dtype=torch.long)


STEPS = dict(lens=st.lists(st.sampled_from([0, 1, 15, 16, 17, 33, 48]), min_size=4, max_size=4),
             slot_edit=st.sampled_from(["none", "shared", "padding", "past-cache"]), wrap=st.booleans(),
             seed=st.integers(0, 999))


def _check_step(eager_fn, compiled_fn, lens, slot_edit, wrap, seed, device="cpu"):
    """One edited decode batch (B=4, next_n=1, max_len=48 as the shared model's): compiled as eager, and no byte
    outside the slots the step writes changed."""
    batch = decode_batch(CONFIGS["deepseek_v32"], LAYOUT, lens, next_n=1, max_len=48, seed=seed,
                         cache_pages=NUM_SLOTS // LAYOUT.page_size, device=device)
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
    assert_matches_eager(eager_fn, compiled_fn, batch, same_topk=device == "cpu")
    after = batch.clone()
    with torch.no_grad():
        compiled_fn(*after.args)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[_written(slots.cpu())] = False
    every = torch.arange(NUM_SLOTS)[untouched]
    for before, now in zip(LAYOUT.load(batch.kv_cache.cpu(), every, torch.float8_e4m3fn),
                           LAYOUT.load(after.kv_cache.cpu(), every, torch.float8_e4m3fn)):
        assert torch.equal(before.view(torch.uint8), now.view(torch.uint8)), "a slot the step does not write changed"


@settings(max_examples=8)
@given(**STEPS)
def test_decode_step_matches_eager(lens, slot_edit, wrap, seed):
    eager_fn, compiled_fn, _ = compiled("deepseek_v32", "paged", "decode")
    _check_step(eager_fn, compiled_fn, lens, slot_edit, wrap, seed)


@functools.cache
def _gpu_decode():
    """The shared model's decode on the GPU (the Triton kernels), compiled once."""
    eager_fn, _, _ = compiled("deepseek_v32", "paged", "decode")
    model = copy.deepcopy(eager_fn.__self__).cuda()
    options = {"nsa.layout": "paged", "nsa.page_size": LAYOUT.page_size}
    return model.decode, compile_indexer(model.decode, options)


@pytest.mark.gpu
@settings(max_examples=200)
@given(**STEPS)
def test_decode_step_matches_eager_on_gpu(lens, slot_edit, wrap, seed):
    """The larger sweep, on the GPU's kernels (cache bytes within the bound of the reordering passes)."""
    _check_step(*_gpu_decode(), lens, slot_edit, wrap, seed, device="cuda")


@functools.cache
def _checked_decode():
    """The shared model's decode compiled again with ``nsa.checks`` (same shapes as above)."""
    eager_fn, _, _ = compiled("deepseek_v32", "paged", "decode")
    options = {"nsa.layout": "paged", "nsa.page_size": LAYOUT.page_size, "nsa.checks": True}
    return eager_fn, compile_indexer(eager_fn, options)


@settings(max_examples=8)
@given(lens=st.lists(st.sampled_from([0, 1, 16, 33, 48]), min_size=4, max_size=4),
       edit=st.sampled_from(["none", "slot-past-cache", "page-past-cache", "page-below-wrap", "unused-page-bad"]),
       seed=st.integers(0, 999))
def test_checked_decode_step_raises_exactly_on_bad_ids(lens, edit, seed):
    """Under ``nsa.checks`` a step raises naming the argument exactly when an id is outside the contract (a page id
    only where a sequence's tokens are); otherwise it equals eager."""
    eager_fn, checked_fn = _checked_decode()
    batch = decode_batch(CONFIGS["deepseek_v32"], LAYOUT, lens, next_n=1, max_len=48, seed=seed,
                         cache_pages=NUM_SLOTS // LAYOUT.page_size)
    args = list(batch.args)
    num_pages = args[4].shape[0]
    table, slots = args[5].clone(), args[3].clone()
    used_pages = (torch.tensor(lens) + LAYOUT.page_size - 1) // LAYOUT.page_size  # pages each sequence's tokens use
    row = int(torch.argmax(used_pages))
    argument = None
    if edit == "slot-past-cache":
        slots[seed % len(lens)] = NUM_SLOTS + seed
        argument = "slot_mapping"
    elif edit in ("page-past-cache", "page-below-wrap") and used_pages[row] > 0:
        table[row, int(used_pages[row]) - 1] = num_pages + seed if edit == "page-past-cache" else -num_pages - 1 - seed
        argument = "block_table"
    args[3], args[5] = slots, table
    batch = Batch(*args)
    if edit == "unused-page-bad" and used_pages.min() < table.shape[1]:
        # Past a sequence's tokens no page is read: a bad id there is no error, and the result is the one with a
        # valid id there (eager itself gathers every entry, so it runs with the valid one).
        unused = int(torch.argmin(used_pages))
        bad_table = table.clone()
        bad_table[unused, int(used_pages[unused]):] = num_pages + seed
        assert_matches_eager(eager_fn, checked_fn, batch, prepare=lambda b: Batch(*b.args[:5], bad_table, b.lens))
        return
    if argument is None:
        assert_matches_eager(eager_fn, checked_fn, batch)
        return
    with pytest.raises(RuntimeError, match=f"nsa.checks: {argument}"), torch.no_grad():
        checked_fn(*batch.clone().args)
