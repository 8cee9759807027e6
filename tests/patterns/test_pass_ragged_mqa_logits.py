"""nsa.mqa_logits (+ nsa.gather_k) pass: fires on plain-torch ragged causal prefill logits (reference and
independently written indexers, all layouts, dynamic token counts), never on look-alikes, and compiled == eager."""

import pathlib
import tempfile

import pytest
import torch

from nsa_inductor.indexer import Indexer
from nsa_inductor.workload import prefill_batch
from helpers.models import CACHE_SLOTS, CONFIGS, LAYOUTS, batches, compile_indexer, compiled, other
from helpers.pass_helpers import assert_matches_eager, count_ops, graph_dirs, near_miss_reasons, pass_entry, pass_graphs

NAME = "ragged_mqa_logits"


def assert_fired(dump_dir: pathlib.Path, gathered: bool = True):
    dirs = graph_dirs(dump_dir)
    assert dirs, "no graph was compiled"
    for g in dirs:
        entry = pass_entry(g, NAME)
        assert entry["matched"] >= 1, entry["near_misses"]
        before, after = pass_graphs(g, NAME)
        assert count_ops(before, "nsa.mqa_logits") == 0 and count_ops(after, "nsa.mqa_logits") == 1
        assert count_ops(after, "nsa.gather_k") == int(gathered)
        assert count_ops(after, "aten.bmm") + count_ops(after, "aten.mm") < \
            count_ops(before, "aten.bmm") + count_ops(before, "aten.mm")
        assert count_ops(after, "aten.relu") == 0


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_fires_on_reference_prefill(config_name, layout_name):
    eager_fn, compiled_fn, dump_dir = compiled(config_name, layout_name, "prefill")
    config, layout = CONFIGS[config_name], LAYOUTS[layout_name]
    for batch in batches(config, layout, "prefill"):
        assert_matches_eager(eager_fn, compiled_fn, batch)
    assert_fired(dump_dir)


def test_dynamic_token_count():
    """Several T through one fresh compile: the first graph has a static T, the recompiled one a symbolic T, and both
    fire. (A fresh Dynamo and model: Dynamo keeps its automatic-dynamic state per code object, so another test's
    compile of ``Indexer.prefill`` at two T on this worker, as the sweep's, would make the first graph symbolic.)"""
    torch._dynamo.reset()
    config, layout = CONFIGS["deepseek_v32"], LAYOUTS["paged"]
    model = Indexer(config, layout)
    model.reset_parameters(torch.Generator().manual_seed(0))
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix="nsa-dynamic-prefill-"))
    compiled_fn = compile_indexer(model.prefill, {"nsa.layout": "paged", "nsa.page_size": layout.page_size,
                                                  "nsa.dump_dir": str(dump_dir)})
    for lens, pad, seed in (([9, 17, 1], 3, 3), ([5, 20], 0, 4), ([33, 2, 0, 7], 1, 5)):
        batch = prefill_batch(config, layout, lens, padding_tokens=pad, seed=seed,
                              cache_pages=CACHE_SLOTS // layout.page_size)
        assert_matches_eager(model.prefill, compiled_fn, batch)
    assert len(graph_dirs(dump_dir)) >= 2
    assert_fired(dump_dir)


@pytest.mark.parametrize("layout_name", ["flat", "paged"])
def test_fires_on_other_indexer(layout_name):
    eager_fn, compiled_fn, dump_dir = other(layout_name, "prefill")
    layout = LAYOUTS[layout_name]
    batch = prefill_batch(CONFIGS["deepseek_v32"], layout, [9, 17, 1], seed=3,
                          cache_pages=CACHE_SLOTS // layout.page_size)
    assert_matches_eager(eager_fn, compiled_fn, batch)
    assert_fired(dump_dir)


class Variant(Indexer):
    variant = ""

    def prefill(self, x, q_lora, positions, slot_mapping, kv_cache, block_table, cu_seqlens):
        from nsa_inductor.indexer import paged_slots

        c = self.config
        num_tokens = x.shape[0]
        self.store_k(x, positions, slot_mapping, kv_cache)
        q_fp8, q_scale = self.project_q(q_lora, positions)
        weights = self.head_gates(x, q_scale)
        token = torch.arange(num_tokens, device=x.device)
        seq = torch.searchsorted(cu_seqlens[1:], token, right=True)
        ks = cu_seqlens[seq].long()
        slots = paged_slots(block_table[seq], (token - ks)[:, None], self.layout.page_size).squeeze(1)
        k_fp8, k_scale = self.layout.load(kv_cache, slots, c.fp8_dtype)
        scores = torch.einsum("thd,sd->ths", q_fp8.float(), k_fp8.float())
        if self.variant == "clamped_at_a_quarter":  # max(s, 0.25) is not relu(s)
            scores = scores.clamp_min(0.25)
        elif self.variant == "relu_as_where":
            scores = torch.where(scores > 0, scores, 0.0)
        elif self.variant == "relu_as_masked_fill":
            scores = scores.masked_fill(scores < 0, 0.0)
        elif self.variant != "no_relu":
            scores = scores.relu()
        if self.variant == "k_scale_after_sum":
            scores = (scores * weights.unsqueeze(-1)).sum(dim=1) * k_scale
        elif self.variant == "heads_summed_by_einsum":  # the same sum, as an mm with the weights
            scores = torch.einsum("ths,th->ts", scores * k_scale, weights)
        elif self.variant == "heads_summed_by_einsum_with_one_token_weights":  # every token weighted by token 0's
            scores = torch.einsum("ths,h->ts", scores * k_scale, weights[0])
        else:
            scores = (scores * k_scale * weights.unsqueeze(-1)).sum(dim=1)
        if self.variant == "strictly_causal":
            visible = (token >= ks[:, None]) & (token < token[:, None])
        elif self.variant == "not_ragged":
            visible = token <= token[:, None]
        else:
            visible = (token >= ks[:, None]) & (token <= token[:, None])
        if self.variant == "wider_buffer":  # written into a wider -inf buffer, then masked there
            logits = torch.full((num_tokens, num_tokens + 16), float("-inf"))
            logits[:, :num_tokens] = scores
            cols = torch.arange(num_tokens + 16)
            logits = logits.masked_fill(~((cols >= ks[:, None]) & (cols <= token[:, None])), float("-inf"))
            return logits, self._topk(logits, ks)
        logits = torch.where(visible, scores, float("-inf"))
        return logits, self._topk(logits, ks)


@pytest.mark.parametrize("variant", ["k_scale_after_sum", "relu_as_where", "relu_as_masked_fill",
                                     "heads_summed_by_einsum"])
def test_takes_the_same_terms_spelled_otherwise(variant):
    """``(relu(q·k) * w).sum(h) * k_scale``, the relu as ``where(s > 0, s, 0)`` or ``masked_fill(s < 0, 0)``, or the
    heads summed by an einsum with the weights: the same terms, rewritten; compiled equals eager."""
    config, layout = CONFIGS["deepseek_v32"], LAYOUTS["paged"]
    model = type("V", (Variant,), {"variant": variant})(config, layout)
    model.reset_parameters(torch.Generator().manual_seed(0))
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"nsa-prefill-{variant}-"))
    options = {"nsa.layout": "paged", "nsa.page_size": layout.page_size, "nsa.dump_dir": str(dump_dir)}
    compiled_fn = torch.compile(model.prefill, backend="nsa_rocm", options=options)
    assert_matches_eager(model.prefill, compiled_fn, prefill_batch(config, layout, [9, 17, 1], padding_tokens=3, seed=3))
    assert_fired(dump_dir)


NEGATIVES = {
    "strictly_causal": ("paged", "paged", "mask"),
    "not_ragged": ("paged", "paged", "mask"),
    "no_relu": ("paged", "paged", "relu"),
    "clamped_at_a_quarter": ("paged", "paged", "through clamp_min"),
    "layout_paged_vs_preshuffle": ("paged", "preshuffle", "offsets"),
    "wider_buffer": ("paged", "paged", "wider -inf buffer"),
    "heads_summed_by_einsum_with_one_token_weights": ("paged", "paged", "per (row, head)"),
}


@pytest.mark.parametrize("variant", sorted(NEGATIVES))
def test_does_not_fire_on_lookalikes(variant):
    eager_layout, compiled_layout, words = NEGATIVES[variant]
    config, layout = CONFIGS["deepseek_v32"], LAYOUTS[eager_layout]
    model = type("V", (Variant,), {"variant": variant})(config, layout)
    model.reset_parameters(torch.Generator().manual_seed(0))
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"nsa-neg-prefill-{variant}-"))
    c_layout = LAYOUTS[compiled_layout]
    options = {"nsa.layout": compiled_layout, "nsa.page_size": c_layout.page_size, "nsa.dump_dir": str(dump_dir)}
    compiled_fn = torch.compile(model.prefill, backend="nsa_rocm", options=options)
    assert_matches_eager(model.prefill, compiled_fn, prefill_batch(config, layout, [9, 17, 1], padding_tokens=3, seed=3))
    reasons = near_miss_reasons(dump_dir, NAME)
    assert reasons and any(words in r for r in reasons), reasons
