"""docs/indices.md: one contract for slot and page ids in the eager indexer, the op references and the compiled
indexer. Ids eager accepts give eager's result; any other id writes nothing / reads as masked."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import nsa_inductor  # noqa: F401  (registers torch.ops.nsa)
from nsa_inductor.layout import KCacheLayout
from nsa_inductor.workload import Batch
from helpers.models import CONFIGS, LAYOUTS, batches, compiled
from helpers.ops64 import FN, random_cache, random_fp8
from helpers.pass_helpers import assert_matches_eager

LAYOUT = KCacheLayout(16)
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _with_table(batch: Batch, table: torch.Tensor) -> Batch:
    args = list(batch.clone().args)
    args[5] = table
    return Batch(*args)


@pytest.mark.parametrize("entry", ["decode", "prefill"])
def test_negative_page_ids_wrap_like_python_indices(entry):
    """Every block-table entry p written as p - num_pages: eager reads the same pages (Python wrap-around), so its
    result is unchanged, and the compiled indexer gives that result."""
    eager_fn, compiled_fn, _ = compiled("deepseek_v32", "paged", entry)
    batch = batches(CONFIGS["deepseek_v32"], LAYOUTS["paged"], entry)[0]
    wrapped = _with_table(batch, batch.block_table - batch.kv_cache.shape[0])
    with torch.no_grad():
        plain, negative = batch.clone(), wrapped.clone()
        want, got = eager_fn(*plain.args), eager_fn(*negative.args)
    assert torch.equal(plain.kv_cache, negative.kv_cache)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert_matches_eager(eager_fn, compiled_fn, wrapped)


@pytest.mark.parametrize("bad", [32, 33, 10**9, 2**31 - 1, -1, -33, -(2**31)])
@pytest.mark.parametrize("store", ["op", "eager"])
def test_out_of_range_slots_write_nothing(bad, store):
    """A 32-slot cache: slot 32 (one past the end), far-out and negative slots leave every byte as it was; the
    in-range row beside them is written."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randint(0, 256, (2, LAYOUT.page_bytes), dtype=torch.uint8, generator=gen)
    before = cache.clone()
    k = torch.randn(2, 128, generator=gen).bfloat16()
    slots = torch.tensor([bad, 3])
    if store == "op":
        torch.ops.nsa.quant_cache_store(k, cache, slots, 16, False, "ue8m0", FN)
    else:
        values, scale = (torch.randn(2, 128, generator=gen).to(FN), torch.rand(2, generator=gen))
        LAYOUT.store(cache, slots, values, scale)
    changed = (cache != before).view(-1).nonzero().flatten()
    assert changed.numel() and set(changed.tolist()) <= set(LAYOUT.value_offsets(slots[1:]).flatten().tolist()) | set(
        LAYOUT.scale_offsets(slots[1:]).flatten().tolist())


def test_paged_logits_mask_unreadable_pages():
    """Pages outside [-num_pages, num_pages) are -inf keys; a negative id in range reads page p + num_pages."""
    gen = torch.Generator().manual_seed(1)
    cache = random_cache(3, 16, FN, gen)
    q = random_fp8((1, 1, 16, 128), FN, gen)
    w = torch.randn(1, 16, generator=gen)
    ctx = torch.tensor([64], dtype=torch.int32)

    def logits(pages):
        table = torch.tensor([pages], dtype=torch.int32)
        return torch.ops.nsa.paged_mqa_logits(q, cache, w, ctx, table, 64, 16, False)

    want = logits([2, 0, 1, 2])
    got = logits([-1, 3, -4, 10**9])
    assert torch.equal(got[:, :16], want[:, :16])
    assert bool(got[:, 16:].isneginf().all())


def test_gather_k_zeroes_unreadable_pages_and_rows_before_cu_seqlens():
    gen = torch.Generator().manual_seed(2)
    cache = random_cache(3, 16, FN, gen)
    table = torch.tensor([[-3, 3], [1, -4]], dtype=torch.int32)
    cu = torch.tensor([4, 36, 40], dtype=torch.int32)
    k, scale = torch.ops.nsa.gather_k(cache, table, cu, 16, False, 42, FN)
    read = torch.cat([torch.arange(4, 20), torch.arange(36, 40)])  # page -3 (= page 0), then page 1
    want_k, want_scale = LAYOUT.load(cache, torch.cat([torch.arange(16), torch.arange(16, 20)]), FN)
    assert torch.equal(k[read].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(scale[read], want_scale)
    zero = torch.ones(42, dtype=torch.bool)
    zero[read] = False
    assert not k.view(torch.uint8)[zero].any() and not scale[zero].any()


def test_gather_k_slots_reads_what_eager_indexing_reads():
    """Slots and (sequence, position) ids eager's indexing accepts (negative ones wrap) read its rows; any other id
    (a slot past the cache, a sequence past the table, an unreadable page) a zero row and scale."""
    cache = random_cache(3, 16, FN, torch.Generator().manual_seed(3))
    values, scales = cache[:, :16 * 128].unflatten(1, (16, 128)), cache[:, 16 * 128:].view(torch.float32)
    slots = torch.tensor([5, -1, 47, 48, -49])
    k, scale = torch.ops.nsa.gather_k_slots(cache, slots, 16, False, FN)
    read = slots[:3]
    assert torch.equal(k[:3].view(torch.uint8), values[read // 16, read % 16]) and torch.equal(
        scale[:3], scales[read // 16, read % 16])
    table = torch.tensor([[2, -1], [1, 3]], dtype=torch.int32)
    seq, pos = torch.tensor([0, 0, -1, 1, 2]), torch.tensor([3, 20, -1, 20, 0])  # page ids 2, -1 | 3, 3, row 2
    k2, scale2 = torch.ops.nsa.gather_k_slots(cache, pos, 16, False, FN, table, seq)
    page = table[seq[:2], pos[:2] // 16].long()
    assert torch.equal(k2[:2].view(torch.uint8), values[page, pos[:2] % 16]) and torch.equal(
        scale2[:2], scales[page, pos[:2] % 16])
    for got_k, got_scale in ((k[3:], scale[3:]), (k2[2:], scale2[2:])):
        assert not got_k.view(torch.uint8).any() and not got_scale.any()


@pytest.mark.parametrize("entry", ["decode", "prefill"])
def test_shared_slots_compiled_as_eager(entry):
    """Tokens of one step sharing slots (the first token's slot given to every other token): the compiled store
    keeps the last token's bytes, as the eager store does, and what the step reads back agrees."""
    eager_fn, compiled_fn, _ = compiled("deepseek_v32", "paged", entry)
    batch = batches(CONFIGS["deepseek_v32"], LAYOUTS["paged"], entry)[0]
    args = list(batch.clone().args)
    args[3] = torch.where(torch.arange(len(args[3])) % 2 == 1, args[3][0], args[3])
    assert_matches_eager(eager_fn, compiled_fn, Batch(*args))


@pytest.mark.parametrize("store", ["op", "eager"])
def test_duplicate_slots_hold_the_last_token(store):
    """Slots [5, 9, 5, 5]: slot 5 holds the values and scale of the last token with slot 5 (row 3)."""
    gen = torch.Generator().manual_seed(3)
    cache = torch.randint(0, 256, (2, LAYOUT.page_bytes), dtype=torch.uint8, generator=gen)
    slots = torch.tensor([5, 9, 5, 5])
    k = torch.randn(4, 128, generator=gen) * torch.tensor([1.0, 2.0, 300.0, 0.01])[:, None]
    values, scale = torch.ops.aten.clone(k).to(FN), torch.rand(4, generator=gen) + 0.5
    if store == "op":
        torch.ops.nsa.quant_cache_store(k, cache, slots, 16, False, "ue8m0", FN)
        from nsa_inductor.quant import act_quant

        values, scale = act_quant(k, 128, "ue8m0", FN)
        scale = scale.squeeze(-1)
    else:
        LAYOUT.store(cache, slots, values, scale)
    got_v, got_s = LAYOUT.load(cache, torch.tensor([5, 9]), FN)
    assert torch.equal(got_v.view(torch.uint8), values[[3, 1]].view(torch.uint8))
    assert torch.equal(got_s, scale[[3, 1]])


def _store(k, slots, cache):
    torch.ops.nsa.quant_cache_store(k, cache, slots, 16, False, "ue8m0", FN)


def _store_into_first_pages(k, slots, cache):
    """The store into a view of the cache's first two pages: slots past them are out of range."""
    torch.ops.nsa.quant_cache_store(k, cache[:2], slots, 16, False, "ue8m0", FN)


def _store_into_flat_pool(k, slots, pool):
    """The store into the first two pages of a flat byte pool, viewed as ``[pages, page_bytes]``."""
    torch.ops.nsa.quant_cache_store(k, pool[: 2 * 16 * 132].view(2, -1), slots, 16, False, "ue8m0", FN)


def _store_idiom(k, slots, cache):
    """The eager store, which the quant_cache_store pass rewrites into the op."""
    from nsa_inductor.quant import act_quant

    values, scale = act_quant(k, 128, "ue8m0", FN)
    LAYOUT.store(cache, slots, values, scale[:, 0])


def _paged_logits(q, cache, w, ctx, table):
    return torch.ops.nsa.paged_mqa_logits(q, cache, w, ctx, table, 64, 16, False)


def _gather(cache, table, cu):
    return torch.ops.nsa.gather_k(cache, table, cu, 16, False, 42, FN)


def _gather_slots(cache, positions, *table_and_seq_ids):
    return torch.ops.nsa.gather_k_slots(cache, positions, 16, False, FN, *table_and_seq_ids)


def _checks_cases():
    gen = torch.Generator().manual_seed(4)
    cache = random_cache(3, 16, FN, gen)
    k = torch.randn(2, 128, generator=gen).bfloat16()
    q, w = random_fp8((1, 1, 16, 128), FN, gen), torch.randn(1, 16, generator=gen)
    ctx, table = torch.tensor([40], dtype=torch.int32), torch.tensor([[2, 0, 1, 2]], dtype=torch.int32)
    cu = torch.tensor([0, 20, 40], dtype=torch.int32)
    gather_table = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    return {  # name: (function, good arguments, bad arguments, the argument the error names)
        "store": (_store, (k, torch.tensor([3, -1]), cache), (k, torch.tensor([3, 48]), cache), "slot_mapping"),
        "store-view": (_store_into_first_pages, (k, torch.tensor([31, -1]), cache), (k, torch.tensor([3, 40]), cache),
                       "slot_mapping"),
        "store-pool": (_store_into_flat_pool, (k, torch.tensor([31, -1]), cache.view(-1)),
                       (k, torch.tensor([3, 40]), cache.view(-1)), "slot_mapping"),
        "store-rewritten": (_store_idiom, (k, torch.tensor([3, -1]), cache), (k, torch.tensor([3, 48]), cache),
                            "slot_mapping"),
        "paged-table": (_paged_logits, (q, cache, w, ctx, table), (q, cache, w, ctx, table.clone().fill_(3)),
                        "block_table"),
        "paged-context": (_paged_logits, (q, cache, w, ctx, table), (q, cache, w, ctx + 30, table), "context_lens"),
        "gather-cu": (_gather, (cache, gather_table, cu), (cache, gather_table, cu + 4), "cu_seqlens"),
        "slots": (_gather_slots, (cache, torch.tensor([3, -48])), (cache, torch.tensor([3, 48])), "positions"),
        "slots-seq": (_gather_slots, (cache, torch.tensor([3, -1]), gather_table, torch.tensor([0, -2])),
                      (cache, torch.tensor([3, -1]), gather_table, torch.tensor([0, 2])), "seq_ids"),
        "slots-table": (_gather_slots, (cache, torch.tensor([3, -1]), gather_table, torch.tensor([0, 1])),
                        (cache, torch.tensor([3, -1]), gather_table.clone().fill_(3), torch.tensor([0, 1])),
                        "block_table"),
    }


@pytest.mark.parametrize("name", ["store", "store-view", "store-pool", "store-rewritten", "paged-table",
                                  "paged-context", "gather-cu", "slots-seq"])
def test_checks_raise_naming_the_argument(name):
    """``nsa.checks``: in-contract ids give the op's result; an id the default mode would mask raises an error
    naming the argument (a device-side assert; on the CPU a RuntimeError)."""
    fn, good, bad, argument = _checks_cases()[name]
    options = {"nsa.checks": True, "nsa.layout": "paged", "nsa.page_size": 16}
    compiled_fn = torch.compile(fn, backend="nsa_rocm", dynamic=False, options=options)
    want_args, got_args = [[a.clone() for a in args] for args in (good, good)]
    want, got = fn(*want_args), compiled_fn(*got_args)
    for a, b in zip([*want_args, *(want if isinstance(want, tuple) else [want])],
                    [*got_args, *(got if isinstance(got, tuple) else [got])]):
        if a is not None:
            assert torch.equal(a.view(torch.uint8) if a.dtype == FN else a, b.view(torch.uint8) if b.dtype == FN else b)
    with pytest.raises(RuntimeError, match=f"nsa.checks: {argument}|nsa.checks: .*{argument}"):
        compiled_fn(*[a.clone() for a in bad])


def test_environment_switch_checks_every_op_call():
    """``NSA_INDUCTOR_CHECKS=1``: the ops themselves assert (engines calling ``torch.ops.nsa`` directly), with the same
    messages as ``nsa.checks``; in-contract ids run as before. A fresh process: the switch is read once per process."""
    script = """
import sys, torch
sys.path.insert(0, "tests")
import nsa_inductor
from test_indices import _checks_cases
assert "checks=on (NSA_INDUCTOR_CHECKS)" in nsa_inductor.describe()
for name in ["store", "store-view", "store-pool", "paged-table", "paged-context", "gather-cu", "slots", "slots-seq",
             "slots-table"]:
    fn, good, bad, argument = _checks_cases()[name]
    fn(*good)
    try:
        fn(*bad)
    except RuntimeError as e:
        assert f"nsa.checks: " in str(e) and argument in str(e), (name, str(e))
    else:
        raise AssertionError(f"{name}: no error")
print("ok")
"""
    env = {**os.environ, "NSA_INDUCTOR_CHECKS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
