"""The reference indexer compiled with nsa_rocm equals eager: cache bytes (bit-exact up to the documented bound of
wk_gate_gemm's summation order), logits, masks, top-k sets."""

import ast
import dataclasses
import functools
import json
import pathlib
import tempfile

import pytest
import torch
from torch._dynamo.utils import counters

from nsa_inductor.indexer import Indexer, IndexerConfig
from nsa_inductor.layout import KCacheLayout
from nsa_inductor.workload import decode_batch, prefill_batch
from helpers.models import CACHE_SLOTS, CONFIGS, LAYOUTS, batches, compile_indexer, compiled, other
from helpers.other_indexer import OtherIndexer
from helpers.pass_helpers import (assert_k_cache_matches, assert_matches_eager, assert_step_logits_close,
                                  eager_logits_on_cache, rewrites)
from helpers.reference64 import assert_logits_close


def reports(dump_dir: pathlib.Path) -> list[dict]:
    """The reports dumped under ``dump_dir`` (never none: a loop over no report asserts nothing)."""
    found = [json.loads(p.read_text()) for p in sorted(dump_dir.glob("*/report.json"))]
    assert found, f"no report was dumped under {dump_dir}"
    return found


@pytest.mark.parametrize("entry", ["decode", "prefill"])
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_compiled_equals_eager(config_name, layout_name, entry):
    eager_fn, compiled_fn, dump_dir = compiled(config_name, layout_name, entry)
    config, layout = CONFIGS[config_name], LAYOUTS[layout_name]
    for batch in batches(config, layout, entry):
        assert_matches_eager(eager_fn, compiled_fn, batch)
    graphs = reports(dump_dir)
    assert graphs, "the pass manager wrote no report"
    for report in graphs:
        matched = rewrites(report)
        assert matched == EXPECTED_MATCHES[entry], f"{report['graph']}: {report['passes']}"


# Every pass fires where its idiom is (rotate_act_quant twice: q and k). Prefill has no full(-inf) left for
# empty_logits_buffer: Inductor already drops a slice write that covers the whole buffer. (unpad_gemm's count:
# ``rewrites``.)
EXPECTED_MATCHES = {
    "decode": {"rope_copy_elision": 1, "quant_cache_store": 1, "rotate_act_quant": 2,
               "rope_prologue": 2, "head_gate_gemm": 1, "wk_gate_gemm": 1, "store_input_rounding": 1,
               "layer_norm_prologue": 1, "split_k_prologue": 1,
               "paged_mqa_logits": 1, "ragged_mqa_logits": 0, "gather_k_slots": 0, "batched_mqa_logits": 0,
               "empty_logits_buffer": 1, "topk_indices": 1, "searchsorted_offset": 0,
               "side_stream": 1},
    "prefill": {"rope_copy_elision": 1, "quant_cache_store": 1, "rotate_act_quant": 2,
                "rope_prologue": 2, "head_gate_gemm": 1, "wk_gate_gemm": 1, "store_input_rounding": 1,
                "layer_norm_prologue": 1, "split_k_prologue": 1,
               "paged_mqa_logits": 0, "ragged_mqa_logits": 1, "gather_k_slots": 0, "batched_mqa_logits": 0,
                "empty_logits_buffer": 0, "topk_indices": 1, "searchsorted_offset": 2,
                "side_stream": 0},
}


@pytest.mark.parametrize("indexer, entry", [("reference", "decode"), ("reference", "prefill"), ("other", "decode")])
def test_every_pass_fires_on_gemms_that_pad_mm_padded(indexer, entry, monkeypatch):
    """On GPUs Inductor's ``pad_mm`` pads GEMMs whose token count is not a multiple of 8 (4 in fp32) wherever its
    benchmark finds that faster, a choice that flips from run to run; forced here (its GPU-only checks bypassed) for
    batches of 6 and 30 tokens: ``unpad_gemm`` undoes it, every other pass fires as without it, compiled equals
    eager."""
    from torch._inductor.fx_passes import pad_mm

    monkeypatch.setattr(pad_mm, "check_device", lambda a, b: True)
    monkeypatch.setattr(pad_mm, "has_triton", lambda: True)
    config, layout = CONFIGS["deepseek_v32"], LAYOUTS["paged"]
    model = Indexer(config, layout)
    model.reset_parameters(torch.Generator().manual_seed(0))
    if indexer == "other":
        model = OtherIndexer(config, layout.page_size).load_from(model)
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"nsa-pad-mm-{indexer}-{entry}-"))
    fn = getattr(model, entry)
    # static: other tests' compiles of the shared code objects may have made the token count symbolic for Dynamo's
    # automatic dynamic shapes, and pad_mm pads static sizes only
    compiled_fn = torch.compile(fn, backend="nsa_rocm", dynamic=False, options={
        "nsa.layout": "paged", "nsa.page_size": layout.page_size, "nsa.dump_dir": str(dump_dir),
        "force_shape_pad": True})
    pages = CACHE_SLOTS // layout.page_size
    batch = decode_batch(config, layout, [5, 33, 0], next_n=2, max_len=48, seed=1, cache_pages=pages) \
        if entry == "decode" else prefill_batch(config, layout, [9, 17, 1], padding_tokens=3, seed=3, cache_pages=pages)
    assert_matches_eager(fn, compiled_fn, batch)
    (report,) = reports(dump_dir)
    assert {p["name"]: p["matched"] for p in report["passes"]}["unpad_gemm"] >= 3, report["passes"]
    assert rewrites(report) == EXPECTED_MATCHES[entry], f"{report['graph']}: {report['passes']}"
    assert report["cache_copies"] == 0, report["cache_copy_sites"]


def test_prefill_of_one_sequence_is_rewritten():
    """A lone sequence starting at position 0 reads K at the slots decode would use; the mask tells them apart."""
    eager_fn, compiled_fn, dump_dir = compiled("deepseek_v32", "paged", "prefill")
    config, layout = CONFIGS["deepseek_v32"], LAYOUTS["paged"]
    batch = prefill_batch(config, layout, [23], seed=5, cache_pages=CACHE_SLOTS // layout.page_size)
    assert_matches_eager(eager_fn, compiled_fn, batch)
    graphs = reports(dump_dir)
    assert graphs
    for report in graphs:
        matched = rewrites(report)
        assert matched == EXPECTED_MATCHES["prefill"], f"{report['graph']}: {report['passes']}"


def size_batches(entry):
    """Decode B in {1, 2, 7, 64} x next_n in {1, 2}, prefill T in {1, 5}; B=64 sequences of one page each (the
    CACHE_SLOTS cache holds 64 pages of 16)."""
    config, layout = CONFIGS["deepseek_v32"], LAYOUTS["paged"]
    pages = CACHE_SLOTS // layout.page_size
    if entry == "prefill":
        return {f"T={sum(lens)}": prefill_batch(config, layout, lens, seed=6, cache_pages=pages) for lens in ([1], [2, 3])}
    out = {}
    for next_n in (1, 2):
        for b in (1, 2, 7, 64):
            lens = [(5 * i) % 15 + 2 for i in range(b)] if b == 64 else [(7 * i + 9) % 46 + 2 for i in range(b)]
            out[f"B={b} next_n={next_n}"] = decode_batch(config, layout, lens, next_n=next_n, max_len=48, seed=b,
                                                         cache_pages=pages)
    return out


def dynamic_batch(batch):
    """Every size but the cache's symbolic from the first compile on (one dynamic graph, not a static one first),
    except where it is 1: Dynamo specialises that."""
    for t in (batch.x, batch.q_lora, batch.positions, batch.slot_mapping, batch.block_table, batch.lens):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    return batch


@pytest.mark.parametrize("entry", ["decode", "prefill"])
@pytest.mark.parametrize("indexer", ["reference", "other"])
def test_every_batch_size_stores_without_cache_copies(indexer, entry):
    """Size 1 is specialised by Dynamo (its own graph, squeezed shapes); the other sizes share the dynamic graph.
    On every graph the store is rewritten and no copy of the cache remains (report figure ``cache_copies``)."""
    eager_fn, compiled_fn, dump_dir = compiled("deepseek_v32", "paged", entry) if indexer == "reference" else \
        other("paged", entry)
    for name, batch in size_batches(entry).items():
        if indexer == "other":  # its padding convention: a reserved dummy slot, not -1 (none of these pad)
            assert (batch.slot_mapping >= 0).all(), name
        assert_matches_eager(eager_fn, compiled_fn, batch, prepare=dynamic_batch)
    graphs = reports(dump_dir)
    assert len(graphs) >= 2, "size 1 compiles a graph of its own"
    for report in graphs:
        assert not [p for p in report["passes"] if "error" in p], f"{report['graph']}: a pass raised"
        (store,) = [p for p in report["passes"] if p["name"] == "quant_cache_store"]
        assert store["matched"] == 1, f"{report['graph']}: {store['near_misses']}"
        assert report["cache_copies"] == 0, f"{report['graph']}: {report['cache_copy_sites']}"


@pytest.mark.parametrize("entry", ["decode", "prefill"])
@pytest.mark.parametrize("indexer", ["reference", "other"])
def test_an_empty_batch_stores_nothing_without_cache_copies(indexer, entry):
    """An idle data-parallel rank's step (decode B=0, prefill T=0; Dynamo specialises size 0 too), strict: no pass
    raises, the store of no token is removed, the logits passes say why they leave empty logits alone, outputs and
    cache are eager's. (Its own compile: the shared ones' reports are read by tests that expect every pass to fire.)"""
    eager_fn = (compiled("deepseek_v32", "paged", entry) if indexer == "reference" else other("paged", entry))[0]
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"nsa-empty-{indexer}-{entry}-"))
    layout = LAYOUTS["paged"]
    compiled_fn = compile_indexer(eager_fn, {"nsa.layout": "paged", "nsa.page_size": layout.page_size,
                                             "nsa.strict": True, "nsa.dump_dir": str(dump_dir)})
    pages = CACHE_SLOTS // layout.page_size
    batch = decode_batch(CONFIGS["deepseek_v32"], layout, [], max_len=48, cache_pages=pages) if entry == "decode" \
        else prefill_batch(CONFIGS["deepseek_v32"], layout, [], cache_pages=pages)
    assert_matches_eager(eager_fn, compiled_fn, batch)
    (report,) = reports(dump_dir)
    assert rewrites(report)["quant_cache_store"] == 1 and report["cache_copies"] == 0, report
    logits_misses = [m["reason"] for p in report["passes"] if p["name"].endswith("mqa_logits") for m in p["near_misses"]]
    assert logits_misses and all("hold no element (an empty batch)" in reason for reason in logits_misses)


@pytest.mark.parametrize("entry", ["decode", "prefill"])
def test_dynamic_true_rewrites_with_the_cache_shape_guarded(entry):
    """``torch.compile(..., dynamic=True)`` makes even the K cache's sizes symbolic: the passes fix them to the
    call's shape with a guard, so every pass fires as in a static compile and no cache copy remains; a cache of
    another page count then recompiles (more graphs) and still equals eager."""
    torch._dynamo.reset()  # (symbolic sizes of Indexer's shared code objects must not leak into other compiles)
    try:
        config, layout = CONFIGS["deepseek_v32"], LAYOUTS["paged"]
        model = Indexer(config, layout)
        model.reset_parameters(torch.Generator().manual_seed(0))
        dump_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"nsa-dynamic-{entry}-"))
        fn = getattr(model, entry)
        compiled_fn = torch.compile(fn, backend="nsa_rocm", dynamic=True, options={
            "nsa.layout": "paged", "nsa.page_size": layout.page_size, "nsa.dump_dir": str(dump_dir)})
        graph_counts = []
        for extra_pages in (0, 3):
            runs = [batches(config, layout, entry)[0]]
            if entry == "decode":
                runs.append(size_batches(entry)["B=7 next_n=1"])  # another batch size through the same graph
            for batch in runs:
                batch.kv_cache = torch.cat([batch.kv_cache, batch.kv_cache[:extra_pages]])
                assert_matches_eager(fn, compiled_fn, batch)
            graph_counts.append(len(reports(dump_dir)))
    finally:
        torch._dynamo.reset()
    assert graph_counts[1] > graph_counts[0], "another cache shape compiles anew"
    graphs = reports(dump_dir)
    for report in graphs:
        matched = rewrites(report)
        assert matched == EXPECTED_MATCHES[entry], f"{report['graph']}: {report['passes']}"
        assert report["cache_copies"] == 0, f"{report['graph']}: {report['cache_copy_sites']}"


GPU_LAYOUTS = {"flat": KCacheLayout(1), "paged": KCacheLayout(64), "preshuffle": KCacheLayout(64, preshuffle=True)}


@functools.cache
def compiled_gpu(config_name: str, layout_name: str, entry: str, disabled: tuple = ()):
    config = getattr(IndexerConfig, config_name)(max_model_len=4096)
    layout = GPU_LAYOUTS[layout_name]
    model = Indexer(config, layout).cuda()
    model.reset_parameters(torch.Generator().manual_seed(0))
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"nsa-gpu-{config_name}-{layout_name}-{entry}-"))
    # pad_mm pads the GEMMs of unaligned token counts only where its benchmark says so, which flips from run to run:
    # forced, every run compiles the same graphs (unpad_gemm undoes it; unforced, the prefill's k-side passes fired
    # or not by that timing before unpad_gemm existed)
    options = {"nsa.layout": layout_name, "nsa.page_size": layout.page_size, "nsa.dump_dir": str(dump_dir),
               "nsa.disable_passes": list(disabled), "force_shape_pad": True}
    fn = getattr(model, entry)
    return config, layout, fn, compile_indexer(fn, options), dump_dir


def gpu_cases(config, layout, entry, cache_pages: int | None = None):
    if entry == "decode":
        pages = cache_pages or 8192 // layout.page_size
        return [decode_batch(config, layout, [5, 700, 0, 2049], next_n=1, max_len=2112, seed=1, device="cuda",
                             cache_pages=pages),
                decode_batch(config, layout, [3, 1000, 64], next_n=2, max_len=2112, seed=2, device="cuda",
                             cache_pages=pages)]
    return [prefill_batch(config, layout, [300, 17, 1000], padding_tokens=5, seed=3, device="cuda"),
            prefill_batch(config, layout, [700], seed=4, device="cuda")]


def assert_gpu_step_close(eager_fn, batch, layout, cache, outputs) -> None:
    """The compiled step's ``cache`` and ``(logits, topk)`` against eager's on a copy of ``batch``: K-cache bytes
    within the reordered passes' bound, logits to the contract (with its allowance for moved keys), top-k sets
    identical in >= 99 % of rows."""
    eager = batch.clone()
    logits, topk = eager_fn(*eager.args)
    c_logits, c_topk = outputs
    moved = assert_k_cache_matches(eager.kv_cache, cache, batch.slot_mapping, layout)
    assert_step_logits_close(c_logits, logits, moved, eager_fn, batch, cache)
    _assert_same_sets(topk, c_topk, 0.99)


def _assert_same_sets(want, got, share: float = 1.0) -> None:
    """The top-k index sets of ``got`` are ``want``'s in at least ``share`` of the rows."""
    assert (got.shape, got.dtype) == (want.shape, want.dtype), (got.shape, got.dtype)
    same = sum(set(a.tolist()) == set(b.tolist()) for a, b in zip(want.cpu(), got.cpu()))
    assert same >= share * want.shape[0], f"top-k sets differ in {want.shape[0] - same} of {want.shape[0]} rows"


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["decode", "prefill"])
@pytest.mark.parametrize("layout_name", sorted(GPU_LAYOUTS))
@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_compiled_equals_eager_on_gpu(config_name, layout_name, entry):
    """Real model sizes, the Triton kernels: the same guarantees as on the CPU except the K-cache bytes, which move
    within the bound of the passes that sum in another order than cuBLAS (rotate_act_quant, wk_gate_gemm:
    docs/numerics.md); every pass fires."""
    config, layout, eager_fn, compiled_fn, dump_dir = compiled_gpu(config_name, layout_name, entry)
    with torch.no_grad():
        for batch in gpu_cases(config, layout, entry):
            comp = batch.clone()
            assert_gpu_step_close(eager_fn, batch, layout, comp.kv_cache, compiled_fn(*comp.args))
    # prefill-sized token counts keep cuBLAS's wk (wk_gate_gemm.MAX_TOKENS), so the store has no split-K sum to take;
    # a decode batch whose x rows Inductor's pad_mm padded (static B=3, next_n=2 on the H200) is fused too
    # (docs/passes/wk_gate_gemm.md)
    expected = {**EXPECTED_MATCHES[entry], **({"wk_gate_gemm": 0, "split_k_prologue": 0} if entry == "prefill" else {})}
    for report in reports(dump_dir):
        matched = rewrites(report)
        assert matched == expected, f"{report['graph']}: {report['passes']}"


@pytest.mark.gpu
def test_one_and_two_token_prefills_equal_eager_on_gpu():
    """The smallest prefills, where one logit is a sum over heads whose terms may cancel: K within its bound, and
    each logit within 1e-3 of the size of its terms (``eager_logits_on_cache(term_sizes=True)``; Hopper's fp8 dots
    accumulate to about 1e-4 of it) of eager read from the compiled step's own K, over several draws."""
    config, layout, eager_fn, compiled_fn, _ = compiled_gpu("deepseek_v32", "paged", "prefill")
    with torch.no_grad():
        for seed in range(8):
            for lens in ([1], [2], [1, 2]):
                batch = prefill_batch(config, layout, lens, seed=seed, device="cuda")
                eager, comp = batch.clone(), batch.clone()
                eager_fn(*eager.args)
                c_logits, _ = compiled_fn(*comp.args)
                assert_k_cache_matches(eager.kv_cache, comp.kv_cache, batch.slot_mapping, layout)
                on_k = eager_logits_on_cache(eager_fn, batch, comp.kv_cache)
                sizes = eager_logits_on_cache(eager_fn, batch, comp.kv_cache, term_sizes=True)
                finite = ~on_k.isneginf()
                assert torch.equal(finite, ~c_logits.isneginf()), f"{lens} seed {seed}: -inf masks differ"
                error = (c_logits - on_k).abs()[finite]
                assert (error <= 1e-3 * sizes[finite]).all(), f"{lens} seed {seed}: {error} of {sizes[finite]}"


def test_a_one_token_step_is_judged_on_its_own_k():
    """The GPU tests' comparison where K moved (``assert_step_logits_close`` with ``eager_logits_on_cache``), on
    the CPU: a one-token prefill whose wk outputs are one bf16 step off in 5 % of the values (what another summation
    order does) passes; the norm-wise allowance alone fails it (its logit's head terms nearly cancel); logits 1 %
    off fail."""
    config, layout = IndexerConfig.deepseek_v32(max_model_len=256), KCacheLayout(64)
    model = Indexer(config, layout)
    model.reset_parameters(torch.Generator().manual_seed(0))
    batch = prefill_batch(config, layout, [1], seed=2, cache_pages=4)
    eager, moved_run = batch.clone(), batch.clone()
    eager_wk = model.wk.forward
    flips = torch.rand(1, config.head_dim, generator=torch.Generator().manual_seed(2)) < 0.05

    def moved_wk(x):
        bits = eager_wk(x).view(torch.int16)
        return torch.where(flips, bits + 1, bits).view(torch.bfloat16)

    with torch.no_grad():
        logits, _ = model.prefill(*eager.args)
        model.wk.forward = moved_wk
        try:
            moved_logits, _ = model.prefill(*moved_run.args)
        finally:
            del model.wk.forward
    moved = assert_k_cache_matches(eager.kv_cache, moved_run.kv_cache, batch.slot_mapping, layout)
    assert moved and moved["tokens_moved"] == 1, moved
    own_k = (model.prefill, batch, moved_run.kv_cache)
    assert_step_logits_close(moved_logits, logits, moved, *own_k)
    with pytest.raises(AssertionError, match="relative error"):
        assert_step_logits_close(moved_logits, logits, moved)
    with pytest.raises(AssertionError, match="relative error"):
        assert_step_logits_close(moved_logits * 1.01, logits, moved, *own_k)


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["decode", "prefill"])
def test_an_empty_batch_on_gpu(entry):
    """An idle rank's step (B=0, T=0) at real sizes, strict: no pass raises, the Triton kernels left in the graph
    launch empty grids, the cache is untouched and no copy of it is made."""
    config = IndexerConfig.deepseek_v32(max_model_len=4096)
    layout = GPU_LAYOUTS["paged"]
    model = Indexer(config, layout).cuda()
    model.reset_parameters(torch.Generator().manual_seed(0))
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"nsa-gpu-empty-{entry}-"))
    fn = getattr(model, entry)
    step = compile_indexer(fn, {"nsa.layout": "paged", "nsa.page_size": layout.page_size, "nsa.strict": True,
                                "nsa.dump_dir": str(dump_dir)})
    pages = 8192 // layout.page_size
    batch = decode_batch(config, layout, [], max_len=2112, device="cuda", cache_pages=pages) if entry == "decode" \
        else prefill_batch(config, layout, [], device="cuda", cache_pages=pages)
    comp = batch.clone()
    with torch.no_grad():
        assert_gpu_step_close(fn, batch, layout, comp.kv_cache, step(*comp.args))
    assert torch.equal(comp.kv_cache, batch.kv_cache)
    (report,) = reports(dump_dir)
    assert rewrites(report)["quant_cache_store"] == 1 and report["cache_copies"] == 0, report


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["decode", "prefill"])
def test_verify_accepts_the_compiled_steps_on_gpu(entry):
    """``nsa.verify`` at real sizes with the Triton kernels: the K bytes that the reordering passes move (their sums
    against cuBLAS's) decode within the bound at B = 1, 2 and 64 and in prefills, so every verified call returns, and
    the steps equal eager as above."""
    config = IndexerConfig.deepseek_v32(max_model_len=4096)
    layout = GPU_LAYOUTS["paged"]
    model = Indexer(config, layout).cuda()
    model.reset_parameters(torch.Generator().manual_seed(0))
    eager_fn = getattr(model, entry)
    verified_fn = compile_indexer(eager_fn, {"nsa.layout": "paged", "nsa.page_size": layout.page_size,
                                             "nsa.verify": 100})
    if entry == "decode":
        cases = [decode_batch(config, layout, lens, max_len=2112, seed=seed, device="cuda", cache_pages=1088)
                 for seed, lens in ((5, [2049]), (6, [5, 700]), (7, [1 + 31 * i for i in range(64)]))]
    else:
        cases = gpu_cases(config, layout, entry)
    with torch.no_grad():
        for batch in cases:
            comp = batch.clone()
            assert_gpu_step_close(eager_fn, batch, layout, comp.kv_cache, verified_fn(*comp.args))


@pytest.mark.gpu
def test_compiled_decode_replayed_in_a_cuda_graph_equals_eager():
    """As engines run a decode step: captured once in a CUDA graph (where ``side_stream`` puts the K side on a second
    stream), replayed on new tokens, lengths, pages and cache copied into the captured inputs: equal to eager on each
    as the uncaptured step is."""
    config, layout, eager_fn, compiled_fn, dump_dir = compiled_gpu("deepseek_v32", "paged", "decode")
    batches = [decode_batch(config, layout, lens, max_len=2112, seed=seed, device="cuda", cache_pages=128)
               for seed, lens in ((1, [5, 700, 0, 2049]), (2, [2112, 1, 64, 999]), (3, [17, 2048, 300, 65]))]
    static = batches[0].clone()
    with torch.no_grad():
        compiled_fn(*batches[0].clone().args)  # compiled and warmed up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            c_logits, c_topk = compiled_fn(*static.args)
        for batch in batches[1:]:
            for buffer, value in zip(static.args, batch.args):
                buffer.copy_(value)
            graph.replay()
            assert_gpu_step_close(eager_fn, batch, layout, static.kv_cache, (c_logits, c_topk))
    for report in reports(dump_dir):
        assert {p["name"]: p["matched"] for p in report["passes"]}["side_stream"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["decode", "prefill"])
def test_cudagraph_trees_serve_steps_of_every_size(entry):
    """As the README serves a step: ``triton.cudagraphs``, one K cache marked static for every step, batches of
    changing sizes (one token, and an idle rank's empty step that writes nothing, among them; sizes seen again are
    replayed): each step's outputs and cache bytes are the uncaptured compiled step's, bit for bit (its agreement
    with eager: the tests above), and Inductor skips no graph (a host sync, or a written input that is not the
    static cache, would make it run the step uncaptured)."""
    torch._dynamo.reset()
    counters.clear()
    config, layout = IndexerConfig.deepseek_v32(max_model_len=4096), GPU_LAYOUTS["paged"]
    model = Indexer(config, layout).cuda()
    model.reset_parameters(torch.Generator().manual_seed(0))
    fn = getattr(model, entry)
    # (pad_mm forced, as in compiled_gpu: both compiles pad the same GEMMs, whatever its benchmark says)
    options = {"nsa.layout": "paged", "nsa.page_size": layout.page_size, "force_shape_pad": True}
    uncaptured = compile_indexer(fn, options)
    captured = torch.compile(fn, backend="nsa_rocm", options={**options, "triton.cudagraphs": True})
    pages = 1088  # the B=64 batch's contexts
    if entry == "decode":
        sizes = ([700, 5, 33], [], [2049], [1 + 31 * i for i in range(64)], [17, 2048, 300], [], [9, 4, 1000])
        batches = [decode_batch(config, layout, lens, max_len=2112, seed=seed, device="cuda", cache_pages=pages)
                   for seed, lens in enumerate(sizes)]
    else:
        sizes = ([300, 17], [], [1], [129, 64, 3], [40, 250], [], [1])
        batches = [prefill_batch(config, layout, lens, seed=seed, device="cuda", cache_pages=pages)
                   for seed, lens in enumerate(sizes)]
    cache = batches[0].kv_cache.clone()
    torch._dynamo.mark_static_address(cache)
    try:
        with torch.no_grad():
            for lens, batch in zip(sizes, batches):
                cache.copy_(batch.kv_cache)
                logits, topk = captured(*dataclasses.replace(batch, kv_cache=cache).args)
                want = batch.clone()
                want_logits, want_topk = uncaptured(*want.args)
                assert torch.equal(cache, want.kv_cache), f"{lens}: cache bytes differ"
                assert torch.equal(logits, want_logits) and torch.equal(topk, want_topk), f"{lens}: outputs differ"
                if not batch.slot_mapping.numel():
                    assert torch.equal(cache, batch.kv_cache), "an empty step wrote the cache"
    finally:
        torch._dynamo.reset()
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["decode", "prefill"])
def test_disabling_the_reordering_passes_keeps_eager_bytes_on_gpu(entry):
    """``nsa.disable_passes=["rotate_act_quant", "wk_gate_gemm"]``: the rotation and wk stay cuBLAS's, the cache
    bytes are eager's."""
    config, layout, eager_fn, compiled_fn, dump_dir = compiled_gpu("deepseek_v32", "paged", entry,
                                                                   ("rotate_act_quant", "wk_gate_gemm"))
    with torch.no_grad():
        for batch in gpu_cases(config, layout, entry):
            eager, comp = batch.clone(), batch.clone()
            logits, _ = eager_fn(*eager.args)
            c_logits, _ = compiled_fn(*comp.args)
            assert torch.equal(eager.kv_cache, comp.kv_cache), "K-cache bytes differ"
            assert_logits_close(c_logits, logits)
    for report in reports(dump_dir):
        assert not {"rotate_act_quant", "wk_gate_gemm"} & {p["name"] for p in report["passes"]}


@pytest.mark.gpu
def test_dynamic_true_on_gpu():
    """``dynamic=True`` with the Triton kernels: every pass fires with the cache shape guarded, another cache shape
    recompiles, and both equal eager (cache bytes within the reordering passes' bound)."""
    torch._dynamo.reset()
    config, layout = IndexerConfig.deepseek_v32(max_model_len=4096), GPU_LAYOUTS["paged"]
    model = Indexer(config, layout).cuda()
    model.reset_parameters(torch.Generator().manual_seed(0))
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix="nsa-gpu-dynamic-"))
    compiled_fn = torch.compile(model.decode, backend="nsa_rocm", dynamic=True, options={
        "nsa.layout": "paged", "nsa.page_size": layout.page_size, "nsa.dump_dir": str(dump_dir)})
    try:
        with torch.no_grad():
            for cache_pages in (128, 131):
                for batch in gpu_cases(config, layout, "decode", cache_pages):
                    comp = batch.clone()
                    assert_gpu_step_close(model.decode, batch, layout, comp.kv_cache, compiled_fn(*comp.args))
    finally:
        torch._dynamo.reset()
    graphs = reports(dump_dir)
    assert len(graphs) >= 2, "another cache shape compiles anew"
    for report in graphs:
        matched = rewrites(report)
        assert matched == EXPECTED_MATCHES["decode"], f"{report['graph']}: {report['passes']}"
        assert report["cache_copies"] == 0, f"{report['graph']}: {report['cache_copy_sites']}"


def _indices_only(model, entry: str = "decode"):
    """A step that returns only the top-k indices, as a serving engine's indexer does (the logits stay inside)."""
    step = getattr(model, entry)
    return lambda *args: step(*args)[1]


@pytest.mark.parametrize("entry, op", [("decode", torch.ops.nsa.paged_mqa_logits.default),
                                       ("prefill", torch.ops.nsa.mqa_logits.default)])
def test_a_step_returning_only_the_indices_leaves_the_masked_logits_unwritten(entry, op):
    """The top-k is then the logits op's only reader: where it scans each row up to its length only, the op is told
    not to write the masked columns past each row's last visible key (``write_masked=False``, docs/passes/
    topk_indices.md; the references write NaN there, which a top-k reading them would rank first); where the lengths
    are not known (next_n symbolic in the second decode graph) it writes them. The top-k sets are eager's. Where the
    logits are returned too (every other test here), they are written whole."""
    from helpers.pass_helpers import compile_with_dumps

    config, layout = CONFIGS["deepseek_v32"], LAYOUTS["paged"]
    model = Indexer(config, layout)
    model.reset_parameters(torch.Generator().manual_seed(0))
    fn = _indices_only(model, entry)
    compiled_fn, dump_dir = compile_with_dumps(fn, {"nsa.layout": "paged", "nsa.page_size": layout.page_size})
    for batch in batches(config, layout, entry):
        eager, comp = batch.clone(), batch.clone()
        torch._dynamo.mark_static(comp.kv_cache)
        _assert_same_sets(fn(*eager.args), compiled_fn(*comp.args))
    _assert_masked_columns_unwritten(dump_dir, op)


def _assert_masked_columns_unwritten(dump_dir: pathlib.Path, op) -> None:
    """In each graph, ``op`` writes the masked columns exactly where the top-k after it has no lengths; some has."""
    from helpers.pass_helpers import graph_dirs, pass_graphs

    unwritten = 0
    for graph_dir in graph_dirs(dump_dir):
        before, after = pass_graphs(graph_dir, "topk_indices")
        assert _write_masked(before, op)
        (topk,) = [line for line in after.splitlines() if "torch.ops.nsa.topk_indices." in line]
        lengths = ast.parse(topk.strip().split(";")[0]).body[0].value.args[2]
        with_lengths = not (isinstance(lengths, ast.Constant) and lengths.value is None)
        assert _write_masked(after, op) is not with_lengths
        unwritten += with_lengths
    assert unwritten


def _write_masked(source: str, op) -> bool:
    """``write_masked`` of a dumped graph's one call of ``op`` (positional or keyword; its default True)."""
    name = op._schema.name.replace("::", ".")
    (line,) = [line for line in source.splitlines() if f"torch.ops.{name}." in line]
    call = ast.parse(line.strip().split(";")[0]).body[0].value
    index = [a.name for a in op._schema.arguments].index("write_masked")
    given = {k.arg: k.value for k in call.keywords}.get("write_masked",
                                                          call.args[index] if len(call.args) > index else None)
    return True if given is None else ast.literal_eval(given)


@pytest.mark.gpu
@pytest.mark.parametrize("entry, op", [("decode", torch.ops.nsa.paged_mqa_logits.default),
                                       ("prefill", torch.ops.nsa.mqa_logits.default)])
def test_a_step_returning_only_the_indices_on_gpu(entry, op):
    """The same on the GPU: the logits kernels leave the masked columns past each row's end unwritten and the top-k,
    which reads each row up to its length only, gives eager's sets (>= 99 % of rows, as the other GPU steps)."""
    config = IndexerConfig.deepseek_v32(max_model_len=4096)
    layout = GPU_LAYOUTS["paged"]
    model = Indexer(config, layout).cuda()
    model.reset_parameters(torch.Generator().manual_seed(0))
    fn = _indices_only(model, entry)
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"nsa-gpu-indices-{entry}-"))
    compiled_fn = compile_indexer(fn, {"nsa.layout": "paged", "nsa.page_size": layout.page_size,
                                       "nsa.dump_dir": str(dump_dir)})
    with torch.no_grad():
        for batch in gpu_cases(config, layout, entry):
            _assert_same_sets(fn(*batch.clone().args), compiled_fn(*batch.clone().args), 0.99)
    _assert_masked_columns_unwritten(dump_dir, op)
