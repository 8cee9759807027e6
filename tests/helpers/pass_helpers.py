"""Compile a function with nsa_rocm, dumping graphs, and read what each pass did."""

from __future__ import annotations

import copy
import json
import pathlib
import re
import tempfile

import torch


def compile_with_dumps(fn, options: dict | None = None, dynamic: bool | None = None):
    """``(compiled_fn, dump_dir)``; every graph the compiled function produces lands under ``dump_dir``.

    ``dynamic=False`` keeps shapes static even when many functions share one code object (Dynamo would otherwise
    turn sizes that differ between them into symbols).
    """
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix="nsa-pass-"))
    compiled = torch.compile(fn, backend="nsa_rocm", dynamic=dynamic,
                             options={"nsa.dump_dir": str(dump_dir), **(options or {})})
    return compiled, dump_dir


def store_pass_graph(fn, x, cache, slots) -> pathlib.Path:
    """Runs ``fn(x, cache, slots)`` (a K store into a paged cache of 16-token pages) eagerly on a copy of ``cache``
    and compiled with static shapes on ``cache`` itself; the two caches must be equal byte for byte. Returns the one
    graph's dump directory."""
    want = cache.clone()
    fn(x, want, slots)
    compiled, dump_dir = compile_with_dumps(fn, {"nsa.layout": "paged", "nsa.page_size": 16}, dynamic=False)
    compiled(x, cache, slots)
    assert torch.equal(cache, want), "compiled store differs from eager"
    (graph,) = graph_dirs(dump_dir)
    return graph


def graph_dirs(dump_dir: pathlib.Path) -> list[pathlib.Path]:
    """The graphs dumped under ``dump_dir`` (never none: a dump that fails only warns, and a loop over no graph
    asserts nothing)."""
    dirs = sorted(p for p in dump_dir.iterdir() if p.is_dir())
    assert dirs, f"no graph was dumped under {dump_dir}"
    return dirs


def read_report(graph_dir: pathlib.Path) -> dict:
    return json.loads((graph_dir / "report.json").read_text())


def rewrites(report: dict) -> dict[str, int]:
    """Rewrites per pass in a graph's report, but ``unpad_gemm``'s: how many GEMMs Inductor's ``pad_mm`` padded
    depends on the device and the sizes (none on the CPU), not on the indexer."""
    return {p["name"]: p["matched"] for p in report["passes"] if p["name"] != "unpad_gemm"}


def pass_entry(graph_dir: pathlib.Path, name: str) -> dict:
    (entry,) = [p for p in read_report(graph_dir)["passes"] if p["name"] == name]
    return entry


def near_miss_reasons(dump_dir: pathlib.Path, name: str) -> list[str]:
    """The near-miss reasons pass ``name`` reported over every graph under ``dump_dir``; it must not have fired."""
    reasons = []
    for g in graph_dirs(dump_dir):
        entry = pass_entry(g, name)
        assert entry["matched"] == 0, f"{name} fired on {g}"
        reasons += [m["reason"] for m in entry["near_misses"]]
    return reasons


def pass_graphs(graph_dir: pathlib.Path, name: str) -> tuple[str, str]:
    """Source of the graph just before and just after pass ``name``."""
    (before,) = graph_dir.glob(f"*_{name}.before.py")
    (after,) = graph_dir.glob(f"*_{name}.after.py")
    return before.read_text(), after.read_text()


def count_ops(source: str, op: str) -> int:
    """Calls of ``op`` (e.g. ``"aten.slice_scatter"`` or ``"nsa.quant_cache_store"``) in a dumped graph, including
    a mutating op called through ``auto_functionalized``."""
    return len(re.findall(rf"torch\.ops\.{re.escape(op)}\.\w+[(,]", source))


def functional_graph(fn, *args):
    """``fn`` traced like the post-grad graph: functional aten with fake ``meta["val"]`` on every node."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(torch.func.functionalize(fn, remove="mutations"), decomposition_table=select_decomp_table(),
                   tracing_mode="fake")(*args)


def run_pass(graph_pass, count, fn, *args):
    """Apply ``graph_pass`` to ``fn``'s functional graph: ``(result, output before, output after, removed)`` where
    ``removed`` is how many nodes ``count(gm)`` the pass took away."""
    gm = functional_graph(fn, *args)
    before = gm(*args)
    counted = count(gm)
    result = graph_pass(gm.graph, None)
    gm.graph.lint()
    gm.recompile()
    after = gm(*args)
    return result, before, after, counted - count(gm)


def assert_k_cache_matches(expected, actual, slots, layout=None) -> dict | None:
    """The K-cache slots a step wrote (``slots``) hold eager's bytes up to the documented bound of a changed
    summation order (``nsa_inductor.cache_difference``, docs/numerics.md); every other byte is identical. Returns
    the written slots' difference (None: the caches are equal). ``layout``: default row-major pages of the cache's
    row size."""
    from nsa_inductor.cache_difference import changed_slots, k_cache_problems
    from nsa_inductor.layout import KCacheLayout, TOKEN_BYTES

    if torch.equal(expected, actual):
        return None
    layout = layout or KCacheLayout(expected.shape[1] // TOKEN_BYTES)
    unwritten = set(changed_slots(layout, expected, actual).tolist()) - set(slots.tolist())
    assert not unwritten, f"slots the step did not write differ: {sorted(unwritten)[:8]}"
    problems, diff = k_cache_problems(layout, expected, actual, slots)
    assert not problems, problems
    return diff


def eager_logits_on_cache(eager_fn, batch, cache, term_sizes: bool = False) -> torch.Tensor | None:
    """Eager's logits of ``batch`` read from the K that another run wrote into ``cache`` (a copy is used): eager's
    q, gates and sums with that run's K. None where ``eager_fn`` is not a method of an :class:`Indexer`, whose
    steps read their keys back from the cache after storing them (its ``store_k`` is skipped for this run).
    ``term_sizes``: with the gates' absolute values, each logit's sum over heads of ``|w| relu(q . k)``: the size of
    its terms, which bounds what summing them in another order can move it by."""
    from nsa_inductor.indexer import Indexer

    model = getattr(eager_fn, "__self__", None)
    if not isinstance(model, Indexer):
        return None
    reader = copy.copy(model)  # the compiled functions' module stays as it was: no guard sees a change
    reader.store_k = lambda *unused: None
    if term_sizes:
        reader.head_gates = lambda x, q_scale: model.head_gates(x, q_scale).abs()
    args = list(batch.clone().args)
    args[4] = cache.clone()
    with torch.no_grad():
        return getattr(reader, eager_fn.__name__)(*args)[0]


def assert_step_logits_close(actual, expected, moved, eager_fn=None, batch=None, cache=None) -> None:
    """A step's logits against eager's, whose K caches differ by ``moved`` (``assert_k_cache_matches``' result).

    Where K moved and eager's step ``eager_fn`` of ``batch`` can read the step's ``cache`` back
    (:func:`eager_logits_on_cache`): within the logits' own 1e-3 of that, at any number of tokens. Otherwise: within
    1e-3 widened for the keys whose K moved, and within 1e-3 outside those keys' columns (docs/numerics.md), which a
    one-token step's single logit can exceed where its head terms nearly cancel."""
    from helpers.reference64 import assert_logits_close
    from nsa_inductor.cache_difference import error_outside_moved_keys, logits_rtol

    on_moved_k = eager_logits_on_cache(eager_fn, batch, cache) if moved and eager_fn is not None else None
    if on_moved_k is not None:
        assert_logits_close(actual, on_moved_k)
        return
    assert_logits_close(actual, expected, logits_rtol(1e-3, moved))
    keys = moved["tokens_moved"] if moved else 0
    outside = error_outside_moved_keys(expected.cpu(), actual.cpu(), keys)
    assert outside <= 1e-3, f"relative error {outside:.3e} outside the {keys} moved keys' columns > 1e-3"


def assert_matches_eager(eager_fn, compiled_fn, batch, prepare=lambda b: b, same_topk=True):
    """Run both on clones of ``batch`` (``prepare`` adjusts the compiled side's clone): cache bytes identical up to
    the documented bound of ``wk_gate_gemm`` (``assert_k_cache_matches``), logits within DESIGN §4 with identical
    -inf masks, top-k index sets equal (``same_topk=False``, for GPU kernels whose fp8 dots sum in another order:
    a top k of the compiled logits, so near-tied keys may swap)."""
    from helpers.reference64 import topk_sets_valid

    eager, comp = batch.clone(), prepare(batch.clone())
    with torch.no_grad():
        logits, topk = eager_fn(*eager.args)
        c_logits, c_topk = compiled_fn(*comp.args)
    moved = assert_k_cache_matches(eager.kv_cache, comp.kv_cache, batch.slot_mapping,
                                   getattr(getattr(eager_fn, "__self__", None), "layout", None))
    assert_step_logits_close(c_logits, logits, moved, eager_fn, batch, comp.kv_cache)
    if not same_topk:
        topk_sets_valid(c_logits, c_topk, c_topk.shape[1])
        return
    assert (c_topk.shape, c_topk.dtype) == (topk.shape, topk.dtype), (c_topk.shape, c_topk.dtype)
    for row, (a, b) in enumerate(zip(topk, c_topk)):
        assert set(a.tolist()) == set(b.tolist()), f"top-k sets differ in row {row}"


def to_logits(gates: torch.Tensor) -> torch.Tensor:
    """Indexer logits weighted by ``gates [T, H]`` (through the ``nsa`` op): the consumer the pass requires."""
    tokens, heads = gates.shape
    q8 = torch.ones(tokens, heads, 128, device=gates.device).to(torch.float8_e4m3fn)
    k8 = torch.ones(4, 128, device=gates.device).to(torch.float8_e4m3fn)
    ks = torch.zeros(tokens, dtype=torch.int32, device=gates.device)
    return torch.ops.nsa.mqa_logits(q8, k8, torch.ones(4, device=gates.device), gates, ks, ks + 4)
