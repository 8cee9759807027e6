"""searchsorted_offset: a sorted sequence that is a view at a nonzero storage offset is searched through a copy.

The torch 2.11 lowering bug it works around shows only on the GPU (tests/test_compiled_indexer.py's prefill runs
there); on the CPU these tests check that the pass fires exactly where the offset is nonzero and changes nothing.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nsa_inductor.patterns import searchsorted_offset
from nsa_inductor.patterns.searchsorted_offset import SearchsortedOffset
from helpers import pass_helpers
from helpers.pass_helpers import compile_with_dumps, count_ops, graph_dirs, pass_entry, pass_graphs



def count_clones(gm) -> int:
    return sum(n.target is torch.ops.aten.clone.default for n in gm.graph.nodes)


def run_pass(fn, *args):
    result, before, after, removed = pass_helpers.run_pass(SearchsortedOffset(), count_clones, fn, *args)
    return result, before, after, -removed


@st.composite
def cu_seqlens_and_tokens(draw):
    lens = draw(st.lists(st.integers(0, 9), min_size=2, max_size=6))
    cu = torch.tensor([0] + lens).cumsum(0).to(draw(st.sampled_from([torch.int32, torch.int64])))
    token = torch.tensor(draw(st.lists(st.integers(-2, int(cu[-1]) + 2), min_size=1, max_size=12)))
    return cu, token


@settings(deadline=None, max_examples=25)
@given(cu_seqlens_and_tokens(), st.booleans(), st.integers(1, 2))
def test_offset_views_are_copied_and_results_unchanged(data, right, start):
    cu, token = data

    def fn(cu, token):
        return torch.searchsorted(cu[start:], token, right=right), torch.searchsorted(cu[start:], 3, right=right)

    result, before, after, added = run_pass(fn, cu, token)
    assert result.matched == added == 2
    for a, b in zip(before, after):
        assert torch.equal(a, b)


@pytest.mark.parametrize("spelling", [
    lambda cu, t: torch.searchsorted(cu, t, right=True),
    lambda cu, t: torch.searchsorted(cu[:-1], t),
    lambda cu, t: torch.searchsorted(cu.view(1, -1)[0], t),
], ids=["whole", "prefix-slice", "select-row-0"])
def test_views_at_offset_zero_are_left_alone(spelling):
    cu, token = torch.tensor([0, 3, 5, 9]), torch.arange(10)
    result, before, after, added = run_pass(spelling, cu, token)
    assert result.matched == added == 0 and result.near_misses == []
    assert torch.equal(before, after)


def test_compiled_prefill_token_map_equals_eager():
    """The spelling the indexers use, through the whole backend: one clone in the graph, results as eager."""
    def fn(cu_seqlens):
        token = torch.arange(int(cu_seqlens.shape[0]) * 4, device=cu_seqlens.device)
        seq = searchsorted_offset.search(cu_seqlens, token)  # the idiom the pass declares
        return seq, cu_seqlens[seq.clamp(max=cu_seqlens.shape[0] - 1)]

    compiled, dump_dir = compile_with_dumps(fn, {"nsa.disable_passes": ["head_gate_gemm"]}, dynamic=False)
    cu = torch.tensor([0, 3, 3, 7, 12], dtype=torch.int32)
    for got, want in zip(compiled(cu), fn(cu)):
        assert torch.equal(got, want)
    (graph_dir,) = graph_dirs(dump_dir)
    assert pass_entry(graph_dir, "searchsorted_offset")["matched"] == 1
    before, after = pass_graphs(graph_dir, "searchsorted_offset")
    assert (count_ops(before, "aten.clone"), count_ops(after, "aten.clone")) == (0, 1)
