"""topk_indices: the indexer's top-k idiom becomes one nsa.topk_indices call; near misses keep torch.topk."""

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nsa_inductor.patterns import topk_indices
from nsa_inductor.patterns.topk_indices import TopkIndices
from helpers import pass_helpers

INF = float("-inf")
HYP = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def masked_logits(rows: int, cols: int, inf: float, seed: int) -> torch.Tensor:
    """Distinct values (no ties at the k-th value), about a fraction ``inf`` of them -inf."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randperm(rows * cols, generator=gen).float().view(rows, cols)
    return torch.where(torch.rand(rows, cols, generator=gen) < inf, INF, values)


@st.composite
def topk_cases(draw):
    rows, cols = draw(st.integers(1, 5)), draw(st.integers(1, 80))
    logits = masked_logits(rows, cols, draw(st.sampled_from([0, 0.3, 1.0])), draw(st.integers(0, 99)))
    offset = torch.tensor(draw(st.lists(st.integers(0, 4), min_size=rows, max_size=rows)))
    return logits, draw(st.integers(0, cols)), offset


def count_topk(gm) -> int:
    """topk nodes, and the sorts a sorted cut spells top-k with."""
    aten = torch.ops.aten
    return sum(n.target in (aten.topk.default, aten.sort.default, aten.sort.stable) for n in gm.graph.nodes)


def run_pass(fn, *args, order="sorted"):
    return pass_helpers.run_pass(TopkIndices(order), count_topk, fn, *args)


def indexer_topk(logits, k):
    values, indices = torch.topk(logits, k, dim=-1)
    return indices.masked_fill(values == INF, -1).to(torch.int32)


def indexer_topk_with_offset(logits, offset, k):
    values, indices = torch.topk(logits, k, dim=-1)
    indices = indices - offset[:, None]
    return indices.masked_fill(values == INF, -1).to(torch.int32)


def where_spelling_int64(logits, offset, k):
    values, indices = logits.topk(k)
    return torch.where(values.isneginf(), -1, indices - offset.view(-1, 1))


def not_neg_inf_spelling(logits, k):
    values, indices = torch.topk(logits, k)
    return torch.where(values != INF, indices, -1).to(torch.int32)


def indexer_topk_uint8(logits, k):
    """Cast to uint8 (-1 becomes 255): the op's int32 output may replace only a cast to int32."""
    values, indices = torch.topk(logits, k, dim=-1)
    return indices.masked_fill(values == INF, -1).to(torch.uint8)


def int32_then_offset(logits, offset, k):
    """The indices and the offset cast to int32 before the subtraction: int32 all along."""
    values, indices = torch.topk(logits, k)
    return (indices.to(torch.int32) - offset[:, None].to(torch.int32)).masked_fill(values == INF, -1)


def int32_minus_int64_offset(logits, offset, k):
    """int32 indices minus an int64 offset: torch promotes the difference to int64."""
    values, indices = torch.topk(logits, k)
    return torch.where(values == INF, -1, indices.int() - offset.view(-1, 1))


def int32_without_offset(logits, k):
    values, indices = torch.topk(logits, k)
    return torch.where(values != INF, indices.int(), -1)


def as_rows(t: torch.Tensor) -> list[list[int]]:
    return [sorted(r) for r in t.tolist()]


@HYP
@given(topk_cases())
def test_fires_and_keeps_the_sets(case):
    logits, k, offset = case
    for fn, args in ((lambda x: indexer_topk(x, k), (logits,)),
                     (lambda x, o: indexer_topk_with_offset(x, o, k), (logits, offset)),
                     (lambda x, o: topk_indices.search(x, o, k), (logits, offset)),
                     (lambda x, o: where_spelling_int64(x, o, k), (logits, offset)),
                     (lambda x: not_neg_inf_spelling(x, k), (logits,)),
                     (lambda x: indexer_topk_uint8(x, k), (logits,)),
                     (lambda x, o: int32_then_offset(x, o, k), (logits, offset)),
                     (lambda x, o: int32_minus_int64_offset(x, o, k), (logits, offset)),
                     (lambda x: int32_without_offset(x, k), (logits,))):
        result, before, after, removed = run_pass(fn, *args)
        assert (result.matched, removed) == (1, 1), result.near_misses
        # distinct finite values: torch's descending order is the only one, and the -1 entries come last
        assert after.dtype == before.dtype and torch.equal(after, before)
        result, before, after, _ = run_pass(fn, *args, order="set")
        assert result.matched == 1 and as_rows(after) == as_rows(before)


def plain_indices(logits, k):
    return torch.topk(logits, k).indices


def plain_method_getitem(logits, k):
    return logits.topk(k, dim=-1)[1]


def plain_unsorted(logits, k):
    return torch.topk(logits, k, sorted=False)[1]


def sort_cut(logits, k):
    return torch.sort(logits, descending=True, stable=False)[1][..., :k]


def assert_plain_topk(got, logits, k, sorted_):
    """torch.topk's contract: k distinct columns, values >= every unselected one, -inf entries keep columns."""
    assert got.dtype == torch.int64
    for row, idx in zip(logits.tolist(), got.tolist()):
        assert len(set(idx)) == k and all(0 <= c < len(row) for c in idx)
        picked = [row[c] for c in idx]
        rest = [v for c, v in enumerate(row) if c not in set(idx)]
        assert not rest or not picked or min(picked) >= max(rest)
        if sorted_:
            assert picked == sorted(picked, reverse=True)


@HYP
@given(topk_cases())
def test_fires_on_plain_spellings(case):
    """Values unused: the op keeps torch's semantics (columns of -inf entries, never -1; torch's order)."""
    logits, k, _ = case
    for fn, sorted_ in ((plain_indices, True), (plain_method_getitem, True), (plain_unsorted, False),
                        (topk_indices.search_sorted_cut, True), (sort_cut, True)):
        result, before, after, removed = run_pass(lambda x: fn(x, k), logits)
        assert (result.matched, removed) == (1, 1), result.near_misses
        assert_plain_topk(after, logits, k, sorted_)
        if sorted_:  # distinct finite values: the finite part of the order is torch's
            finite = (torch.gather(logits, 1, before) != INF)
            assert torch.equal(after[finite], before[finite])


def hf_indices(logits, k):
    """Hugging Face's DeepSeek-V3.2 indexer: scores [B, S, T], plain indices cast to int32."""
    return logits.topk(k, dim=-1).indices.to(torch.int32)


@pytest.mark.parametrize("shape", [(40,), (1, 1, 40), (1, 3, 40), (2, 1, 40), (2, 3, 40), (2, 1, 3, 40), (0, 1, 40),
                                   (3, 0, 40)])
@pytest.mark.parametrize("fn, sorted_, pad", [(hf_indices, True, "column"), (plain_unsorted, False, "column"),
                                              (sort_cut, True, "column"), (indexer_topk, True, "neg1")])
def test_fires_on_logits_of_other_ranks(shape, fn, sorted_, pad):
    """Logits of one row or of leading dims (sizes 1 and 0 included: Dynamo specialises them) are rows too: the op
    reads their [-1, T] view, the indices come back in the logits' leading dims, with torch's values (sorted: the
    finite part in torch's order; the -1 idiom: equal) and dtype (HF's int32 cast: the op's own output, no cast
    left)."""
    logits = masked_logits(1, 40, 0.3, seed=sum(shape)).view(-1).repeat(len(shape) * 6)[:torch.Size(shape).numel()]
    logits = (logits + torch.arange(logits.numel()) * 1000.0).view(shape)  # distinct values, -inf kept
    gm = pass_helpers.functional_graph(lambda x: fn(x, 7), logits)
    before, removed = gm(logits), count_topk(gm)
    result = TopkIndices()(gm.graph, None)
    gm.recompile()
    after, removed = gm(logits), removed - count_topk(gm)
    assert (result.matched, removed) == (1, 1), result.near_misses
    assert after.shape == before.shape and after.dtype == before.dtype
    casts = [n for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default]
    assert len(casts) == (before.dtype == torch.int64)  # int32 asked for: the op's output, no cast either way
    rows, got, want = logits.reshape(-1, 40), after.reshape(-1, 7), before.reshape(-1, 7)
    if pad == "neg1":
        assert torch.equal(got, want)
        return
    assert_plain_topk(got.long(), rows, 7, sorted_)
    finite = torch.gather(rows, 1, want.long()) != INF
    if sorted_:
        assert torch.equal(got[finite], want[finite])


def offset_per_batch(logits):
    values, indices = torch.topk(logits, 3)
    return (indices - torch.arange(2)[:, None, None]).masked_fill(values == INF, -1)


@pytest.mark.parametrize("fn, width, reason", [
    (offset_per_batch, 10, "not one integer offset per row"),
    (lambda x: torch.topk(x, 3, dim=1).indices, 10, "dim other than the last"),
    (lambda x: torch.topk(x, 0).indices, 0, r"logits \[2, 3, 0\] have no column"),
])
def test_near_misses_of_other_ranks(fn, width, reason):
    """[B, S, T] logits: a per-row offset (a 2-D idiom), a top-k over S and rows of no column stay torch's, the
    reason reported."""
    logits = masked_logits(6, width, 0.3, seed=5).view(2, 3, width)
    result, before, after, removed = run_pass(fn, logits)
    assert (result.matched, removed) == (0, 0)
    assert re.search(reason, result.near_misses[0]["reason"]), result.near_misses
    assert torch.equal(after, before)


def topk_logits_small():
    logits = torch.arange(24.0).view(4, 6).flip(1)
    logits[1, 2:] = INF
    return logits


def plain_values_returned(logits):
    return torch.topk(logits, 3)


def values_also_returned(logits):
    values, indices = torch.topk(logits, 3)
    return values, indices.masked_fill(values == INF, -1)


def smallest(logits):
    values, indices = torch.topk(logits, 3, largest=False)
    return indices.masked_fill(values == INF, -1)


def other_fill(logits):
    values, indices = torch.topk(logits, 3)
    return indices.masked_fill(values == INF, -2)


def other_test(logits):
    values, indices = torch.topk(logits, 3)
    return indices.masked_fill(values < 0, -1)


def above_neg_inf_test(logits):
    """``values > -inf`` is false for NaN too: a NaN's index becomes -1, which the op keeps."""
    values, indices = torch.topk(logits, 3)
    return torch.where(values > INF, indices, -1)


def not_neg_inf_other_fill(logits):
    values, indices = torch.topk(logits, 3)
    return torch.where(values != INF, -1, indices)


def per_element_offset(logits):
    values, indices = torch.topk(logits, 3)
    return (indices - indices.flip(0)).masked_fill(values == INF, -1)


def scaled_offset(logits):
    values, indices = torch.topk(logits, 3)
    return torch.sub(indices, torch.arange(4)[:, None], alpha=2).masked_fill(values == INF, -1)


def gathered_offset(logits):
    """``o[i[:, None]]`` is one value per row, but another row's: the same shape as ``o[:, None]``, not a view."""
    values, indices = torch.topk(logits, 3)
    offset = torch.arange(4) * 2
    return (indices - offset[torch.arange(3, -1, -1)[:, None]]).masked_fill(values == INF, -1)


def float_offset(logits):
    """A per-row offset of floats: the indices become floats, which the op (int32 indices) cannot give."""
    values, indices = torch.topk(logits, 3)
    return (indices - (torch.arange(4.0) * 0.5)[:, None]).masked_fill(values == INF, -1)


def column_offset(logits):
    """An offset per output column (k of them), not per row."""
    values, indices = torch.topk(logits, 3)
    return (indices - torch.arange(3).view(1, -1)).masked_fill(values == INF, -1)


def indices_read_twice(logits):
    values, indices = torch.topk(logits, 3)
    return indices.masked_fill(values == INF, -1), indices * 2


def first_dim(logits):
    values, indices = torch.topk(logits, 3, dim=0)
    return indices.masked_fill(values == INF, -1)


def bf16_logits(logits):
    values, indices = torch.topk(logits.bfloat16(), 3)
    return indices.masked_fill(values == INF, -1)


def stable_sort_cut(logits):
    """Ties in column order: the op's sorted order breaks them otherwise."""
    return torch.sort(logits, descending=True, stable=True)[1][:, :3]


def ascending_sort_cut(logits):
    return logits.argsort(dim=-1)[:, :3]


def sorted_values_used(logits):
    values, indices = logits.sort(dim=-1, descending=True)
    return values[:, :3], indices[:, :3]


def sort_cut_with_step(logits):
    return logits.argsort(dim=-1, descending=True)[:, :4:2]


def first_dim_sort_cut(logits):
    return logits.argsort(dim=0, descending=True)[:, :3]


def hf_scores_and_indices(logits):  # Hugging Face's newest indexer: [B, S, T] scores, both outputs returned
    scores = logits.view(2, 2, 6)
    values, indices = scores.topk(3, dim=-1)
    return indices.to(torch.int32), values


def unsorted_values_summed(logits):
    values, indices = torch.topk(logits, 3, sorted=False)
    return indices, values.sum(-1)


@pytest.mark.parametrize("fn", [plain_values_returned, values_also_returned, other_test, hf_scores_and_indices,
                                unsorted_values_summed])
def test_values_used_otherwise_are_gathered_from_the_logits(fn):
    """Top-k values used for anything but the masked idiom's -inf test (returned, compared, summed) are the logits
    at the op's indices: torch's values in torch's order; the indices are torch's where the values are distinct
    and finite (row 1's -inf picks: any of its -inf columns, as torch's)."""
    logits = topk_logits_small()
    result, before, after, removed = run_pass(fn, logits)
    assert (result.matched, result.near_misses, removed) == (1, [], 1)
    pair = (before, after) if isinstance(before, tuple) else ((before,), (after,))
    for b, a in zip(*pair):
        assert a.dtype == b.dtype and a.shape == b.shape
        if b.is_floating_point():
            assert torch.equal(a, b)
        else:
            rows_a, rows_b = a.reshape(4, -1)[[0, 2, 3]], b.reshape(4, -1)[[0, 2, 3]]
            if fn is unsorted_values_summed:  # (any order: the same set)
                rows_a, rows_b = rows_a.sort(-1).values, rows_b.sort(-1).values
            assert torch.equal(rows_a, rows_b)
            picks = set(a.reshape(4, -1)[1].tolist())
            assert picks >= {0, 1} and len(picks) == 3


@pytest.mark.parametrize("fn", [indexer_topk, not_neg_inf_spelling])
def test_nan_entries_keep_their_index(fn):
    """``NaN == -inf`` is false and ``NaN != -inf`` true: a selected NaN keeps its column in both masked spellings,
    as in the op (NaN ranks first, as in torch.topk)."""
    logits = topk_logits_small()
    logits[0, 1] = logits[2, 4] = float("nan")
    result, before, after, _ = run_pass(lambda x: fn(x, 3), logits)
    assert result.matched == 1 and torch.equal(after, before)
    assert before[0, 0] == 1 and before[2, 0] == 4


@pytest.mark.parametrize("fn, reason", [
    (smallest, "largest=False"),
    (other_fill, "not replaced by -1"),
    (above_neg_inf_test, "false for NaN too"),
    (not_neg_inf_other_fill, "not replaced by -1"),
    (per_element_offset, "not one integer offset per row"),
    (scaled_offset, "not one integer offset per row|not to the top-k indices"),
    (gathered_offset, "not one integer offset per row"),
    (float_offset, "not one integer offset per row"),
    (column_offset, "not one integer offset per row"),
    (indices_read_twice, "indices have other users"),
    (first_dim, "dim other than the last"),
    (bf16_logits, "must be fp32"),
    (stable_sort_cut, "a stable sort"),
    (ascending_sort_cut, "ascending"),
    (sorted_values_used, "sorted values are used"),
    (sort_cut_with_step, "not cut once to their first k columns"),
    (first_dim_sort_cut, "a dim other than the last"),
])
def test_near_misses_keep_torch_topk(fn, reason):
    logits = topk_logits_small()
    result, before, after, removed = run_pass(fn, logits)
    assert (result.matched, removed) == (0, 0)
    assert len(result.near_misses) == 1
    assert re.search(reason, result.near_misses[0]["reason"]), result.near_misses
    for a, b in zip(before if isinstance(before, tuple) else (before,), after if isinstance(after, tuple) else (after,)):
        assert torch.equal(a, b)



def test_one_compile_serves_every_row_count():
    """Decode's row count (tokens) is dynamic; the logits width and k are not. One graph, the op in it, sets kept."""
    from helpers.pass_helpers import compile_with_dumps, graph_dirs, pass_entry

    compiled, dump_dir = compile_with_dumps(lambda x: indexer_topk(x, 5), dynamic=True)
    for rows in (3, 17, 300):
        logits = masked_logits(rows, 40, 0.3, seed=rows)
        assert as_rows(compiled(logits)) == as_rows(indexer_topk(logits, 5))
    (graph_dir,) = graph_dirs(dump_dir)
    assert pass_entry(graph_dir, "topk_indices")["matched"] == 1


def test_one_compile_serves_every_batch_of_scores_by_token():
    """Hugging Face's spelling over [B, S, T] scores, batch and tokens dynamic (then B=1, S=1: Dynamo's size-1
    graph): the op in each graph, the int32 indices torch's (distinct finite values: the same order)."""
    from helpers.pass_helpers import compile_with_dumps, graph_dirs, pass_entry

    compiled, dump_dir = compile_with_dumps(lambda x: hf_indices(x, 5), dynamic=True)
    for shape in ((2, 3, 40), (4, 7, 40), (1, 1, 40)):
        logits = torch.randperm(torch.Size(shape).numel(), generator=torch.Generator().manual_seed(1)).float()
        logits = logits.view(shape)
        got = compiled(logits)
        assert got.dtype == torch.int32 and torch.equal(got, hf_indices(logits, 5))
    for graph_dir in graph_dirs(dump_dir):
        assert pass_entry(graph_dir, "topk_indices")["matched"] == 1


def test_a_compiled_sorted_cut_is_rewritten():
    """``argsort(descending=True)[:, :k]`` compiled: the op in the graph (no sort left), torch's order and columns."""
    from helpers.pass_helpers import compile_with_dumps, graph_dirs, pass_entry, pass_graphs

    compiled, dump_dir = compile_with_dumps(lambda x: topk_indices.search_sorted_cut(x, 5), dynamic=False)
    logits = masked_logits(3, 40, 0.3, seed=7)
    assert torch.equal(compiled(logits), topk_indices.search_sorted_cut(logits, 5))
    (graph_dir,) = graph_dirs(dump_dir)
    assert pass_entry(graph_dir, "topk_indices")["matched"] == 1
    assert "aten.sort" not in pass_graphs(graph_dir, "topk_indices")[1]


def paged_topk(q8, cache, w, ctx, bt, *, also_logits):
    logits = torch.ops.nsa.paged_mqa_logits(q8, cache, w, ctx, bt, 48, 16, False)
    if also_logits == "values":  # the values gathered from the logits at the picks, -inf columns among them
        values, idx = logits.topk(8)
        return idx, values
    idx = indexer_topk(logits, 8)
    return (idx, logits) if also_logits else idx


@pytest.mark.parametrize("also_logits", [False, True, "values"])
def test_paged_logits_leave_the_masked_columns_to_an_only_top_k(also_logits):
    """The top-k reads each row up to its length: where it is the paged logits' only reader, the logits op is told
    to leave the masked columns past each row's context unwritten (``write_masked=False``); where the logits are
    also returned, or the top-k's values gathered from them (its -inf picks may lie past a row's length), it writes
    every element as before. Results as before either way (the CPU reference writes NaN where the columns are left
    unspecified, and the top-k does not read them)."""
    from nsa_inductor.indexer import IndexerConfig
    from nsa_inductor.layout import KCacheLayout
    from nsa_inductor.workload import decode_batch

    config = IndexerConfig.deepseek_v32().small()
    batch = decode_batch(config, KCacheLayout(16), [5, 33, 0, 17], next_n=1, max_len=48, seed=1)
    gen = torch.Generator().manual_seed(4)
    q8 = torch.randn(4, 1, config.n_heads, 128, generator=gen).to(config.fp8_dtype)
    args = (q8, batch.kv_cache, torch.randn(4, config.n_heads, generator=gen), batch.lens, batch.block_table)
    gm = pass_helpers.functional_graph(lambda *a: paged_topk(*a, also_logits=also_logits), *args)
    before = gm(*args)
    result = TopkIndices()(gm.graph, None)
    gm.recompile()
    assert result.matched == 1, result.near_misses
    (logits,) = [n for n in gm.graph.nodes if n.target is torch.ops.nsa.paged_mqa_logits.default]
    assert logits.kwargs.get("write_masked", True) is bool(also_logits)
    after = gm(*args)
    if also_logits == "values":  # (the -inf picks: any -inf columns, as torch's)
        assert torch.equal(after[1], before[1]) and torch.equal(after[0][before[1].isfinite()],
                                                                 before[0][before[1].isfinite()])
        return
    for a, b in zip(before if also_logits else (before,), after if also_logits else (after,)):
        assert torch.equal(a, b)
