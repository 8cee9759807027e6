"""wk_gate_gemm: the bf16 K projection joins the head gate's launch where both read one x and K reaches the cache.

The rewrite changes the K projection's summation order: K-cache bytes may differ from eager in a few values. The
bounds asserted here are docs/numerics.md's (section "K projection and head gate in one launch").
"""

import functools
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.models import CONFIGS, LAYOUTS, batches, compiled, other
from helpers.pass_helpers import assert_k_cache_matches, compile_with_dumps, count_ops, graph_dirs, pass_entry, \
    pass_graphs, read_report, to_logits
from helpers.reference64 import assert_logits_close

# docs/numerics.md: top-k recall of the compiled indexer against eager (the K-cache bound is assert_k_cache_matches').
MIN_TOPK_RECALL = 0.99


def gemms(source):
    return count_ops(source, "aten.mm") + count_ops(source, "aten.addmm")


CASES = {"deepseek_v32 decode": lambda: compiled("deepseek_v32", "paged", "decode"),
         "glm5 decode": lambda: compiled("glm5", "paged", "decode"),
         "deepseek_v32 prefill": lambda: compiled("deepseek_v32", "paged", "prefill"),
         "other decode": lambda: other("paged", "decode")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fires_on_the_indexers_within_the_documented_bound(case):
    eager_fn, compiled_fn, dump_dir = CASES[case]()
    config, layout = CONFIGS["glm5" if case.startswith("glm5") else "deepseek_v32"], LAYOUTS["paged"]
    runs = batches(config, layout, case.split()[-1])
    for batch in runs:
        eager, comp = batch.clone(), batch.clone()
        with torch.no_grad():
            logits, topk = eager_fn(*eager.args)
            c_logits, c_topk = compiled_fn(*comp.args)
        assert_k_cache_matches(eager.kv_cache, comp.kv_cache, batch.slot_mapping, layout)
        assert_logits_close(c_logits, logits)
        found = sum(len({i for i in e if i >= 0} & set(c)) for e, c in zip(topk.tolist(), c_topk.tolist()))
        assert found >= MIN_TOPK_RECALL * int((topk >= 0).sum())
    checked = 0
    for graph_dir in graph_dirs(dump_dir):
        entry = pass_entry(graph_dir, "wk_gate_gemm")
        sized = [m["reason"] for m in entry["near_misses"] if "decode-sized" in m["reason"]]
        if sized:  # a prefill-sized graph another test compiled on the shared model: a near miss by design
            example = int(re.search(r"\(example (\d+)\)", sized[0]).group(1))
            assert example > max(batch.x.shape[0] for batch in runs), sized
            continue
        checked += 1
        assert entry["matched"] == 1, entry
        before, after = pass_graphs(graph_dir, "wk_gate_gemm")
        assert count_ops(before, "nsa.head_gate_gemm") == 1 and count_ops(after, "nsa.head_gate_gemm") == 0
        assert count_ops(after, "nsa.wk_gate_gemm") == 1
        assert gemms(after) == gemms(before) - 1, "the wk GEMM is gone"
    assert checked


def test_disabled_pass_keeps_eager_bytes():
    """``nsa.disable_passes=["wk_gate_gemm"]`` keeps eager's K projection and so eager's cache bytes."""
    from nsa_inductor.indexer import Indexer

    torch._dynamo.reset()  # Dynamo would serve Indexer.decode as an earlier test compiled it (with the pass on)
    config, layout = CONFIGS["deepseek_v32"], LAYOUTS["paged"]
    model = Indexer(config, layout)
    model.reset_parameters(torch.Generator().manual_seed(0))
    compiled_fn, dump_dir = compile_with_dumps(model.decode, {"nsa.layout": "paged", "nsa.page_size": 16,
                                                               "nsa.disable_passes": ["wk_gate_gemm"]})
    batch = batches(config, layout, "decode")[0]
    eager, comp = batch.clone(), batch.clone()
    with torch.no_grad():
        model.decode(*eager.args)
        compiled_fn(*comp.args)
    assert torch.equal(eager.kv_cache, comp.kv_cache)
    (graph_dir,) = graph_dirs(dump_dir)
    assert "wk_gate_gemm" not in [p["name"] for p in read_report(graph_dir)["passes"]]
    assert count_ops(pass_graphs(graph_dir, "head_gate_gemm")[1], "nsa.head_gate_gemm") == 1


# ---------------------------------------------------------------------------------------------------------------
# spellings and near misses: one module holds several gate + projection pairs, each on its own activation
# ---------------------------------------------------------------------------------------------------------------

K, GATES, D = 512, 8, 32


class Pairs(nn.Module):
    """Each ``x_*`` has a head gate ``F.linear(x.float(), W32)``; what its bf16 projections do differs:

    - ``fires``: ``LN(wk(x).float())`` stored into the cache (the indexer's K);
    - ``three_d``: the same on a 3-D x (reshapes around the GEMMs);
    - ``not_stored``: the projection is returned, never stored;
    - ``wide``: a 512-row projection stored;
    - ``act_weight``: the projection's weight is an activation (a graph input);
    - ``other_x``: the stored projection reads another activation than the gate.
    """

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(K, GATES, bias=False)
        self.wk = nn.Linear(K, D, bias=False, dtype=torch.bfloat16)
        self.wide = nn.Linear(K, 512, bias=False, dtype=torch.bfloat16)
        self.norm = nn.LayerNorm(D)
        self.requires_grad_(False)

    def k_of(self, y):
        return self.norm(y.float()).to(torch.bfloat16)

    def forward(self, x, x3, x_ns, x_wide, x_act, x_other, w_act, cache, slots):
        g = lambda t: F.linear(t.float(), self.gate.weight) * GATES**-0.5  # noqa: E731
        stored = [self.k_of(self.wk(x)), self.k_of(self.wk(x3)).flatten(0, 1), self.k_of(F.linear(x_act, w_act)),
                  self.k_of(self.wk(x_other))]
        wide = self.wide(x_wide).float().sum(-1, keepdim=True).expand(-1, D).to(torch.bfloat16)
        rows = torch.cat([*stored, wide])
        cache[slots] = rows.view(torch.uint8)
        gates = [g(x), g(x3).flatten(0, 1), g(x_ns), g(x_wide), g(x_act), g(x_other[:1].expand(x.shape[0], -1) + 1)]
        return to_logits(torch.cat(gates, 1)), self.wk(x_ns)  # gates weighting logits: what head_gate_gemm needs


def pair_inputs(tokens):
    gen = torch.Generator().manual_seed(tokens)
    x = [torch.randn(tokens, K, generator=gen).bfloat16() for _ in range(5)]
    x3 = torch.randn(1, tokens, K, generator=gen).bfloat16()
    w_act = (torch.randn(D, K, generator=gen) * K**-0.5).bfloat16()
    cache = torch.zeros(8 * tokens, 2 * D, dtype=torch.uint8)
    slots = torch.randperm(8 * tokens, generator=gen)[: 5 * tokens]
    return x[0], x3, x[1], x[2], x[3], x[4], w_act, cache, slots


@functools.cache
def compiled_pairs(tokens):
    torch.manual_seed(0)
    module = Pairs()
    for linear in (module.gate, module.wk, module.wide):
        nn.init.normal_(linear.weight, std=K**-0.5)
    return module, *compile_with_dumps(module, {}, dynamic=False)


@pytest.mark.parametrize("tokens", [1, 6])
def test_pairs_fire_and_near_misses(tokens):
    """Size 1 (Dynamo specialises it) and 6 tokens: the two proper pairs fire, each look-alike is a near miss."""
    module, compiled_fn, dump_dir = compiled_pairs(tokens)
    inputs = pair_inputs(tokens)
    eager_cache, comp_cache = inputs[-2].clone(), inputs[-2].clone()
    with torch.no_grad():
        expected = module(*inputs[:-2], eager_cache, inputs[-1])
        actual = compiled_fn(*inputs[:-2], comp_cache, inputs[-1])
    (graph_dir,) = graph_dirs(dump_dir)
    report = pass_entry(graph_dir, "wk_gate_gemm")
    before, after = pass_graphs(graph_dir, "wk_gate_gemm")
    assert report["matched"] == 2, report
    assert count_ops(after, "nsa.wk_gate_gemm") == 2
    assert count_ops(after, "nsa.head_gate_gemm") == count_ops(before, "nsa.head_gate_gemm") - 2 == 4
    assert gemms(after) == gemms(before) - 2
    reasons = [m["reason"] for m in report["near_misses"]]
    for expect in ("never reaches the K-cache store", "512 output columns", "non-parameter graph input",
                   "not the gate's activation"):
        assert sum(expect in r for r in reasons) == 1, (expect, reasons)
    assert len(reasons) == 4, reasons
    logits, logits_c = expected[0].double(), actual[0].double()  # the gates' head sums cancel: DESIGN §4's 1e-3
    assert float((logits - logits_c).norm() / logits.norm()) <= 1e-3
    assert torch.equal(expected[1], actual[1]), "a projection the pass left alone"
    k, k_c = eager_cache.view(torch.bfloat16).float(), comp_cache.view(torch.bfloat16).float()
    torch.testing.assert_close(k_c, k, rtol=2**-7, atol=2**-7)  # one bf16 ulp: the sum order may differ


class KAndGate(nn.Module):
    """The indexer's two projections of x alone: K through LayerNorm into a byte cache, the gate scaled."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(K, GATES, bias=False)
        self.wk = nn.Linear(K, D, bias=False, dtype=torch.bfloat16)
        self.norm = nn.LayerNorm(D)
        self.requires_grad_(False)

    def forward(self, x, cache, slots, q_scale):
        cache[slots] = self.norm(self.wk(x).float()).to(torch.bfloat16).view(torch.uint8)
        return to_logits(F.linear(x.float(), self.gate.weight) * q_scale)


def assert_k_and_gate_match(module, compiled_fn, tokens, logits_rtol):
    """Eager and compiled ``KAndGate`` on random inputs of ``tokens`` rows: logits within ``logits_rtol``, K within
    one bf16 ulp (the sum order may differ)."""
    gen = torch.Generator().manual_seed(tokens)
    x, q_scale = torch.randn(tokens, K, generator=gen).bfloat16(), torch.rand(tokens, GATES, generator=gen)
    cache, slots = torch.zeros(16, 2 * D, dtype=torch.uint8), torch.randperm(16, generator=gen)[:tokens]
    eager_cache, comp_cache = cache.clone(), cache.clone()
    with torch.no_grad():
        expected, actual = module(x, eager_cache, slots, q_scale), compiled_fn(x, comp_cache, slots, q_scale)
    assert float((actual - expected).double().norm() / expected.double().norm()) <= logits_rtol
    k, k_c = eager_cache.view(torch.bfloat16).float(), comp_cache.view(torch.bfloat16).float()
    torch.testing.assert_close(k_c, k, rtol=2**-7, atol=2**-7)


def test_dynamic_rows_take_the_last_split_row():
    """A symbolic token count reaches the op as is; the splits are ``SPLITS``' last row (capped by K / 128)."""
    from nsa_inductor.patterns.wk_gate_gemm import splits_for

    torch.manual_seed(0)
    module = KAndGate()
    compiled_fn, dump_dir = compile_with_dumps(module, {}, dynamic=True)
    for tokens in (5, 9):
        assert_k_and_gate_match(module, compiled_fn, tokens, logits_rtol=1e-5)
    splits = splits_for(None, K)
    for graph_dir in graph_dirs(dump_dir):
        assert pass_entry(graph_dir, "wk_gate_gemm")["matched"] == 1
        _, after = pass_graphs(graph_dir, "wk_gate_gemm")
        assert re.search(rf"nsa\.wk_gate_gemm\.default\(\w+, \w+, \w+, {splits[0]}, {splits[1]}, False\)", after), after


class PaddedKAndGate(KAndGate):
    """``KAndGate`` with the K projection as Inductor's ``pad_mm`` leaves it on GPUs: x's rows padded with ``pad``
    zero rows (or, with ``columns``, its K columns and the weight's), the product sliced back."""

    pad, columns = 2, False

    def forward(self, x, cache, slots, q_scale):
        if self.columns:
            k = torch.mm(F.pad(x, (0, self.pad)), F.pad(self.wk.weight, (0, self.pad)).t())
        else:
            k = torch.mm(F.pad(x, (0, 0, 0, self.pad)), self.wk.weight.t())[: x.shape[0]]
        cache[slots] = self.norm(k.float()).to(torch.bfloat16).view(torch.uint8)
        return to_logits(F.linear(x.float(), self.gate.weight) * q_scale)


@pytest.mark.parametrize("tokens, columns", [(6, False), (1, False), (6, True)])
def test_sees_through_pad_mm_row_padding(tokens, columns):
    """Rows padded for the GEMM (what ``pad_mm`` does to a 6-token decode on the H200): ``unpad_gemm`` gives the pass
    the plain GEMM, the fused op reads x itself; K padded on the weight before its transpose is not ``pad_mm``'s form
    and stays: a near miss."""
    torch.manual_seed(0)
    module = type("M", (PaddedKAndGate,), {"columns": columns})()
    compiled_fn, dump_dir = compile_with_dumps(module, {}, dynamic=False)
    assert_k_and_gate_match(module, compiled_fn, tokens, logits_rtol=1e-3)  # DESIGN §4 (1 token: the split's error)
    (graph_dir,) = graph_dirs(dump_dir)
    report = pass_entry(graph_dir, "wk_gate_gemm")
    _, after = pass_graphs(graph_dir, "wk_gate_gemm")
    if columns:
        assert report["matched"] == 0 and "no K projection to share the launch" in report["near_misses"][0]["reason"]
    else:
        assert report["matched"] == 1, report
        assert count_ops(after, "aten.constant_pad_nd") == 0 and gemms(after) == 0


def test_prefill_sized_token_counts_keep_cublas():
    """More than MAX_TOKENS tokens (a prefill): a near miss, the bf16 GEMM and eager's bytes stay."""
    from nsa_inductor.patterns.wk_gate_gemm import MAX_TOKENS

    torch.manual_seed(0)
    module = KAndGate()
    compiled_fn, dump_dir = compile_with_dumps(module, {}, dynamic=False)
    tokens = MAX_TOKENS + 1
    gen = torch.Generator().manual_seed(tokens)
    x, q_scale = torch.randn(tokens, K, generator=gen).bfloat16(), torch.rand(tokens, GATES, generator=gen)
    cache, slots = torch.zeros(tokens, 2 * D, dtype=torch.uint8), torch.randperm(tokens, generator=gen)
    eager_cache, comp_cache = cache.clone(), cache.clone()
    with torch.no_grad():
        module(x, eager_cache, slots, q_scale), compiled_fn(x, comp_cache, slots, q_scale)
    assert torch.equal(eager_cache, comp_cache)
    (graph_dir,) = graph_dirs(dump_dir)
    entry = pass_entry(graph_dir, "wk_gate_gemm")
    assert entry["matched"] == 0
    assert any("decode-sized" in m["reason"] for m in entry["near_misses"]), entry


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
