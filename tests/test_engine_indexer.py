"""The engine-fed indexer (metadata as inputs: ks/ke, per-row lengths, seq ids, positions, slot mapping; K gathered by
the model itself, by sequence and position or by flat slot id) compiled with nsa_rocm: every pass's count, compiled
equals eager, and near misses for look-alikes (bounds off by one, ``<=`` where ``<`` is needed, a token -> sequence
map that would have to be monotone)."""

import json
import pathlib
import re
import tempfile

import pytest
import torch

from nsa_inductor.indexer import Indexer
from nsa_inductor.layout import KCacheLayout
from helpers.engine_indexer import EngineIndexer, engine_decode_batch, engine_prefill_batch
from helpers.models import CONFIGS
from helpers.pass_helpers import assert_matches_eager, count_ops, near_miss_reasons, pass_entry, pass_graphs, rewrites

CONFIG = CONFIGS["deepseek_v32"]
CACHE_SLOTS = 512
PAGES = {"paged": 16}  # (flat page views are the OtherIndexer's; one layout keeps this module cheap)

EXPECTED_MATCHES = {
    "decode": {"rope_copy_elision": 0, "quant_cache_store": 1, "rotate_act_quant": 2,
               "rope_prologue": 2, "head_gate_gemm": 1, "wk_gate_gemm": 1, "store_input_rounding": 1,
               "layer_norm_prologue": 1, "split_k_prologue": 1,
               "paged_mqa_logits": 1, "ragged_mqa_logits": 0, "gather_k_slots": 0, "batched_mqa_logits": 0,
               "empty_logits_buffer": 0, "topk_indices": 1, "searchsorted_offset": 0,
               "side_stream": 1},
    "prefill": {"rope_copy_elision": 0, "quant_cache_store": 1, "rotate_act_quant": 2,
                "rope_prologue": 2, "head_gate_gemm": 1, "wk_gate_gemm": 1, "store_input_rounding": 1,
                "layer_norm_prologue": 1, "split_k_prologue": 1,
               "paged_mqa_logits": 0, "ragged_mqa_logits": 1, "gather_k_slots": 1, "batched_mqa_logits": 0,
                "empty_logits_buffer": 0, "topk_indices": 1, "searchsorted_offset": 0,
                "side_stream": 0},
}


def engine_model(page: int, cls=EngineIndexer) -> EngineIndexer:
    reference = Indexer(CONFIG, KCacheLayout(page))
    reference.reset_parameters(torch.Generator().manual_seed(0))
    return cls(CONFIG, page).load_from(reference)


def compile_entry(fn, options: dict):
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix="nsa-engine-"))
    return torch.compile(fn, backend="nsa_rocm", options={"nsa.dump_dir": str(dump_dir), **options}), dump_dir


def static(batch):
    torch._dynamo.mark_static(batch.kv_cache)
    return batch


def batches(entry: str, page: int):
    if entry == "decode":
        return [engine_decode_batch(CONFIG, page, [5, 33, 0, 17], next_n=1, max_len=48, cache_slots=CACHE_SLOTS, seed=1),
                engine_decode_batch(CONFIG, page, [2, 47, 16], next_n=2, max_len=48, cache_slots=CACHE_SLOTS, seed=2)]
    # one padding token: several would all write the dummy slot, whose bytes are then any one token's (DESIGN §4)
    return [engine_prefill_batch(CONFIG, page, [9, 17, 1], padding_tokens=1, cache_slots=CACHE_SLOTS, seed=3),
            engine_prefill_batch(CONFIG, page, [20, 5], padding_tokens=0, cache_slots=CACHE_SLOTS, seed=4)]


@pytest.fixture(scope="module", params=[(e, l) for e in ("decode", "prefill") for l in sorted(PAGES)],
                ids=lambda p: f"{p[0]}-{p[1]}")
def run(request):
    """One compiled entry point per (entry, layout), run on its batches once; the tests read what it left."""
    entry, layout_name = request.param
    page = PAGES[layout_name]
    model = engine_model(page)
    fn = getattr(model, entry)
    compiled_fn, dump_dir = compile_entry(fn, {"nsa.layout": layout_name, "nsa.page_size": page})
    errors = []
    for batch in batches(entry, page):
        try:
            assert_matches_eager(fn, compiled_fn, batch, prepare=static)
        except AssertionError as e:  # reported by test_compiled_equals_eager
            errors.append(f"{batch.x.shape[0]} tokens: {e}")
    return entry, dump_dir, errors


def test_compiled_equals_eager(run):
    _, _, errors = run
    assert not errors, errors


def test_every_pass_count(run):
    entry, dump_dir, _ = run
    reports = [json.loads(p.read_text()) for p in sorted(dump_dir.glob("*/report.json"))]
    assert reports, "no graph was compiled"
    for report in reports:
        matched = rewrites(report)
        assert matched == EXPECTED_MATCHES[entry], f"{report['graph']}: {report['passes']}"


def test_rewrites_use_the_inputs(run):
    """Prefill: nsa.mqa_logits on the model's own gathered K (no gather_k, no search), then that gather through
    seq_ids / positions / block_table replaced by nsa.gather_k_slots on the same maps, the maps' values reported as
    taken as given; decode: the paged op."""
    entry, dump_dir, _ = run
    for g in sorted(p for p in dump_dir.iterdir() if p.is_dir()):
        name = "ragged_mqa_logits" if entry == "prefill" else "paged_mqa_logits"
        _, after = pass_graphs(g, name)
        op = "nsa.mqa_logits" if entry == "prefill" else "nsa.paged_mqa_logits"
        assert count_ops(after, op) == 1
        assert count_ops(after, "nsa.gather_k") == 0 and count_ops(after, "aten.searchsorted") == 0
        assert count_ops(after, "aten.bmm") == 0 and count_ops(after, "aten.relu") == 0
        if entry == "prefill":
            before, after = pass_graphs(g, "gather_k_slots")
            assert count_ops(before, "nsa.gather_k_slots") == 0 and count_ops(after, "nsa.gather_k_slots") == 1
            assert count_ops(after, "aten.index") <= count_ops(before, "aten.index") - 3  # page lookup, K, k_scale
            (given,) = pass_entry(g, "gather_k_slots")["taken_as_given"]
            assert "of sequence" in given["facts"][0], given


@pytest.mark.parametrize("entry", ["decode", "prefill"])
def test_one_sequence(entry):
    """B = 1 (Dynamo specialises size 1): decode with next_n 1 then 2 (row_lens [2] looks like cu_seqlens [B+1]),
    prefill of one sequence."""
    model = engine_model(16)
    fn = getattr(model, entry)
    compiled_fn, dump_dir = compile_entry(fn, {"nsa.layout": "paged", "nsa.page_size": 16})
    if entry == "decode":
        runs = [engine_decode_batch(CONFIG, 16, [33], next_n=n, max_len=48, cache_slots=CACHE_SLOTS, seed=n)
                for n in (1, 2)]
    else:
        runs = [engine_prefill_batch(CONFIG, 16, [7], padding_tokens=0, cache_slots=CACHE_SLOTS, seed=5)]
    for batch in runs:
        assert_matches_eager(fn, compiled_fn, batch, prepare=static)
    for report in [json.loads(p.read_text()) for p in sorted(dump_dir.glob("*/report.json"))]:
        matched = rewrites(report)
        assert matched == EXPECTED_MATCHES[entry], f"{report['graph']}: {report['passes']}"


class SlotGathered(EngineIndexer):
    """Prefill reading the batch's keys back through the slot mapping its store just wrote, one flat slot id per token
    as vLLM/SGLang indexers do: ``values[slot // P, slot % P]`` on the page views, the store's own spelling
    (``values.view(-1, 128)[slot]`` is no view here: each row-major page ends with its P scales)."""

    def _batch_keys(self, kv_cache, positions, slot_mapping, block_table, seq_ids):
        values, scales = self._pages(kv_cache)
        page, pos = slot_mapping // self.page_size, slot_mapping % self.page_size
        return values[page, pos].view(self.cfg.fp8_dtype), scales[page, pos]


def test_gather_by_flat_slots():
    """The flat-slot form compiled end to end: nsa.gather_k_slots by slot (no block table, no seq ids) on the slot
    mapping, every other pass as for the engine's prefill; compiled equals eager on two batches of 28 tokens (one
    graph: this entry reads neither the block table nor the seq ids), with and without a padding token."""
    model = engine_model(16, SlotGathered)
    compiled_fn, dump_dir = compile_entry(model.prefill, {"nsa.layout": "paged", "nsa.page_size": 16})
    runs = [batches("prefill", 16)[0],
            engine_prefill_batch(CONFIG, 16, [20, 8], padding_tokens=0, cache_slots=CACHE_SLOTS, seed=6)]
    for batch in runs:
        assert_matches_eager(model.prefill, compiled_fn, batch, prepare=static)
    graphs = sorted(p for p in dump_dir.iterdir() if p.is_dir())
    assert len(graphs) == 1, graphs
    for g in graphs:
        matched = rewrites(json.loads((g / "report.json").read_text()))
        assert matched == EXPECTED_MATCHES["prefill"], f"{g.name}: {matched}"
        before, after = pass_graphs(g, "gather_k_slots")
        assert count_ops(before, "nsa.gather_k_slots") == 0 and count_ops(after, "nsa.gather_k_slots") == 1
        assert count_ops(after, "aten.index") <= count_ops(before, "aten.index") - 2  # K, k_scale
        # by slot (no block table, no seq ids), through the very slots the store wrote (wrapped as Python wraps them)
        (slots,) = re.findall(r"nsa\.gather_k_slots\.default\(\w+, (\w+), 16, False, torch\.float8_\w+\)", after)
        (stored,) = re.findall(r"nsa\.quant_cache_store\.default, .*?slot_mapping = (\w+)", after)
        assert stored == slots or re.search(rf"\b{stored} = .*\b{slots}\b", after), (slots, stored)
        (given,) = pass_entry(g, "gather_k_slots")["taken_as_given"]
        assert given["facts"][0].startswith(f"key n is read at slot {slots}[n]"), given


# ---------------------------------------------------------------------------------------------------------------
# near misses: masks that look like the bounds but are not
# ---------------------------------------------------------------------------------------------------------------


class Lookalike(EngineIndexer):
    variant = ""

    def prefill(self, x, q_lora, positions, slot_mapping, kv_cache, block_table, seq_ids, ks, ke):
        c = self.cfg
        q_fp8, gates = self._forward_common(x, q_lora, positions, slot_mapping, kv_cache)
        values, scales = self._pages(kv_cache)
        page = block_table[seq_ids, positions // self.page_size].long()
        k_fp8 = values[page, positions % self.page_size].view(c.fp8_dtype)
        k_scale = scales[page, positions % self.page_size]
        dots = torch.einsum("thd,nd->thn", q_fp8.float(), k_fp8.float())
        scores = (torch.relu(dots * k_scale) * gates.unsqueeze(-1)).sum(1)
        col = torch.arange(x.shape[0], device=x.device)
        if self.variant == "ks_off_by_one":
            visible = (col[None, :] > ks[:, None]) & (col[None, :] < ke[:, None])
        elif self.variant == "le_ke":
            visible = (col[None, :] >= ks[:, None]) & (col[None, :] <= ke[:, None])
        else:  # same sequence and causal: equals ks <= n < ke only if seq_ids is sorted, which an input is not known to be
            visible = (seq_ids[None, :] == seq_ids[:, None]) & (col[None, :] <= col[:, None])
        logits = torch.where(visible, scores, float("-inf"))
        return logits, self._topk(logits, ks)


@pytest.mark.parametrize("variant", ["ks_off_by_one", "le_ke", "seq_map_not_monotone"])
def test_does_not_fire_on_lookalikes(variant):
    model = engine_model(16, type("L", (Lookalike,), {"variant": variant}))
    compiled_fn, dump_dir = compile_entry(model.prefill, {"nsa.layout": "paged", "nsa.page_size": 16})
    assert_matches_eager(model.prefill, compiled_fn, batches("prefill", 16)[0], prepare=static)
    reasons = near_miss_reasons(dump_dir, "ragged_mqa_logits")
    assert reasons and any("mask" in r for r in reasons), reasons


# ---------------------------------------------------------------------------------------------------------------
# the cache's own page size: a 16-token cache compiled where the guard prefers 64-token pages
# ---------------------------------------------------------------------------------------------------------------


def reference_run(page: int, preshuffle: bool, entry: str, options: dict, dynamic_rows: bool = False):
    from nsa_inductor.workload import decode_batch, prefill_batch

    layout = KCacheLayout(page, preshuffle)
    model = Indexer(CONFIG, layout)
    model.reset_parameters(torch.Generator().manual_seed(0))
    fn = getattr(model, entry)
    compiled_fn, dump_dir = compile_entry(fn, options)
    if entry == "decode":
        batch = decode_batch(CONFIG, layout, [5, 33, 0, 17], next_n=1, max_len=48, seed=1)
    else:
        batch = prefill_batch(CONFIG, layout, [9, 17, 1], seed=3)
    mark = (lambda b: torch._dynamo.mark_dynamic(b.kv_cache, 1) or b) if dynamic_rows else static
    assert_matches_eager(fn, compiled_fn, batch, prepare=mark)
    return dump_dir


@pytest.mark.parametrize("entry", ["decode", "prefill"])
def test_page_size_from_the_cache(entry):
    """nsa.layout="paged" without a page size: the guard says 64, the cache's rows say 16 (2112 bytes)."""
    dump_dir = reference_run(16, False, entry, {"nsa.layout": "paged"})
    for report in [json.loads(p.read_text()) for p in sorted(dump_dir.glob("*/report.json"))]:
        assert "page_size=64" in report["layout"]
        matched = {p["name"]: p["matched"] for p in report["passes"]}
        assert matched["quant_cache_store"] == 1, report["passes"]
        assert matched["paged_mqa_logits" if entry == "decode" else "ragged_mqa_logits"] == 1, report["passes"]


def test_preshuffle_format_with_the_caches_page_size():
    dump_dir = reference_run(16, True, "decode", {"nsa.layout": "preshuffle"})
    for report in [json.loads(p.read_text()) for p in sorted(dump_dir.glob("*/report.json"))]:
        matched = {p["name"]: p["matched"] for p in report["passes"]}
        assert matched["quant_cache_store"] == 1 and matched["paged_mqa_logits"] == 1, report["passes"]


@pytest.mark.parametrize("page, dynamic_rows, words", [(8, False, "multiple of 16"), (16, True, "dynamic")])
def test_cache_that_contradicts_the_format_is_a_near_miss(page, dynamic_rows, words):
    """Row-major 8-token pages under a preshuffle guard; a cache whose row size is symbolic."""
    options = {"nsa.layout": "preshuffle"} if not dynamic_rows else {"nsa.layout": "paged"}
    dump_dir = reference_run(page, False, "decode", options, dynamic_rows)
    for name in ("quant_cache_store", "paged_mqa_logits"):
        reasons = near_miss_reasons(dump_dir, name)
        assert reasons and any(words in r for r in reasons), (name, reasons)


@pytest.mark.parametrize("entry", ["decode", "prefill"])
def test_an_empty_batch_equals_eager_without_cache_copies(entry):
    """An idle rank's step (no token), strict: no pass raises, the store is removed, no copy of the cache is made."""
    model = engine_model(16)
    fn = getattr(model, entry)
    compiled_fn, dump_dir = compile_entry(fn, {"nsa.layout": "paged", "nsa.page_size": 16, "nsa.strict": True})
    batch = engine_decode_batch(CONFIG, 16, [], next_n=1, max_len=48, cache_slots=CACHE_SLOTS, seed=1) \
        if entry == "decode" else engine_prefill_batch(CONFIG, 16, [], padding_tokens=0, cache_slots=CACHE_SLOTS, seed=3)
    assert_matches_eager(fn, compiled_fn, batch, prepare=static)
    (report,) = [json.loads(p.read_text()) for p in dump_dir.glob("*/report.json")]
    assert rewrites(report)["quant_cache_store"] == 1 and report["cache_copies"] == 0, report
