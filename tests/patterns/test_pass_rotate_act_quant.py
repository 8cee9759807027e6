"""rotate_act_quant: a 128x128 rotation feeding act_quant becomes nsa.rotate_act_quant (q) or the store's rotation
prologue (k); near misses keep the GEMM. On the CPU the ops run eager's math (the torch reference), so compiled
equals eager byte for byte here; the GPU kernels' bound is in tests/lowering (docs/numerics.md)."""

import functools
import math
import re

import pytest
import torch
import torch.nn.functional as F

from nsa_inductor.indexer import hadamard_matrix
from nsa_inductor.layout import KCacheLayout
from nsa_inductor.patterns.rotate_act_quant import RotateActQuant
from nsa_inductor.quant import act_quant
from nsa_inductor.workload import decode_batch, prefill_batch
from helpers.models import CACHE_SLOTS, CONFIGS, LAYOUTS, batches, compiled, other
from helpers.pass_helpers import (assert_matches_eager, compile_with_dumps, count_ops, graph_dirs, near_miss_reasons,
                                  pass_entry, pass_graphs, run_pass)

H32 = hadamard_matrix(128)
C = 128**-0.5


def gemms(gm) -> int:
    return sum(n.target is torch.ops.aten.mm.default for n in gm.graph.nodes)


def fused(gm) -> int:
    return sum(n.target is torch.ops.nsa.rotate_act_quant.default for n in gm.graph.nodes)


# Spellings of the rotation followed by act_quant; each returns (values, scale) and maybe more.
SPELLINGS = {
    "fp32-gemm-times-c": (lambda x, h: act_quant((x.float() @ h * C).to(torch.bfloat16)), H32),
    "fp32-gemm-div-sqrt": (lambda x, h: act_quant((x.float() @ h / math.sqrt(128)).to(torch.bfloat16)), H32),
    "fp32-linear-transposed": (lambda x, h: act_quant((F.linear(x.float(), h) * C).to(torch.bfloat16)), H32.t()),
    "fp32-gemm-no-scale-block-32": (lambda x, h: act_quant((x.float() @ h).to(torch.bfloat16), 32), H32),
    "fp32-gemm-other-constant": (lambda x, h: act_quant((x.float() @ h * 0.37).to(torch.bfloat16)), H32),
    "fp32-gemm-of-bf16-matrix": (lambda x, h: act_quant((x.float() @ h.float().t() * C).to(torch.bfloat16)),
                                 H32.bfloat16()),
    "bf16-linear": (lambda x, h: act_quant(F.linear(x, h)), H32.bfloat16()),
    "bf16-matmul": (lambda x, h: act_quant(x @ h), H32.bfloat16()),
    "fnuz-224-fp32-scale": (lambda x, h: act_quant((x.float() @ h * C).to(torch.bfloat16), 128, "fp32",
                                                   torch.float8_e4m3fnuz, 224.0), H32),
    "any-static-matrix": (lambda x, h: act_quant((x.float() @ h * C).to(torch.bfloat16)),
                          torch.randn(128, 128, generator=torch.Generator().manual_seed(1))),
}


def rows(shape, seed=0):
    return torch.randn(*shape, 128, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("shape", [(5, 4), (3,), (1, 1)])
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_every_spelling_fuses_and_keeps_eager_bytes(spelling, shape):
    fn, matrix = SPELLINGS[spelling]
    x = rows(shape)
    result, before, after, removed = run_pass(RotateActQuant(), gemms, fn, x, matrix)
    assert result.matched == 1 and not result.near_misses, result
    assert removed == 1, "the rotation GEMM is still there"
    for got, want in zip(after, before):
        assert torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got,
                           want.view(torch.uint8) if want.dtype.itemsize == 1 else want)


def _rotation_read_twice(x, h):
    y = (x.float() @ h * C).to(torch.bfloat16)
    return (*act_quant(y), y.sum())


def _act_quant_amax_read_elsewhere(x, h):
    y = (x.float() @ h * C).to(torch.bfloat16)
    amax = y.float().abs().amax(-1)
    return (*act_quant(y), amax)


def _matrix_computed_in_graph(x, h):
    return act_quant((x.float() @ (h * 2) * C).to(torch.bfloat16))


def _not_128_rows(x, h):
    return act_quant((x.float().reshape(-1, 256) @ h * C).to(torch.bfloat16))


def _wider_product(x, h):
    """Rows of 128 times a [128, 256] matrix: two quant blocks a row, not a rotation of each row."""
    return act_quant((x.float() @ h * C).to(torch.bfloat16))


def _scaled_before_the_product(x, h):
    """fp32 rows that are not x's upcast (x * 2): the op would take x itself."""
    return act_quant(((x.float() * 2) @ h * C).to(torch.bfloat16))


def _unrounded_fp32(x, h):
    return act_quant(x.float() @ h * C)


def _bf16_product_scaled(x, h):
    return act_quant(F.linear(x, h) * C)


def _groups_of_8(x, h):
    return act_quant((x.float() @ h * C).to(torch.bfloat16), 8)


def _rotation_without_act_quant(x, h):
    return (x.float() @ h * C).to(torch.bfloat16)


NEAR_MISSES = {
    "rotation-read-elsewhere": (_rotation_read_twice, H32, "also read elsewhere"),
    "act-quant-input-read-elsewhere": (_act_quant_amax_read_elsewhere, H32, "fusing would keep its GEMM"),
    "matrix-computed-in-graph": (_matrix_computed_in_graph, H32, "computed in the graph"),
    "matrix-256": (_not_128_rows, torch.eye(256), "not rows of 128"),
    "matrix-128-by-256": (_wider_product, torch.randn(128, 256, generator=torch.Generator().manual_seed(2)),
                          "not a static [128, 128]"),
    "unrounded-fp32": (_unrounded_fp32, H32, "not the bf16 result of a rotation"),
    "scaled-before-the-product": (_scaled_before_the_product, H32, "not a bf16 tensor cast to fp32"),
    "bf16-product-scaled": (_bf16_product_scaled, H32.bfloat16(), "not a product with a matrix (mul"),
    "groups-of-8": (_groups_of_8, H32, "quant block is 8 wide"),
}


@pytest.mark.parametrize("case", sorted(NEAR_MISSES))
def test_near_misses_keep_the_gemm(case):
    fn, matrix, reason = NEAR_MISSES[case]
    result, before, after, removed = run_pass(RotateActQuant(), gemms, fn, rows((4, 2)), matrix)
    assert result.matched == 0 and removed == 0
    assert any(reason in m["reason"] for m in result.near_misses), result.near_misses
    for got, want in zip(after, before):
        assert torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got,
                           want.view(torch.uint8) if want.dtype.itemsize == 1 else want)


def test_a_rotation_without_act_quant_is_left_alone():
    result, _, _, removed = run_pass(RotateActQuant(), gemms, _rotation_without_act_quant, rows((4,)), H32)
    assert result.matched == 0 and removed == 0 and not result.near_misses


# --- compiled: size-1 shapes, the k side through quant_cache_store, and the indexers --------------------------

LAYOUT = KCacheLayout(16)
STORE_OPTIONS = {"nsa.layout": "paged", "nsa.page_size": 16}


def q_path(x, h, gates):
    """The q side as the indexer spells it: rotation, act_quant, the scale into the head-gate chain."""
    q_fp8, q_scale = act_quant((x.float() @ h * C).to(torch.bfloat16))
    return q_fp8, gates * q_scale.squeeze(-1) * C


def k_path(x, h, slots, cache):
    """The k side: rotation (``/ sqrt(128)``), act_quant, store."""
    k_fp8, k_scale = act_quant((x.float() @ h / math.sqrt(128)).to(torch.bfloat16))
    LAYOUT.store(cache, slots, k_fp8, k_scale.squeeze(-1))


def k_fp16_path(x, h, slots, cache):
    """The k side rounded to fp16: the fused rotation rounds to bf16."""
    k_fp8, k_scale = act_quant((x.float() @ h / math.sqrt(128)).to(torch.float16))
    LAYOUT.store(cache, slots, k_fp8, k_scale.squeeze(-1))


def q_values_path(x, h):
    """The q side whose scale nothing reads but its own values (weights without q's scale)."""
    return act_quant((x.float() @ h * C).to(torch.bfloat16))[0]


@functools.cache
def compiled_path(name, disabled=()):
    fn = {"q": q_path, "k": k_path, "k_fp16": k_fp16_path, "q_values": q_values_path}[name]
    options = {**STORE_OPTIONS, "nsa.disable_passes": list(disabled)}
    return fn, *compile_with_dumps(fn, options, dynamic=False)


@pytest.mark.parametrize("tokens", [1, 7])
def test_q_side_compiled_at_size_one_and_more(tokens):
    fn, compiled_fn, dump_dir = compiled_path("q")
    x, gates = rows((tokens, 4), seed=tokens), torch.rand(tokens, 4)
    want, got = fn(x, H32, gates), compiled_fn(x, H32, gates)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    graph = [g for g in graph_dirs(dump_dir) if f"[{tokens}, 4, 128]" in (g / "00_input.py").read_text()][0]
    before, after = pass_graphs(graph, "rotate_act_quant")
    assert pass_entry(graph, "rotate_act_quant")["matched"] == 1
    assert count_ops(before, "aten.mm") == 1 and count_ops(after, "aten.mm") == 0
    assert count_ops(after, "nsa.rotate_act_quant") == 1


def test_q_side_whose_scale_only_its_values_read():
    """Replacing the values drops the old scale: the fused op's outputs must not be placed relative to it (the graph
    would lose a node in Inductor's topological sort after the passes)."""
    fn, compiled_fn, dump_dir = compiled_path("q_values")
    x = rows((5, 4))
    assert torch.equal(compiled_fn(x, H32).view(torch.uint8), fn(x, H32).view(torch.uint8))
    assert pass_entry(graph_dirs(dump_dir)[0], "rotate_act_quant")["matched"] == 1


@pytest.mark.parametrize("tokens", [1, 9])
def test_k_side_store_takes_the_rotation(tokens):
    fn, compiled_fn, dump_dir = compiled_path("k")
    gen = torch.Generator().manual_seed(tokens)
    x, slots = rows((tokens,), seed=tokens), torch.randperm(64, generator=gen)[:tokens]
    cache = torch.randint(0, 256, (4, LAYOUT.page_bytes), dtype=torch.uint8, generator=gen)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    fn(x, H32, slots, eager_cache)
    compiled_fn(x, H32, slots, compiled_cache)
    assert torch.equal(eager_cache, compiled_cache)
    graph = [g for g in graph_dirs(dump_dir) if f"[{tokens}, 128]" in (g / "00_input.py").read_text()][0]
    assert pass_entry(graph, "quant_cache_store")["matched"] == 1
    before, after = pass_graphs(graph, "rotate_act_quant")
    assert count_ops(before, "aten.mm") == 1 and count_ops(after, "aten.mm") == 0
    assert "rotation = " in after and "input_divide = True" in after


def k_path_graph(name, disabled=()):
    """9 tokens through the compiled k path ``name``: the cache bytes equal eager's; returns the graph's dump."""
    fn, compiled_fn, dump_dir = compiled_path(name, disabled)
    x, slots = rows((9,)), torch.arange(9)
    cache = torch.zeros(4, LAYOUT.page_bytes, dtype=torch.uint8)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    fn(x, H32, slots, eager_cache)
    compiled_fn(x, H32, slots, compiled_cache)
    assert torch.equal(eager_cache, compiled_cache)
    (graph,) = graph_dirs(dump_dir)
    return graph


def test_a_k_side_rounded_to_fp16_keeps_the_gemm():
    graph = k_path_graph("k_fp16")
    assert pass_entry(graph, "quant_cache_store")["matched"] == 1
    entry = pass_entry(graph, "rotate_act_quant")
    assert entry["matched"] == 0
    assert any("input_dtype torch.float16" in m["reason"] for m in entry["near_misses"]), entry


def test_disabling_the_pass_keeps_the_gemm_and_eager_bytes():
    output = (k_path_graph("k", disabled=("rotate_act_quant",)) / "99_output.py").read_text()
    assert count_ops(output, "aten.mm") == 1 and "rotation = " not in output


@pytest.mark.parametrize("sequences", [4, 1])
@pytest.mark.parametrize("which", ["reference", "other"])
def test_fires_on_both_indexers(which, sequences):
    """q and k of the reference indexer (``x.float() @ H * c``) and of ``OtherIndexer`` (``F.linear(x.float(),
    H^T) / sqrt(128)``): both rotation GEMMs gone, and the rotation inside nsa.rotate_act_quant (q) and the store
    (k); at B = 1 too, where the store may not fire and k's act_quant becomes an nsa.rotate_act_quant instead."""
    config, layout = CONFIGS["deepseek_v32"], LAYOUTS["paged"]
    eager_fn, compiled_fn, dump_dir = compiled("deepseek_v32", "paged", "decode") if which == "reference" else \
        other("paged", "decode")
    batch = batches(config, layout, "decode")[0] if sequences == 4 else decode_batch(
        config, layout, [33], max_len=48, seed=7, cache_pages=CACHE_SLOTS // layout.page_size)
    assert_matches_eager(eager_fn, compiled_fn, batch)
    # the graph of this batch size, or (the shared model may have been recompiled by earlier tests) a dynamic one,
    # whose dump names the size by its placeholder
    shape = re.compile(rf"\[({sequences}|s\d+|arg\d+_\d+), {config.n_heads}, 128\]" if sequences > 1
                       else rf"\[1, {config.n_heads}, 128\]")
    graph = [g for g in graph_dirs(dump_dir) if shape.search((g / "00_input.py").read_text())][-1]
    before, after = pass_graphs(graph, "rotate_act_quant")
    assert pass_entry(graph, "rotate_act_quant")["matched"] == 2
    assert count_ops(before, "aten.mm") - count_ops(after, "aten.mm") == 2
    stores_rotate = "rotation = " in after
    assert count_ops(after, "nsa.rotate_act_quant") == (1 if stores_rotate else 2)


def test_no_near_miss_report_for_fp8_casts_of_other_idioms():
    """Near misses name a reason; the pass never fires where nothing is rotated."""
    def plain(x):
        return act_quant(x)

    compiled_fn, dump_dir = compile_with_dumps(plain, dynamic=False)
    compiled_fn(rows((3,)))
    reasons = near_miss_reasons(dump_dir, "rotate_act_quant")
    assert reasons and all("not a product with a matrix" in r for r in reasons)


def test_fires_on_a_one_token_prefill():
    """T = 1 (Dynamo specialises the size-1 token dimension): both rotations still fused, bytes equal eager."""
    config, layout = CONFIGS["deepseek_v32"], LAYOUTS["paged"]
    eager_fn, compiled_fn, dump_dir = compiled("deepseek_v32", "paged", "prefill")
    batch = prefill_batch(config, layout, [1], seed=9, cache_pages=CACHE_SLOTS // layout.page_size)
    assert_matches_eager(eager_fn, compiled_fn, batch)
    # (other tests share this compiled function: one-token graphs of other shapes may be there too, in a worker's order)
    graphs = [g for g in graph_dirs(dump_dir) if f"[1, {config.n_heads}, 128]" in (g / "00_input.py").read_text()]
    assert graphs, "no one-token graph"
    for graph in graphs:
        before, after = pass_graphs(graph, "rotate_act_quant")
        assert pass_entry(graph, "rotate_act_quant")["matched"] == 2
        assert count_ops(before, "aten.mm") - count_ops(after, "aten.mm") == 2
