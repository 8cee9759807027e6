"""empty_logits_buffer: a full(-inf) buffer loses its fill only when every element is provably overwritten."""

import functools
import re
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import nsa_inductor  # noqa: F401  registers torch.ops.nsa
from nsa_inductor.indexer import Indexer, IndexerConfig
from nsa_inductor.layout import KCacheLayout
from nsa_inductor.patterns.empty_logits_buffer import EmptyLogitsBuffer
from nsa_inductor.workload import decode_batch
from helpers.other_indexer import OtherIndexer
from helpers import pass_helpers
from helpers.pass_helpers import assert_matches_eager, compile_with_dumps, count_ops, graph_dirs, pass_entry, pass_graphs
from helpers.reference64 import assert_logits_close

INF = float("-inf")
CONFIG = IndexerConfig.deepseek_v32().small()
LAYOUT = KCacheLayout(16)
ONLY_THIS = {"nsa.layout": "paged", "nsa.page_size": 16,
             "nsa.disable_passes": ["quant_cache_store", "paged_mqa_logits", "ragged_mqa_logits"]}


def run_pass(fn, *args):
    return pass_helpers.run_pass(EmptyLogitsBuffer(), count_fills, fn, *args)


def count_fills(gm) -> int:
    return sum(n.target is torch.ops.aten.full.default and len(n.args[0]) > 0 for n in gm.graph.nodes)


def reasons(result) -> str:
    return " | ".join(m["reason"] for m in result.near_misses)


def assert_same(a, b):
    if isinstance(a, (tuple, list)):
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert torch.equal(a, b)


@functools.cache
def decode_inputs(context_lens=(5, 33, 0, 17), max_len=48):
    batch = decode_batch(CONFIG, LAYOUT, list(context_lens), next_n=1, max_len=max_len, seed=1)
    gen = torch.Generator().manual_seed(4)
    q8 = torch.randn(len(context_lens), 1, CONFIG.n_heads, 128, generator=gen).to(CONFIG.fp8_dtype)
    w = torch.randn(len(context_lens), CONFIG.n_heads, generator=gen)
    return q8, batch.kv_cache, w, batch.lens, batch.block_table


# ---------------------------------------------------------------------------------------------------------------
# case (a): the write covers the whole buffer
# ---------------------------------------------------------------------------------------------------------------


@given(rows=st.integers(1, 5), cols=st.integers(1, 9), broadcast=st.booleans(), cast=st.booleans(),
       spelling=st.sampled_from(["copy", "slice", "slice_open"]))
def test_full_coverage_drops_the_fill(rows, cols, broadcast, cast, spelling):
    def fn(x):
        buf = torch.full((rows, cols), INF)
        src = x.to(torch.bfloat16) if cast else x
        if spelling == "copy":
            buf.copy_(src)
        elif spelling == "slice":
            buf[:, :cols] = src
        else:
            buf[:, 0:] = src
        return buf * 1

    x = torch.randn(cols) if broadcast else torch.randn(rows, cols)
    result, before, after, removed = run_pass(fn, x)
    assert_same(before, after)
    assert result.matched == removed == 1, reasons(result)


@pytest.mark.parametrize(
    "case, reason",
    [("partial", "partial write"), ("step", "partial write"), ("offset", "partial write"),
     ("read_first", "is read by"), ("one_row", "partial write"), ("first_row", "partial write"),
     ("one_row_of_one", None)],
)
def test_near_misses(case, reason):
    def fn(x):
        buf = torch.full((4, 8), INF)
        extra = ()
        if case == "partial":
            buf[:, :7] = x[:, :7]
        elif case == "step":
            buf[:, ::2] = x[:, ::2]
        elif case == "offset":
            buf[:, 1:] = x[:, 1:]
        elif case == "one_row":  # select_scatter into a dim of 4: the other rows keep the fill
            buf[2] = x[0]
        elif case == "first_row":  # (index 0: not a slice from 0 to the end)
            buf[0] = x[0]
        elif case == "one_row_of_one":  # select_scatter into a dim of 1 covers the buffer: no fill needed
            buf = torch.full((1, 8), INF)
            buf[0] = x[0]
        else:
            extra = (buf.amax(),)
            buf.copy_(x)
        return (buf * 1, *extra)

    result, before, after, removed = run_pass(fn, torch.randn(4, 8))
    assert_same(before, after)
    assert result.matched == int(reason is None), reasons(result)
    assert reason is None or (removed == 0 and reason in reasons(result)), reasons(result)


# ---------------------------------------------------------------------------------------------------------------
# case (b): nsa.paged_mqa_logits writes every element (-inf past each row's context)
# ---------------------------------------------------------------------------------------------------------------


def paged_into_buffer(q8, cache, w, ctx, bt, *, max_len=None, width=1024, write_end=None, extra_use=False, fill=INF,
                      write_start=0, rows_merged=False, write_step=1):
    m = bt.shape[1] * LAYOUT.page_size if max_len is None else max_len
    scores = torch.ops.nsa.paged_mqa_logits(q8, cache, w, ctx, bt, m, LAYOUT.page_size, False)
    if rows_merged:  # two rows a buffer row
        scores = scores.reshape(-1, 2 * m)
    logits = torch.full((scores.shape[0], width), fill)
    end = scores.shape[1] if write_end is None else write_end
    logits[:, write_start:write_start + write_step * end:write_step] = scores[:, :end]
    return (logits, scores.sum()) if extra_use else logits


@pytest.mark.parametrize("width", [48, 64, 1024])
def test_paged_logits_write_whole_buffer(width):
    args = decode_inputs()
    result, before, after, removed = run_pass(functools.partial(paged_into_buffer, width=width), *args)
    assert_same(before, after)
    assert result.matched == removed == 1, reasons(result)


@pytest.mark.parametrize(
    "kwargs, reason",
    [({"write_end": 47}, "not known to write -inf"),
     ({"max_len": 40}, "block table's reach"),
     ({"extra_use": True}, "also used elsewhere"),
     ({"fill": 0.0}, None),  # the op would write -inf past max_len; other fills than -inf are not reported
     ({"write_start": 4}, "fill whole rows from column 0"),
     ({"write_step": 2}, "fill whole rows from column 0"),
     ({"rows_merged": True}, "reshaped before the write")],
)
def test_paged_logits_near_misses(kwargs, reason):
    args = decode_inputs((5, 33, 0, 17) if "max_len" not in kwargs else (5, 30, 0, 17))
    result, before, after, removed = run_pass(functools.partial(paged_into_buffer, **kwargs), *args)
    assert_same(before, after)
    assert result.matched == removed == 0
    assert reason in reasons(result) if reason else not result.near_misses, reasons(result)


@functools.cache
def compiled_paged(write_end):
    fn = functools.partial(paged_into_buffer, write_end=write_end)
    compiled_fn, dump_dir = compile_with_dumps(fn, ONLY_THIS)
    return fn, compiled_fn, dump_dir


@pytest.mark.parametrize("write_end", [None, 47])
def test_compiled_paged_logits_buffer(write_end):
    fn, compiled_fn, dump_dir = compiled_paged(write_end)
    for lens in [(5, 33, 0, 17), (48, 1, 16, 47)]:
        args = decode_inputs(lens)
        expected, actual = fn(*args), compiled_fn(*args)
        assert torch.equal(expected.isneginf(), actual.isneginf())
        assert_logits_close(actual, expected)
    # the second batch has another cache size: a second (dynamic-shape) graph, checked the same way
    for graph_dir in graph_dirs(dump_dir):
        report = pass_entry(graph_dir, "empty_logits_buffer")
        before, after = pass_graphs(graph_dir, "empty_logits_buffer")
        if write_end is None:
            assert report["matched"] == 1, report
            assert count_ops(after, "aten.full") == count_ops(before, "aten.full") - 1
            assert count_ops(after, "aten.slice_scatter") == count_ops(before, "aten.slice_scatter") - 1
            assert re.search(r", 1024, 16, False[,)]", after), "the logits op now writes the buffer's full width"
        else:
            assert report["matched"] == 0 and count_ops(after, "aten.full") == count_ops(before, "aten.full")
            assert any("partial write" in m["reason"] for m in report["near_misses"])


# ---------------------------------------------------------------------------------------------------------------
# the indexers (decode allocates full((T, max_model_len), -inf) and writes [:, :max_len])
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def compiled_indexer(which, passes):
    model = Indexer(CONFIG, LAYOUT)
    model.reset_parameters(torch.Generator().manual_seed(0))
    if which == "other":
        model = OtherIndexer(CONFIG, LAYOUT.page_size).load_from(model)
    options = {"nsa.layout": "paged", "nsa.page_size": 16, "nsa.head_gate_mode": "off"}
    if passes == "only_this":
        options = {**ONLY_THIS, "nsa.head_gate_mode": "off"}
    compiled_fn, dump_dir = compile_with_dumps(model.decode, options)
    return model.decode, compiled_fn, dump_dir


@pytest.mark.parametrize("which", ["reference", "other"])
def test_indexer_decode(which):
    """Alone, the pass keeps the buffer (plain-torch logits write only [:, :max_len]) and says why; after the
    paged-logits pass has produced the nsa op, the fill is gone. Compiled equals eager either way."""
    for passes in ("only_this", "all"):
        eager_fn, compiled_fn, dump_dir = compiled_indexer(which, passes)
        batch = decode_batch(CONFIG, LAYOUT, [5, 33, 0, 17], next_n=1, max_len=48, seed=1)
        assert_matches_eager(eager_fn, compiled_fn, batch)
        (graph_dir,) = graph_dirs(dump_dir)
        report = pass_entry(graph_dir, "empty_logits_buffer")
        if passes == "only_this":
            assert report["matched"] == 0
            assert any("not known to write -inf" in m["reason"] for m in report["near_misses"]), report
        else:
            assert pass_entry(graph_dir, "paged_mqa_logits")["matched"] == 1
            assert report["matched"] == 1, report
            before, after = pass_graphs(graph_dir, "empty_logits_buffer")
            assert count_ops(after, "aten.full") == count_ops(before, "aten.full") - 1


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
