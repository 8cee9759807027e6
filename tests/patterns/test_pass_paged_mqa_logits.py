"""nsa.paged_mqa_logits pass: fires on plain-torch decode logits (reference and independently written indexers, all
layouts, dynamic token counts), never on look-alikes (wrong mask, no relu, wrong layout, weights not per head, sum
over the wrong axis), and the compiled program equals eager."""

import functools
import pathlib
import re
import tempfile

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from nsa_inductor.indexer import Indexer
from nsa_inductor.workload import decode_batch
from helpers.models import CACHE_SLOTS, CONFIGS, LAYOUTS, batches, compiled, other
from helpers.pass_helpers import assert_matches_eager, count_ops, graph_dirs, near_miss_reasons, pass_entry, pass_graphs
from helpers.reference64 import assert_logits_close

NAME = "paged_mqa_logits"
OP = "nsa.paged_mqa_logits"


def assert_fired(dump_dir: pathlib.Path, name=NAME, op=OP):
    dirs = graph_dirs(dump_dir)
    assert dirs, "no graph was compiled"
    for g in dirs:
        entry = pass_entry(g, name)
        assert entry["matched"] >= 1, entry["near_misses"]
        before, after = pass_graphs(g, name)
        assert count_ops(before, op) == 0 and count_ops(after, op) == 1
        assert count_ops(before, "aten.bmm") + count_ops(before, "aten.mm") > count_ops(after, "aten.bmm") + \
            count_ops(after, "aten.mm")
        assert count_ops(after, "aten.bmm") == 0 and count_ops(after, "aten.relu") == 0


# ---------------------------------------------------------------------------------------------------------------
# positive: reference indexer (shares the compiled models of helpers.models), both next_n, dynamic T
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_fires_on_reference_decode(config_name, layout_name):
    eager_fn, compiled_fn, dump_dir = compiled(config_name, layout_name, "decode")
    config, layout = CONFIGS[config_name], LAYOUTS[layout_name]
    # next_n=1 then next_n=2 with another batch size: the second compile has a symbolic token count
    for batch in batches(config, layout, "decode"):
        assert_matches_eager(eager_fn, compiled_fn, batch)
    assert len(graph_dirs(dump_dir)) >= 2
    assert_fired(dump_dir)


@pytest.mark.parametrize("layout_name", ["flat", "paged"])
def test_fires_on_other_indexer(layout_name):
    eager_fn, compiled_fn, dump_dir = other(layout_name, "decode")
    layout = LAYOUTS[layout_name]
    batch = decode_batch(CONFIGS["deepseek_v32"], layout, [5, 33, 0, 17], next_n=1, max_len=48, seed=1,
                         cache_pages=CACHE_SLOTS // layout.page_size)
    eager, comp = batch.clone(), batch.clone()
    with torch.no_grad():
        logits, _ = eager_fn(*eager.args)
        c_logits, _ = compiled_fn(*comp.args)
    assert_logits_close(c_logits, logits)
    assert_fired(dump_dir)


# ---------------------------------------------------------------------------------------------------------------
# property: one fixed-shape compiled model, varying context lengths (0, non-multiples of the page) and tables
# ---------------------------------------------------------------------------------------------------------------

FIXED_PAGES = 256


def fixed_shape_batch(config, layout, context_lens, next_n, seed):
    batch = decode_batch(config, layout, context_lens, next_n=next_n, max_len=48, seed=seed)
    cache = layout.allocate(FIXED_PAGES * layout.page_size)
    cache[: batch.kv_cache.shape[0]] = batch.kv_cache
    batch.kv_cache = cache
    return batch


@settings(max_examples=10)
@given(layout_name=st.sampled_from(["flat", "preshuffle"]), lens=st.lists(st.integers(0, 48), min_size=3, max_size=3),
       seed=st.integers(0, 2**16))
@example(layout_name="flat", lens=[0, 33, 47], seed=31149)  # one of 4 tokens has 8 of its values a step apart
def test_property_context_lengths(layout_name, lens, seed):
    next_n = 2  # rows j=0,1 see different lengths; ctx < next_n are padding rows
    eager_fn, compiled_fn, dump_dir = property_model(layout_name, next_n)
    config, layout = CONFIGS["deepseek_v32"], LAYOUTS[layout_name]
    assert_matches_eager(eager_fn, compiled_fn, fixed_shape_batch(config, layout, lens, next_n, seed))
    assert_fired(dump_dir)


@functools.cache
def property_model(layout_name, next_n):
    """A fresh compiled model per (layout, next_n): the shapes stay fixed, so hypothesis never recompiles."""
    layout = LAYOUTS[layout_name]
    model = Indexer(CONFIGS["deepseek_v32"], layout)
    model.reset_parameters(torch.Generator().manual_seed(0))
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix="nsa-paged-prop-"))
    options = {"nsa.layout": layout_name, "nsa.page_size": layout.page_size, "nsa.dump_dir": str(dump_dir)}
    return model.decode, torch.compile(model.decode, backend="nsa_rocm", dynamic=False, options=options), dump_dir


# ---------------------------------------------------------------------------------------------------------------
# negative: look-alikes must not be rewritten, and the reason is recorded
# ---------------------------------------------------------------------------------------------------------------


class Variant(Indexer):
    """The reference decode with one deliberate change in the logits (``variant``)."""

    variant = ""

    def decode(self, x, q_lora, positions, slot_mapping, kv_cache, block_table, context_lens):
        c = self.config
        if self.variant == "table_clamped_at_0":  # an engine's fallback: a negative id reads page 0, not its wrap
            block_table = block_table.clamp(min=0)
        if self.variant == "table_abs":
            block_table = block_table.abs()
        batch, max_pages = block_table.shape
        next_n = x.shape[0] // batch
        max_len = max_pages * self.layout.page_size
        self.store_k(x, positions, slot_mapping, kv_cache)
        q_fp8, q_scale = self.project_q(q_lora, positions)
        weights = self.head_gates(x, q_scale)
        if self.variant == "weights_not_per_head":
            weights = weights.mean(dim=1, keepdim=True).expand(-1, c.n_heads)
        if self.variant == "weights_bf16":
            weights = weights.bfloat16()
        if self.variant == "weights_two_of_four_splits":  # P[0] + P[1] of a P [4, rows, H]: not a whole split-K sum
            parts = torch.stack([weights, weights * 0, weights * 2, weights * 3])
            weights = parts[0] + parts[1]
        if self.variant == "weights_read_transposed":  # a view: row r, head h reads weights.flatten()[h * rows + r]
            weights = weights.reshape(c.n_heads, -1).t()
        key_pos = torch.arange(max_len, device=x.device)
        from nsa_inductor.indexer import paged_slots

        slots = paged_slots(block_table, key_pos.expand(batch, max_len), self.layout.page_size)
        k_fp8, k_scale = self.layout.load(kv_cache, slots.flatten(), c.fp8_dtype)
        if self.variant == "k_scale_other_cache":  # a second cache of the same shape, set by the test
            k_scale = self.layout.load(self.scale_cache, slots.flatten(), c.fp8_dtype)[1]
        k = k_fp8.float().view(batch, max_len, c.head_dim)
        q = q_fp8.view(batch, next_n, c.n_heads, c.head_dim)
        if self.variant == "q_bf16":  # the same values, but not fp8 q: the op reads q as fp8
            q = q.to(torch.bfloat16)
        if self.variant == "q_dims_repeated":  # the first 64 dims twice, the last 64 never
            q = q[..., torch.arange(c.head_dim) % 64]
        if self.variant == "q_heads_mixed":  # each head's row read across the heads
            q = q_fp8.view(batch, next_n, c.head_dim, c.n_heads).transpose(2, 3)
        scores = torch.einsum("bnhd,bsd->bnhs", q.float(), k)
        if self.variant == "scaled_inside_relu":
            scores = scores * 0.5
        if self.variant == "weights_inside_relu":  # relu(w * s) is not w * relu(s) for negative weights
            scores = scores * weights.view(batch, next_n, c.n_heads, 1)
        if self.variant == "clamped_at_a_quarter":  # max(s, 0.25) is not relu(s)
            scores = scores.clamp_min(0.25)
        elif self.variant == "leaky_relu":
            scores = torch.nn.functional.leaky_relu(scores, 0.01)
        elif self.variant == "relu_as_maximum":
            scores = torch.maximum(scores, torch.zeros_like(scores))
        elif self.variant == "relu_as_where":
            scores = torch.where(scores > 0, scores, 0.0)
        elif self.variant == "relu_as_masked_fill":  # where(s < 0, 0, s)
            scores = scores.masked_fill(scores < 0, 0.0)
        elif self.variant == "relu_as_threshold":  # where(s <= 0, 0, s)
            scores = torch.nn.functional.threshold(scores, 0.0, 0.0)
        elif self.variant == "negative_part_by_where":  # min(s, 0): the condition and the zero swapped
            scores = torch.where(scores < 0, scores, 0.0)
        elif self.variant != "no_relu":
            scores = scores.relu()
        if self.variant == "softmax_scale_after_relu":  # number factors outside the relu: folded into the weights
            scores = scores * c.head_dim ** -0.5 * 0.25
        if self.variant not in ("k_scale_after_sum", "k_scale_after_mask"):
            scores = scores * k_scale.view(batch, 1, 1, max_len)
        if self.variant == "k_scale_twice":
            scores = scores * k_scale.view(batch, 1, 1, max_len)
        if self.variant not in ("no_weights", "weights_inside_relu", "heads_summed_by_einsum",
                                "heads_summed_by_einsum_with_one_row_weights"):
            scores = scores * weights.view(batch, next_n, c.n_heads, 1)
        if self.variant == "sum_over_tokens":  # next_n == H: sums the next_n axis instead of the heads
            scores = scores.sum(dim=1)
        elif self.variant == "heads_averaged":  # the mean: the sum times 1/H
            scores = scores.mean(dim=2)
        elif self.variant == "heads_summed_in_float64":  # float64 logits (the buffer's copy rounds them back)
            scores = scores.sum(dim=2, dtype=torch.float64)
        elif self.variant == "heads_summed_by_einsum":  # the same sum, as a bmm with the weights
            scores = torch.einsum("bnhs,bnh->bns", scores, weights.view(batch, next_n, c.n_heads))
        elif self.variant == "heads_summed_by_einsum_with_one_row_weights":  # every row weighted by row 0's
            scores = torch.einsum("bnhs,h->bns", scores, weights[0])
        else:
            scores = scores.sum(dim=2)
        if self.variant == "k_scale_after_sum":  # the same terms: k_scale does not depend on the head
            scores = scores * k_scale.view(batch, 1, max_len) * 0.5
        last_visible = context_lens.view(batch, 1) - next_n + torch.arange(next_n, device=x.device)
        if self.variant == "mask_off_by_one":
            visible = key_pos < last_visible.unsqueeze(-1)
        else:
            visible = key_pos <= last_visible.unsqueeze(-1)
        logits = torch.full((batch * next_n, c.max_model_len), float("-inf"), device=x.device)
        if self.variant in ("mask_on_the_wider_buffer", "wider_buffer_short_write"):  # written, then masked there
            written = max_len - 16 if self.variant == "wider_buffer_short_write" else max_len  # (16: a page)
            logits[:, :written] = scores.reshape(batch * next_n, max_len)[:, :written]
            cols = torch.arange(c.max_model_len, device=x.device)
            wide = cols <= last_visible.reshape(batch * next_n, 1)
            logits = logits.masked_fill(~wide, float("-inf"))
            return logits, self._topk(logits)
        masked = scores.masked_fill(~visible, float("-inf"))
        if self.variant == "k_scale_after_mask":  # it multiplies the -inf too (a scale of 0 would make NaNs)
            masked = masked * (k_scale.view(batch, 1, max_len) + 1.0)
        logits[:, :max_len] = masked.view(batch * next_n, max_len)
        return logits, self._topk(logits)


NEGATIVES = {
    # variant: (eager layout, compiled layout option, next_n, expected words in the reason)
    "mask_off_by_one": ("paged", "paged", 1, "mask"),
    "no_relu": ("paged", "paged", 1, "relu"),
    "clamped_at_a_quarter": ("paged", "paged", 1, "through clamp_min"),
    "leaky_relu": ("paged", "paged", 1, "which is not relu"),
    "negative_part_by_where": ("paged", "paged", 1, "which is not relu"),
    "heads_summed_by_einsum_with_one_row_weights": ("paged", "paged", 1, "per (row, head)"),
    "heads_summed_in_float64": ("paged", "paged", 1, "sums in torch.float64"),
    "weights_not_per_head": ("paged", "paged", 1, "weights"),
    "weights_bf16": ("paged", "paged", 1, "not an fp32"),
    "weights_inside_relu": ("paged", "paged", 1, "inside the relu"),
    "weights_read_transposed": ("paged", "paged", 1, "per (row, head)"),
    "k_scale_other_cache": ("paged", "paged", 1, "different caches"),
    "no_weights": ("paged", "paged", 1, "no per-head weight factor"),
    "q_bf16": ("paged", "paged", 1, "fp8 -> fp32 upcast of q"),
    "q_dims_repeated": ("paged", "paged", 1, "every q dim exactly once"),
    "q_heads_mixed": ("paged", "paged", 1, "mixes q heads"),
    "k_scale_twice": ("paged", "paged", 1, "2 k_scale factors"),
    "sum_over_tokens": ("paged", "paged", 16, "q[row, h, d]"),  # a sum mixes q rows before its axis is checked
    "layout_preshuffle_vs_paged": ("paged", "preshuffle", 1, "offsets"),
    "scaled_inside_relu": ("paged", "paged", 1, "inside the relu"),
    "k_scale_after_mask": ("paged", "paged", 1, "0 k_scale factors"),
    "wider_buffer_short_write": ("paged", "paged", 1, "the mask must apply"),  # a slice of the sum is written
    "table_clamped_at_0": ("paged", "paged", 1, "negative page id"),
    "table_abs": ("flat", "flat", 1, "negative page id"),
}
# (a paged cache compiled under the flat guard is rewritten with the cache's own page size: tests/test_engine_indexer.py)


@pytest.mark.parametrize("variant", sorted(NEGATIVES))
def test_does_not_fire_on_lookalikes(variant):
    eager_layout, compiled_layout, next_n, words = NEGATIVES[variant]
    config = CONFIGS["deepseek_v32"]
    assert config.n_heads == 16
    layout = LAYOUTS[eager_layout]
    model = type("V", (Variant,), {"variant": variant})(config, layout)
    model.reset_parameters(torch.Generator().manual_seed(0))
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"nsa-neg-{variant}-"))
    c_layout = LAYOUTS[compiled_layout]
    options = {"nsa.layout": compiled_layout, "nsa.page_size": c_layout.page_size, "nsa.dump_dir": str(dump_dir)}
    compiled_fn = torch.compile(model.decode, backend="nsa_rocm", dynamic=False, options=options)
    lens = [5, 33, 17] if next_n == 1 else [20, 40]
    batch = decode_batch(config, layout, lens, next_n=next_n, max_len=48, seed=1)
    model.scale_cache = batch.kv_cache.flip(0)  # read by k_scale_other_cache only
    assert_matches_eager(model.decode, compiled_fn, batch)
    reasons = near_miss_reasons(dump_dir, NAME)
    assert any(words in r for r in reasons), reasons


def assert_variant_fires(variant: str, dynamic: bool = False) -> pathlib.Path:
    """The variant compiled (static shapes, or symbolic) equals eager and is rewritten; returns its dump directory."""
    config, layout = CONFIGS["deepseek_v32"], LAYOUTS["paged"]
    model = type("V", (Variant,), {"variant": variant})(config, layout)
    model.reset_parameters(torch.Generator().manual_seed(0))
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"nsa-{variant}-"))
    options = {"nsa.layout": "paged", "nsa.page_size": layout.page_size, "nsa.dump_dir": str(dump_dir)}
    compiled_fn = torch.compile(model.decode, backend="nsa_rocm", dynamic=dynamic, options=options)
    assert_matches_eager(model.decode, compiled_fn, decode_batch(config, layout, [5, 33, 17], max_len=48, seed=2))
    assert_fired(dump_dir)
    return dump_dir


def test_folds_number_factors_outside_the_relu():
    """``relu(q·k) * D**-0.5 * 0.25 * k_scale * w``: the numbers are multiplied into the weights, not a near miss."""
    (graph_dir,) = graph_dirs(assert_variant_fires("softmax_scale_after_relu"))
    # the op's weights: the head gate's split-K partials [S, rows, 16], then q's scale and these numbers times the
    # weights' own H**-0.5 * D**-0.5 (H = 16, D = 128): no kernel computes the weights before the op
    after = pass_graphs(graph_dir, NAME)[1]
    call = re.search(r"nsa\.paged_mqa_logits\.default\((\w+), (\w+), (\w+), .*, (\w+), ([0-9.e-]+)\)", after)
    assert re.search(rf"{call[3]} = torch\.ops\.aten\.reshape\.default\(getitem_\d+, \[\d, -1, 16\]\)", after)
    assert float(call[5]) == pytest.approx(0.00048828125, rel=1e-12)


def test_takes_k_scale_and_numbers_multiplied_onto_the_head_sum():
    """``(relu(q·k) * w).sum(h) * k_scale * 0.5``: the terms of the idiom, k_scale read after the sum (as the
    kernel multiplies it), the number folded into the weights."""
    (graph_dir,) = graph_dirs(assert_variant_fires("k_scale_after_sum"))
    call = re.search(r"nsa\.paged_mqa_logits\.default\(.*, ([0-9.e-]+)\)", pass_graphs(graph_dir, NAME)[1])
    assert float(call[1]) == pytest.approx(0.5 * 16**-0.5 * 128**-0.5, rel=1e-12)


def test_takes_the_mask_on_a_wider_buffer_the_sum_was_written_into():
    """``logits = full(-inf); logits[:, :max_len] = sum; logits.masked_fill(cols > last_visible, -inf)`` (an
    engine fallback's order): the op writes the whole ``max_model_len`` row (-inf past the block table)."""
    (graph_dir,) = graph_dirs(assert_variant_fires("mask_on_the_wider_buffer"))
    call = re.search(r"nsa\.paged_mqa_logits\.default\((?:\w+, ){5}(\d+), 16,", pass_graphs(graph_dir, NAME)[1])
    assert int(call[1]) == CONFIGS["deepseek_v32"].max_model_len


def test_takes_the_mean_over_the_heads():
    """``(relu(q·k) * k_scale * w).mean(dim=heads)``: the head sum with 1/H folded into the weights' number."""
    (graph_dir,) = graph_dirs(assert_variant_fires("heads_averaged"))
    call = re.search(r"nsa\.paged_mqa_logits\.default\(.*, ([0-9.e-]+)\)", pass_graphs(graph_dir, NAME)[1])
    assert float(call[1]) == pytest.approx(16**-0.5 * 128**-0.5 / 16, rel=1e-12)


@pytest.mark.parametrize("dynamic", [False, True])
def test_takes_heads_summed_by_an_einsum_with_the_weights(dynamic):
    """``einsum("bnhs,bnh->bns", relu(q·k) * k_scale, w)``: the head sum as a bmm contracting the heads with the
    weights, rewritten; also with symbolic sizes, where a reshape after the bmm reads its size (``sym_size``)."""
    (graph_dir,) = graph_dirs(assert_variant_fires("heads_summed_by_einsum", dynamic))
    before, after = pass_graphs(graph_dir, NAME)
    assert count_ops(before, "aten.bmm") == 2 and count_ops(after, "aten.bmm") == 0


@pytest.mark.parametrize("variant", ["relu_as_maximum", "relu_as_where", "relu_as_masked_fill", "relu_as_threshold"])
def test_takes_relu_spelled_otherwise(variant):
    """``maximum(s, zeros_like(s))``, ``where(s > 0, s, 0)``, ``masked_fill(s < 0, 0)`` and ``threshold(s, 0, 0)``
    are the relu (leaky_relu, ``clamp_min(s, 0.25)`` and ``where(s < 0, s, 0)`` are near misses naming the op:
    ``test_does_not_fire_on_lookalikes``)."""
    assert_variant_fires(variant)


def test_weights_summed_from_some_splits_are_one_factor():
    """``P[0] + P[1]`` of a ``P [4, rows, H]``: the rewrite takes the sum as the weights, not ``P`` as the head
    gate's split-K partials (the op would add all four)."""
    assert_variant_fires("weights_two_of_four_splits")
