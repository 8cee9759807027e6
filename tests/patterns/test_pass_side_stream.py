"""side_stream: the K side of a decode step (``nsa.wk_gate_gemm`` and the ``nsa.quant_cache_store`` of its k partials)
goes on a second CUDA stream and the ``nsa.paged_mqa_logits`` reading the gate partials and the cache joins it;
near misses where anything else reads what the K side writes, or writes what it reads. The pass only sets flags
(values unchanged, checked here on the CPU, where the ops ignore them); the streams run in the GPU tests."""

import pathlib
import tempfile

import pytest
import torch

import nsa_inductor  # noqa: F401  (registers torch.ops.nsa)

from helpers.pass_helpers import compile_with_dumps, graph_dirs, pass_entry, pass_graphs

FN = torch.float8_e4m3fn
nsa = torch.ops.nsa
TOKENS, HIDDEN, HEADS, PAGE, SPLITS = 3, 256, 16, 16, 2


def _k_side(x, gate_w, wk_w, cache, slots):
    gate_p, k_p = nsa.wk_gate_gemm(x, gate_w, wk_w, SPLITS, SPLITS, False)
    nsa.quant_cache_store(k_p, cache, slots, PAGE, False, "ue8m0", FN, round_k=True, k_split_sum=True)
    return gate_p, k_p


def _logits(q, cache, gates, lens, table):
    return nsa.paged_mqa_logits(q, cache, gates, lens, table, 2 * PAGE, PAGE, False)


def decode(x, gate_w, wk_w, cache, slots, q, lens, table):
    gate_p, _ = _k_side(x, gate_w, wk_w, cache, slots)
    return _logits(q, cache, gate_p, lens, table)


def decode_returning_the_gates(x, gate_w, wk_w, cache, slots, q, lens, table):
    gate_p, _ = _k_side(x, gate_w, wk_w, cache, slots)
    return _logits(q, cache, gate_p, lens, table), gate_p


def decode_returning_k(x, gate_w, wk_w, cache, slots, q, lens, table):
    gate_p, k_p = _k_side(x, gate_w, wk_w, cache, slots)
    return _logits(q, cache, gate_p, lens, table), k_p


def decode_summing_the_gates(x, gate_w, wk_w, cache, slots, q, lens, table):
    gate_p, _ = _k_side(x, gate_w, wk_w, cache, slots)
    return _logits(q, cache, gate_p[0] + gate_p[1], lens, table)


def decode_summing_k(x, gate_w, wk_w, cache, slots, q, lens, table):
    gate_p, k_p = nsa.wk_gate_gemm(x, gate_w, wk_w, SPLITS, SPLITS, False)
    nsa.quant_cache_store(k_p[0] + k_p[1], cache, slots, PAGE, False, "ue8m0", FN, round_k=True)
    return _logits(q, cache, gate_p, lens, table)


def decode_reading_the_cache_again(x, gate_w, wk_w, cache, slots, q, lens, table):
    return decode(x, gate_w, wk_w, cache, slots, q, lens, table), cache[:, :4].float().sum()


def decode_writing_x(x, gate_w, wk_w, cache, slots, q, lens, table):
    logits = decode(x, gate_w, wk_w, cache, slots, q, lens, table)
    x.mul_(2)
    return logits


@torch.library.custom_op("nsa_test::double_", mutates_args=("x",))
def double_(x: torch.Tensor) -> None:
    """A user's op that writes its argument: Dynamo calls it through ``auto_functionalized``."""
    x.mul_(2)


@double_.register_fake
def _(x):
    return None


def decode_writing_x_in_an_op(x, gate_w, wk_w, cache, slots, q, lens, table):
    logits = decode(x, gate_w, wk_w, cache, slots, q, lens, table)
    double_(x)
    return logits


def inputs():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16()
    gate_w = torch.randn(HEADS, HIDDEN, generator=gen) / 16
    wk_w = (torch.randn(128, HIDDEN, generator=gen) / 16).bfloat16()
    cache = torch.randint(0, 0x7F, (2 * TOKENS, PAGE * 132), dtype=torch.uint8, generator=gen)  # no NaN codes
    cache.view(torch.float32)[:, PAGE * 32:] = 2.0**-4  # readable scales where the store does not write
    slots = torch.tensor([1, PAGE + 3, 2 * PAGE + 5])
    q = (torch.randn(TOKENS, 1, HEADS, 128, generator=gen) * 4).to(FN)
    lens = torch.tensor([2, PAGE + 4, 2 * PAGE], dtype=torch.int32)
    table = torch.arange(2 * TOKENS, dtype=torch.int32).view(TOKENS, 2)
    return x, gate_w, wk_w, cache, slots, q, lens, table


def run(fn):
    """``fn`` compiled on the inputs (static shapes) against eager on copies: outputs and caches equal. Returns the
    one graph's dump directory."""
    args = inputs()
    eager_args = [a.clone() for a in args]
    want = fn(*eager_args)
    compiled, dump_dir = compile_with_dumps(fn, {"nsa.layout": "paged", "nsa.page_size": PAGE},
                                            dynamic=False)
    got = compiled(*args)
    for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert torch.equal(args[3], eager_args[3]), "compiled store differs from eager"
    (graph,) = graph_dirs(dump_dir)
    return graph


def test_the_k_side_goes_on_the_side_stream_and_the_logits_join_it():
    graph = run(decode)
    assert pass_entry(graph, "side_stream")["matched"] == 1
    _, after = pass_graphs(graph, "side_stream")
    lines = after.splitlines()
    (gemm,) = [line for line in lines if "nsa.wk_gate_gemm" in line]
    (store,) = [line for line in lines if "nsa.quant_cache_store" in line]
    (logits,) = [line for line in lines if "nsa.paged_mqa_logits" in line]
    assert "stream = 'fork'" in gemm and "stream = 'side'" in store and "join_side_stream = True" in logits


@pytest.mark.parametrize("fn, reason", [
    (decode_returning_the_gates, "not read by one nsa.paged_mqa_logits alone"),
    (decode_summing_the_gates, "not read by one nsa.paged_mqa_logits alone"),
    (decode_summing_k, "not read by one nsa.quant_cache_store alone"),
    (decode_returning_k, "not read by one nsa.quant_cache_store alone"),
    (decode_reading_the_cache_again, "is also used by"),
    (decode_writing_x, "read by the K side, is written by"),
    (decode_writing_x_in_an_op, "read by the K side, is written by auto_functionalized"),
])
def test_near_misses_keep_one_stream(fn, reason):
    entry = pass_entry(run(fn), "side_stream")
    assert entry["matched"] == 0 and len(entry["near_misses"]) == 1, entry
    assert reason in entry["near_misses"][0]["reason"]


def test_an_unknown_stream_is_refused():
    x, gate_w, wk_w = inputs()[:3]
    with pytest.raises(ValueError, match="stream must be one of"):
        nsa.wk_gate_gemm(x, gate_w, wk_w, SPLITS, SPLITS, False, stream="second")


def test_the_ops_ignore_the_flags_on_the_cpu():
    x, gate_w, wk_w, cache, slots, q, lens, table = inputs()
    plain = nsa.wk_gate_gemm(x, gate_w, wk_w, SPLITS, SPLITS, False)
    flagged = nsa.wk_gate_gemm(x, gate_w, wk_w, SPLITS, SPLITS, False, stream="fork")
    assert all(torch.equal(a, b) for a, b in zip(plain, flagged))
    c1, c2 = cache.clone(), cache.clone()
    nsa.quant_cache_store(plain[1], c1, slots, PAGE, False, "ue8m0", FN, round_k=True, k_split_sum=True)
    nsa.quant_cache_store(plain[1], c2, slots, PAGE, False, "ue8m0", FN, round_k=True, k_split_sum=True,
                          stream="side")
    assert torch.equal(c1, c2)
    assert torch.equal(_logits(q, c1, plain[0], lens, table),
                       nsa.paged_mqa_logits(q, c1, plain[0], lens, table, 2 * PAGE, PAGE, False,
                                            join_side_stream=True))


def test_the_pass_runs_unless_turned_off():
    from nsa_inductor.options import parse_options
    from nsa_inductor.patterns import passes_for

    assert "side_stream" in [p.name for p in passes_for(parse_options({})[0])]
    assert "side_stream" not in [p.name for p in passes_for(parse_options({"nsa.side_stream": False})[0])]


@pytest.mark.parametrize("entry, matched", [("decode", 1), ("prefill", 0)])
def test_the_reference_indexer(entry, matched):
    """The reference indexer's decode step is the shape the pass matches; its prefill's gate feeds nsa.mqa_logits
    (a near miss). Compiled equals eager as without the option."""
    from nsa_inductor.indexer import Indexer
    from helpers.models import CONFIGS, LAYOUTS, batches, compile_indexer
    from helpers.pass_helpers import assert_matches_eager, near_miss_reasons

    config, layout = CONFIGS["deepseek_v32"], LAYOUTS["paged"]
    model = Indexer(config, layout)
    model.reset_parameters(torch.Generator().manual_seed(0))
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix="nsa-side-stream-"))
    fn = getattr(model, entry)
    compiled = compile_indexer(fn, {"nsa.layout": "paged", "nsa.page_size": layout.page_size,
                                    "nsa.dump_dir": str(dump_dir)})
    batch = batches(config, layout, entry)[0]
    assert_matches_eager(fn, compiled, batch)
    (graph,) = graph_dirs(dump_dir)
    entry_report = pass_entry(graph, "side_stream")
    assert entry_report["matched"] == matched
    if not matched:
        assert "not read by one nsa.paged_mqa_logits alone" in near_miss_reasons(dump_dir, "side_stream")[0]


def decode_writing_a_view_of_x(x, gate_w, wk_w, cache, slots, q, lens, table):
    gate_p, _ = _k_side(x.unsqueeze(0)[0], gate_w, wk_w, cache, slots)
    logits = _logits(q, cache, gate_p, lens, table)
    x.add_(1)
    return logits


def test_a_write_to_the_base_of_a_view_the_k_side_reads_is_a_near_miss():
    entry = pass_entry(run(decode_writing_a_view_of_x), "side_stream")
    assert entry["matched"] == 0 and "read by the K side, is written by" in entry["near_misses"][0]["reason"], entry


def decode_with_computed_slots(x, gate_w, wk_w, cache, slots, q, lens, table):
    return decode(x, gate_w, wk_w, cache, torch.where(slots >= 0, slots, -1), q, lens, table)


def test_a_store_reading_a_computed_value_waits_for_the_current_stream():
    """The slots come from a kernel: the store forks again (``"fork"``) instead of following the GEMM."""
    graph = run(decode_with_computed_slots)
    assert pass_entry(graph, "side_stream")["matched"] == 1
    (store,) = [line for line in pass_graphs(graph, "side_stream")[1].splitlines() if "nsa.quant_cache_store" in line]
    assert "stream = 'fork'" in store
