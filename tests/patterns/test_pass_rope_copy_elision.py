"""rope_copy_elision: write-backs whose source is the destination's own elements are removed, nothing else."""

import functools
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nsa_inductor.indexer import Indexer, IndexerConfig, apply_rope
from nsa_inductor.layout import KCacheLayout
from nsa_inductor.patterns.rope_copy_elision import RopeCopyElision
from nsa_inductor.patterns import rope_copy_elision
from nsa_inductor.workload import decode_batch, prefill_batch
from helpers.other_indexer import OtherIndexer
from helpers import pass_helpers
from helpers.pass_helpers import assert_matches_eager, compile_with_dumps, count_ops, graph_dirs, pass_entry, pass_graphs

# Only the pass under test (and Inductor) rewrite: the other passes are tested in their own files.
ONLY_THIS = {"nsa.disable_passes": ["quant_cache_store", "paged_mqa_logits", "ragged_mqa_logits", "empty_logits_buffer"],
             "nsa.head_gate_mode": "off"}


def run_pass(fn, *args):
    return pass_helpers.run_pass(RopeCopyElision(), count_scatters, fn, *args)


def count_scatters(gm) -> int:
    return sum(n.target in rope_copy_elision.SCATTERS for n in gm.graph.nodes)


def reasons(result) -> str:
    return " | ".join(m["reason"] for m in result.near_misses)


# ---------------------------------------------------------------------------------------------------------------
# the pass on small FX graphs
# ---------------------------------------------------------------------------------------------------------------


@given(
    length=st.integers(1, 4),
    step=st.integers(1, 3),
    step2=st.integers(1, 3),
    start_raw=st.integers(0, 11),
    start2_raw=st.integers(0, 11),
    negative_start2=st.booleans(),
    open_end2=st.booleans(),
    negative_dim=st.booleans(),
    same_tensor=st.booleans(),
)
def test_write_back_elided_exactly_when_same_elements(length, step, step2, start_raw, start2_raw, negative_start2,
                                                      open_end2, negative_dim, same_tensor):
    """``y[:, r1] = src[:, r2]``: removed iff src is y and r1, r2 select the same elements; values never change."""
    n = 12
    start = start_raw % (n - (length - 1) * step)
    start2 = start2_raw % (n - (length - 1) * step2)
    end, end2 = start + (length - 1) * step + 1, start2 + (length - 1) * step2 + 1
    s1 = slice(start, end, step)
    s2 = slice(start2 - n if negative_start2 else start2, end2, step2)
    if open_end2 and len(range(n)[start2::step2]) == length:
        s2 = slice(s2.start, None, step2)
    dim = -1 if negative_dim else 1

    def fn(x, z):
        y = x * 2
        src = y if same_tensor else z
        if dim == 1:
            y[:, s1] = src[:, s2]
        else:
            y[..., s1] = src[..., s2]
        return y

    x, z = torch.randn(3, n), torch.randn(3, n)
    result, before, after, removed = run_pass(fn, x, z)
    assert torch.equal(before, after)
    expect = same_tensor and range(n)[s1] == range(n)[s2]
    assert result.matched == removed == int(expect), (range(n)[s1], range(n)[s2], same_tensor, reasons(result))
    if not expect:
        assert result.near_misses, "a kept write-back of a sliced tensor must be reported"


def test_reference_rope_idiom():
    """``q_pe = q[..., :r]; q_pe.copy_(rope(q_pe)); q[..., :r] = q_pe``: the write-back goes, the rotation stays."""
    def fn(flat, cos, sin):
        q = (flat * 1).view(-1, 2, 16)
        q_pe = q[..., :8]
        q_pe.copy_(apply_rope(q_pe, cos, sin, False))
        q[..., :8] = q_pe
        return q.float() * 3

    x, cos, sin = torch.randn(5, 32, dtype=torch.bfloat16), torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    result, before, after, removed = run_pass(fn, x, cos, sin)
    assert result.matched == removed == 1
    assert torch.equal(before, after)
    assert torch.equal(after, fn(x, cos, sin))
    assert "RoPE output" in reasons(result) and "not the destination" in reasons(result)


def test_narrow_copy_idiom():
    def fn(k):
        k = k + 1
        k_rope = k.narrow(-1, 0, 4)
        k_rope.mul_(2)
        k.narrow(-1, 0, 4).copy_(k_rope)
        return k

    x = torch.randn(3, 8)
    result, before, after, removed = run_pass(fn, x)
    assert result.matched == removed == 1 and torch.equal(after, fn(x))


def test_select_write_back():
    def fn(x):
        y = x * 3
        y[:, 2] = y[:, 2]
        return y

    result, before, after, removed = run_pass(fn, torch.randn(4, 5))
    assert result.matched == removed == 1 and torch.equal(before, after)


@pytest.mark.parametrize("other", ["dim", "index"])
def test_a_slab_written_elsewhere_is_kept(other):
    """``y[:, 2] = y[2, :]`` of a square ``y`` (the same index and shape, another dim: row 2 into column 2), and
    ``y[:, 1] = y[:, 2]`` (the same dim, another index)."""
    def fn(x):
        y = x * 3
        if other == "dim":
            y[:, 2] = y[2, :]
        else:
            y[:, 1] = y[:, 2]
        return y

    result, before, after, removed = run_pass(fn, torch.randn(5, 5))
    assert result.matched == removed == 0 and torch.equal(before, after)
    assert result.near_misses, "a kept write-back of a selected slab must be reported"


@pytest.mark.parametrize(
    "case, reason",
    [
        ("out_of_place_rope", "RoPE output"),
        ("different_offset", "different ranges"),
        ("different_tensor", "different tensor"),
        ("dtype_change", "dtype change"),
    ],
)
def test_near_misses(case, reason):
    def fn(flat, other, cos, sin):
        q = (flat * 1).view(-1, 2, 16)
        if case == "out_of_place_rope":
            q[..., :8] = apply_rope(q[..., :8], cos, sin, False)
        elif case == "different_offset":
            q[..., :8] = q[..., 8:]
        elif case == "different_tensor":
            q[..., :8] = other.view(-1, 2, 16)[..., :8]
        else:
            q[..., :8] = q[..., :8].float().to(torch.bfloat16)
        return q

    x, other = torch.randn(5, 32, dtype=torch.bfloat16), torch.randn(5, 32, dtype=torch.bfloat16)
    result, before, after, removed = run_pass(fn, x, other, torch.randn(5, 1, 4), torch.randn(5, 1, 4))
    assert result.matched == removed == 0
    assert torch.equal(before, after)
    assert reason in reasons(result), reasons(result)


def test_a_write_back_rounded_through_a_bf16_copy_is_kept():
    """``pe.copy_(b)`` with ``b`` a bf16 copy of ``pe``: the values come back rounded, not as the destination's own."""
    def fn(x):
        y = x * 2
        pe = y[:, :4]
        rounded = torch.empty_like(pe, dtype=torch.bfloat16)
        rounded.copy_(pe)
        pe.copy_(rounded)
        return y

    result, before, after, removed = run_pass(fn, torch.randn(3, 8) / 3)
    assert result.matched == removed == 0
    assert torch.equal(before, after)
    assert "changes dtype" in reasons(result), reasons(result)


def test_write_back_of_a_value_saved_before_a_mutation_is_kept():
    """``saved = x[:, :2].clone(); x.add_(1); x[:, :2] = saved`` restores the old values: not a self-copy."""
    def fn(x):
        x = x.clone()
        saved = x[:, :2].clone()
        x.add_(1)
        x[:, :2] = saved
        return x * 1

    x = torch.randn(3, 6)
    result, before, after, removed = run_pass(fn, x.clone())
    assert result.matched == removed == 0
    assert torch.equal(before, after)


# ---------------------------------------------------------------------------------------------------------------
# compiled indexers
# ---------------------------------------------------------------------------------------------------------------

CONFIGS = {"deepseek_v32": IndexerConfig.deepseek_v32().small(), "glm5": IndexerConfig.glm5().small()}
LAYOUT = KCacheLayout(16)


@functools.cache
def compiled(which: str, config_name: str, entry: str):
    model = Indexer(CONFIGS[config_name], LAYOUT)
    model.reset_parameters(torch.Generator().manual_seed(0))
    if which == "other":
        model = OtherIndexer(CONFIGS[config_name], LAYOUT.page_size).load_from(model)
    fn = getattr(model, entry)
    compiled_fn, dump_dir = compile_with_dumps(fn, {"nsa.layout": "paged", "nsa.page_size": 16, **ONLY_THIS})
    return fn, compiled_fn, dump_dir


def batch_for(config, entry):
    if entry == "decode":
        return decode_batch(config, LAYOUT, [5, 33, 0, 17], next_n=1, max_len=48, seed=1)
    return prefill_batch(config, LAYOUT, [9, 17, 1], padding_tokens=3, seed=3)


@pytest.mark.parametrize(
    "which, config_name, entry",
    [("reference", "deepseek_v32", "decode"), ("reference", "glm5", "decode"), ("reference", "deepseek_v32", "prefill"),
     ("other", "deepseek_v32", "decode")],
)
def test_fires_on_indexers_and_matches_eager(which, config_name, entry):
    eager_fn, compiled_fn, dump_dir = compiled(which, config_name, entry)
    batch = batch_for(CONFIGS[config_name], entry)
    assert_matches_eager(eager_fn, compiled_fn, batch)

    (graph_dir,) = graph_dirs(dump_dir)
    entry_report = pass_entry(graph_dir, "rope_copy_elision")
    before, after = pass_graphs(graph_dir, "rope_copy_elision")
    assert entry_report["matched"] >= 1
    assert count_ops(after, "aten.slice_scatter") == count_ops(before, "aten.slice_scatter") - entry_report["matched"]
    # the in-place rotation q_pe.copy_(rope(q_pe)) / k_rope.copy_(rotated) is a real write: kept and reported
    assert any("RoPE output" in m["reason"] for m in entry_report["near_misses"]), entry_report


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
