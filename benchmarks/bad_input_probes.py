"""Bad inputs tried on every ``nsa`` op and on whole compiled steps, counted as issue 12 asks: clear errors, results
per the index contract (docs/indices.md), silent differences (target 0), memory touched outside the tensors
(target 0). CPU only; prints one markdown table and the probes that were not a clear error or a contract result.

    TRITON_INTERPRET=1 python benchmarks/bad_input_probes.py [--no-compiled]

Three groups:
- arguments: every tensor argument of every op with another dtype, one more dimension, or one more row; the op
  (validation, then the CPU reference) must raise an error naming the argument, or accept a variant it supports.
- ids and values: slots, page ids, lengths, sequence bounds and NaN/inf at and past every edge, through the torch
  reference (the contract) and the Triton kernel (under the interpreter) with every tensor inside a guarded buffer:
  the two must agree (or both raise naming the argument) and no guard byte may change.
- compiled steps: the small reference indexer's decode and prefill, compiled, against eager on bad ids; where eager
  raises, the compiled step must give the contract's masked result, and under ``nsa.checks`` raise naming the
  argument.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # (last: a package on PYTHONPATH, an A/B's, wins)
sys.path.insert(0, str(ROOT / "tests"))  # the tests' helpers: random caches, guarded buffers, references

import nsa_inductor  # noqa: E402,F401  registers torch.ops.nsa
from nsa_inductor.layout import KCacheLayout  # noqa: E402
from helpers.guards import Guarded  # noqa: E402
from helpers.ops64 import FN, random_cache, random_fp8  # noqa: E402

P, PAGES, HEADS = 16, 4, 4  # page size, cache pages, q heads
LAYOUT = KCacheLayout(P)
NUM_SLOTS = P * PAGES
EDGE_IDS = {"limit": None, "limit+1": 1, "1e9": 10**9, "int32 max": 2**31 - 1, "-1": -1, "-limit-1": None,
            "int32 min": -(2**31)}
OUTCOMES = ("clear error", "contract result", "accepted variant", "unclear error", "silent difference",
            "memory outside")

results: list[tuple[str, str, str, str]] = []  # (group, probe, outcome, detail)


def record(group: str, probe: str, outcome: str, detail: str = "") -> None:
    results.append((group, probe, outcome, detail))


def gen(seed=0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------------
# the ops' good calls
# ---------------------------------------------------------------------------------------------------------------


def good_calls() -> dict[str, tuple]:
    """op name -> (op, positional arguments that are valid)."""
    g = gen(1)
    cache = random_cache(PAGES, P, FN, g)
    table = torch.tensor([[2, 0, 1, 3]], dtype=torch.int32)
    q = random_fp8((1, 1, HEADS, 128), FN, g)
    nsa = torch.ops.nsa
    return {
        "quant_cache_store": (nsa.quant_cache_store, [torch.randn(3, 128, generator=g).bfloat16(), cache.clone(),
                                                      torch.tensor([5, -1, 20]), P, False, "ue8m0", FN]),
        "gather_k": (nsa.gather_k, [cache, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                                    torch.tensor([0, 20, 40], dtype=torch.int32), P, False, 42, FN]),
        "gather_k_slots": (nsa.gather_k_slots, [cache, torch.tensor([3, 17, 40]), P, False, FN, table,
                                                torch.tensor([0, 0, 0])]),
        "paged_mqa_logits": (nsa.paged_mqa_logits, [q, cache, torch.randn(1, HEADS, generator=g),
                                                    torch.tensor([40], dtype=torch.int32), table, 64, P, False]),
        "mqa_logits": (nsa.mqa_logits, [random_fp8((3, HEADS, 128), FN, g), random_fp8((10, 128), FN, g),
                                        torch.rand(10, generator=g), torch.randn(3, HEADS, generator=g),
                                        torch.tensor([0, 2, 0], dtype=torch.int32),
                                        torch.tensor([5, 9, 1], dtype=torch.int32)]),
        "topk_indices": (nsa.topk_indices, [torch.randn(3, 50, generator=g), 8,
                                            torch.tensor([50, 3, 20], dtype=torch.int32), None, "neg1", True]),
        "rotate_act_quant": (nsa.rotate_act_quant, [torch.randn(2, HEADS, 128, generator=g).bfloat16(),
                                                    torch.ones(128, 128), 128**-0.5, False, 128, "ue8m0", FN, 448.0]),
    }


OP_ARG_NAMES = {
    "quant_cache_store": ["k", "cache", "slot_mapping"],
    "gather_k": ["cache", "block_table", "cu_seqlens"],
    "gather_k_slots": ["cache", "positions", "page_size", "preshuffle", "fp8_dtype", "block_table", "seq_ids"],
    "paged_mqa_logits": ["q_fp8", "cache", "weights", "context_lens", "block_table"],
    "mqa_logits": ["q_fp8", "k_fp8", "k_scale", "weights", "ks", "ke"],
    "topk_indices": ["logits", "k", "lengths"],
    "rotate_act_quant": ["x", "rotation"],
}


def _other_dtypes(dtype: torch.dtype) -> list[torch.dtype]:
    options = [torch.float32, torch.bfloat16, torch.int32, torch.int64, torch.uint8, FN]
    return [d for d in options if d != dtype][:3]


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == FN or t.dtype == FN:
        return t.view(torch.uint8).to(torch.float32).to(dtype) if t.dtype == FN else t.float().to(dtype)
    return t.to(dtype)


def _call(op, args) -> tuple[str, object]:
    try:
        return "ok", op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    except (ValueError, TypeError, RuntimeError, IndexError) as e:
        return "error", e


def probe_arguments() -> None:
    for name, (op, args) in good_calls().items():
        for i, arg_name in enumerate(OP_ARG_NAMES[name]):
            value = args[i]
            if not isinstance(value, torch.Tensor):
                continue
            variants = [(f"dtype {d}".replace("torch.", ""), _cast(value, d)) for d in _other_dtypes(value.dtype)]
            variants.append(("one more dim", value.unsqueeze(0)))
            if value.dim() >= 1:
                variants.append(("one more row", torch.cat([value, value[:1]])))
            for what, bad in variants:
                status, out = _call(op, [*args[:i], bad, *args[i + 1:]])
                probe = f"{name}({arg_name}: {what})"
                if status == "ok":
                    record("arguments", probe, "accepted variant")
                elif arg_name in str(out):
                    record("arguments", probe, "clear error")
                else:
                    record("arguments", probe, "unclear error", f"{type(out).__name__}: {str(out)[:120]}")


# ---------------------------------------------------------------------------------------------------------------
# ids and values: reference (the contract) against the Triton kernel in guarded buffers
# ---------------------------------------------------------------------------------------------------------------


def _compare(probe: str, reference, kernel, guards: list[Guarded], names: str) -> None:
    """Run both; the outcome of the pair."""
    ref_status, ref = _call_raw(reference)
    ker_status, ker = _call_raw(kernel)
    try:
        for guarded in guards:
            guarded.assert_guards_intact()
    except AssertionError as e:
        record("ids and values", probe, "memory outside", str(e)[:160])
        return
    if ref_status == "error" or ker_status == "error":
        errors = [e for s, e in ((ref_status, ref), (ker_status, ker)) if s == "error"]
        if ref_status == ker_status and all(any(n in str(e) for n in names.split("|")) for e in errors):
            record("ids and values", probe, "clear error")
        else:
            record("ids and values", probe, "unclear error" if ref_status == ker_status else "silent difference",
                   "; ".join(f"{type(e).__name__}: {str(e)[:100]}" for e in errors))
        return
    same = all(_equal(a, b) for a, b in zip(_flat(ref), _flat(ker)))
    record("ids and values", probe, "contract result" if same else "silent difference")


def _call_raw(fn):
    try:
        return "ok", fn()
    except (ValueError, TypeError, RuntimeError, IndexError) as e:
        return "error", e


def _flat(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Integers and bytes exactly; fp8 values as numbers (a NaN's sign bit is not part of the contract); fp32 sums
    to 1e-5 relative (the kernel adds in another order), with the same NaN and ±inf positions."""
    if a.dtype == FN:
        a, b = a.float(), b.float()
    if not a.is_floating_point():
        return torch.equal(a, b)
    for mask in (torch.isnan, torch.isposinf, torch.isneginf):
        if not torch.equal(mask(a), mask(b)):
            return False
    finite = torch.isfinite(a)
    return bool(torch.allclose(a[finite], b[finite], rtol=1e-5, atol=1e-6))


def _cache_contents(cache: torch.Tensor):
    """Every slot's fp8 values and scale (compared as numbers, not bytes)."""
    return LAYOUT.load(cache, torch.arange(NUM_SLOTS), FN)


def _ids(limit: int) -> dict[str, int]:
    return {name: (limit if name == "limit" else -limit - 1 if name == "-limit-1" else v)
            for name, v in EDGE_IDS.items()}


def probe_ids_and_values() -> None:
    from nsa_inductor.lowering.gather_k import reference as gather_ref, triton as gather_tri
    from nsa_inductor.lowering.mqa_logits import reference as mqa_ref, triton as mqa_tri
    from nsa_inductor.lowering.paged_mqa_logits import reference as paged_ref, triton as paged_tri
    from nsa_inductor.lowering.quant_cache_store import reference as store_ref, triton as store_tri
    from nsa_inductor.lowering.rotate_act_quant import reference as rot_ref, triton as rot_tri
    from nsa_inductor.lowering.topk_indices import reference as topk_ref, triton as topk_tri

    g = gen(2)
    base_cache = random_cache(PAGES, P, FN, g)

    # quant_cache_store: slots at and past both ends, duplicates; K with NaN and inf
    k = torch.randn(3, 128, generator=g).bfloat16()
    slot_cases = {f"slot {n}": [5, v, 20] for n, v in _ids(NUM_SLOTS).items()}
    slot_cases["duplicate slots"] = [7, 7, 7]
    k_cases = {"NaN in K": float("nan"), "inf in K": float("inf")}
    for name, slots in [*slot_cases.items(), *[(n, [5, 6, 7]) for n in k_cases]]:
        kk = k.clone()
        if name in k_cases:
            kk[1, 3] = k_cases[name]
        ref_cache, guarded = base_cache.clone(), Guarded(base_cache.shape, torch.uint8, gen(3), fill=base_cache)
        s = torch.tensor(slots, dtype=torch.int64)

        def ref_call(kk=kk, s=s, c=ref_cache):
            store_ref.quant_cache_store(kk, c, s, P, False, "ue8m0", FN)
            return _cache_contents(c)

        def ker_call(kk=kk, s=s, c=guarded.view):
            store_tri.quant_cache_store(kk, c, s, P, False, "ue8m0", FN)
            return _cache_contents(c)

        _compare(f"quant_cache_store({name})", ref_call, ker_call, [guarded], "slot_mapping")

    # gather_k: page ids and cu_seqlens
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cu = torch.tensor([0, 20, 40], dtype=torch.int32)
    cases = {f"page {n}": (v, cu) for n, v in _ids(PAGES).items()}
    cases.update({"cu_seqlens[0] = 4": (None, torch.tensor([4, 20, 40], dtype=torch.int32)),
                  "cu_seqlens decreasing": (None, torch.tensor([0, 30, 20], dtype=torch.int32)),
                  "cu_seqlens past the table": (None, torch.tensor([0, 20, 90], dtype=torch.int32)),
                  "cu_seqlens negative": (None, torch.tensor([0, -5, 10], dtype=torch.int32))})
    for name, (page, cus) in cases.items():
        t = table.clone()
        if page is not None:
            t[1, 0] = page
        guarded = Guarded(base_cache.shape, torch.uint8, gen(4), fill=base_cache)
        out_k, out_s = Guarded((42, 128), torch.uint8, gen(5)), Guarded((42,), torch.float32, gen(6))
        _compare(f"gather_k({name})",
                 lambda t=t, cus=cus: gather_ref.gather_k(base_cache, t, cus, P, False, 42, FN),
                 lambda t=t, cus=cus: gather_tri.gather_k(guarded.view, t, cus, P, False, 42, FN,
                                                          out=(out_k.view.view(FN), out_s.view)),
                 [guarded, out_k, out_s], "cu_seqlens|block_table")

    # gather_k_slots: flat slot ids; sequence ids, positions and page ids through a block table
    from nsa_inductor.lowering.gather_k_slots import reference as slots_ref, triton as slots_tri

    table = torch.tensor([[2, 0, 1, 3], [3, 1, 0, 2]], dtype=torch.int32)
    cases = {f"slot {n}": (torch.tensor([3, v, 40]), None, None) for n, v in _ids(NUM_SLOTS).items()}
    cases.update({f"seq id {n}": (torch.tensor([3, 17, 40]), table, torch.tensor([0, v, 1]))
                  for n, v in _ids(2).items()})
    cases.update({f"position {n}": (torch.tensor([3, v, 40]), table, torch.tensor([0, 1, 1]))
                  for n, v in _ids(4 * P).items()})
    for n, v in _ids(PAGES).items():
        t = table.clone()
        t[1, 1] = v
        cases[f"page {n}"] = (torch.tensor([3, 17, 40]), t, torch.tensor([0, 1, 1]))
    for name, (positions, t, seq) in cases.items():
        guarded = Guarded(base_cache.shape, torch.uint8, gen(12), fill=base_cache)
        out_k, out_s = Guarded((3, 128), torch.uint8, gen(13)), Guarded((3,), torch.float32, gen(14))
        _compare(f"gather_k_slots({name})",
                 lambda p_=positions, t=t, seq=seq: slots_ref.gather_k_slots(base_cache, p_, P, False, FN, t, seq),
                 lambda p_=positions, t=t, seq=seq: slots_tri.gather_k_slots(
                     guarded.view, p_, P, False, FN, t, seq, out=(out_k.view.view(FN), out_s.view)),
                 [guarded, out_k, out_s], "positions|seq_ids|block_table")

    # paged_mqa_logits: page ids and context lengths
    q = random_fp8((1, 1, HEADS, 128), FN, g)
    w = torch.randn(1, HEADS, generator=g)
    cases = {f"page {n}": (v, 40) for n, v in _ids(PAGES).items()}
    cases.update({f"context_lens {v}": (None, v) for v in (0, 64, 65, 10**9, -1, -(2**31))})
    for name, (page, ctx) in cases.items():
        t = torch.tensor([[2, 0, 1, 3]], dtype=torch.int32)
        if page is not None:
            t[0, 1] = page
        lens = torch.tensor([ctx], dtype=torch.int32)
        guarded = Guarded(base_cache.shape, torch.uint8, gen(7), fill=base_cache)
        out = Guarded((1, 64), torch.float32, gen(8))
        _compare(f"paged_mqa_logits({name})",
                 lambda t=t, lens=lens: paged_ref.paged_mqa_logits(q, base_cache, w, lens, t, 64, P, False),
                 lambda t=t, lens=lens: paged_tri.paged_mqa_logits(q, guarded.view, w, lens, t, 64, P, False,
                                                                   out=out.view),
                 [guarded, out], "context_lens|block_table")

    # mqa_logits: ks / ke at and past the keys
    q3, k10 = random_fp8((3, HEADS, 128), FN, g), random_fp8((10, 128), FN, g)
    ks_scale, w3 = torch.rand(10, generator=g), torch.randn(3, HEADS, generator=g)
    bounds = {"ks > ke": ([5, 0, 0], [2, 9, 1]), "ke past the keys": ([0, 0, 0], [11, 10**9, 1]),
              "ks negative": ([-3, -(2**31), 0], [4, 9, 1]), "ke negative": ([0, 0, 0], [-1, 9, 1]),
              "empty rows": ([0, 4, 9], [0, 4, 9])}
    for name, (ks, ke) in bounds.items():
        ks_t, ke_t = torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)
        kg = Guarded((10, 128), torch.uint8, gen(9), fill=k10.view(torch.uint8))
        out = Guarded((3, 10), torch.float32, gen(10))
        _compare(f"mqa_logits({name})",
                 lambda ks_t=ks_t, ke_t=ke_t: mqa_ref.mqa_logits(q3, k10, ks_scale, w3, ks_t, ke_t),
                 lambda ks_t=ks_t, ke_t=ke_t, kg=kg: mqa_tri.mqa_logits(q3, kg.view.view(FN), ks_scale, w3, ks_t,
                                                                         ke_t, out=out.view),
                 [kg, out], "ks|ke")

    # topk_indices: lengths, offsets, NaN, ties (compared as the contract allows: sets per row, pads in place)
    logits = torch.randn(3, 50, generator=g)
    cases = {f"lengths {v}": ([v, 3, 20], None, logits) for v in (-1, 0, 51, 10**9, -(2**31))}
    cases["NaN of both signs"] = ([50, 50, 50], None, logits.index_fill(1, torch.tensor([3]), float("nan"))
                                  .index_fill(1, torch.tensor([7]), -float("nan")))
    cases["all tied"] = ([50, 50, 50], None, torch.zeros(3, 50))
    cases["offset past the row"] = ([50, 50, 50], [10**6, -5, 0], logits)
    # (every kernel path; the radix paths in segments / chunks of 16 columns)
    for (name, (lengths, offset, values)), path in itertools.product(cases.items(), topk_tri.PATHS):
        lens = torch.tensor(lengths, dtype=torch.int32)
        off = None if offset is None else torch.tensor(offset, dtype=torch.int32)
        out = Guarded((3, 8), torch.int32, gen(11))

        def ref_call(values=values, lens=lens, off=off):
            return topk_ref.topk_indices(values, 8, lens.clamp(0, 50), off, "neg1", False)

        def ker_call(values=values, lens=lens, off=off, path=path, out=out):
            return topk_tri.topk_indices(values, 8, lens, off, "neg1", False, out=out.view, path=path, segment=16,
                                         chunk=16)

        _compare_topk(f"topk_indices({name}, {path})", ref_call, ker_call, out, values, lens, off)

    # rotate_act_quant: NaN and inf in x
    for name, bad in {"NaN in x": float("nan"), "inf in x": float("inf")}.items():
        x = torch.randn(2, HEADS, 128, generator=g).bfloat16()
        x[0, 1, 5] = bad
        hadamard = torch.ones(1, 1)
        for _ in range(7):
            hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
        _compare(f"rotate_act_quant({name})",
                 lambda x=x: rot_ref.rotate_act_quant(x, hadamard, 128**-0.5, False, 128, "ue8m0", FN, 448.0),
                 lambda x=x: rot_tri.rotate_act_quant(x, hadamard, 128**-0.5, False, 128, "ue8m0", FN, 448.0),
                 [], "x")


def _compare_topk(probe, reference, kernel, out: Guarded, values, lens, off) -> None:
    """Top-k is compared as the contract allows: the same set per row (near ties: any valid choice), pads equal."""
    from helpers.ops64 import assert_topk_valid

    ref_status, ref = _call_raw(reference)
    ker_status, ker = _call_raw(kernel)
    try:
        out.assert_guards_intact()
    except AssertionError as e:
        record("ids and values", probe, "memory outside", str(e)[:160])
        return
    if ref_status != "ok" or ker_status != "ok":
        record("ids and values", probe, "silent difference" if ref_status != ker_status else "unclear error",
               f"{ref if ref_status != 'ok' else ker}")
        return
    try:
        assert_topk_valid(values, ker, 8, lens, off, "neg1", False)
        record("ids and values", probe, "contract result")
    except AssertionError as e:
        record("ids and values", probe, "silent difference", str(e)[:160])


# ---------------------------------------------------------------------------------------------------------------
# compiled steps against eager
# ---------------------------------------------------------------------------------------------------------------


def probe_compiled() -> None:
    from helpers.models import CACHE_SLOTS, CONFIGS, LAYOUTS, compile_indexer
    from helpers.pass_helpers import assert_matches_eager
    from nsa_inductor.indexer import Indexer
    from nsa_inductor.workload import Batch, decode_batch, prefill_batch

    config, layout = CONFIGS["deepseek_v32"], LAYOUTS["paged"]
    model = Indexer(config, layout)
    model.reset_parameters(gen(0))
    options = {"nsa.layout": "paged", "nsa.page_size": layout.page_size}
    steps = {"decode": (model.decode, compile_indexer(model.decode, options),
                        compile_indexer(model.decode, {**options, "nsa.checks": True})),
             "prefill": (model.prefill, compile_indexer(model.prefill, options),
                         compile_indexer(model.prefill, {**options, "nsa.checks": True}))}
    pages = CACHE_SLOTS // layout.page_size

    def decode():
        return decode_batch(config, layout, [5, 33, 17], max_len=48, seed=1, cache_pages=pages)

    def prefill():
        return prefill_batch(config, layout, [9, 17], seed=3, cache_pages=pages)

    def edit(batch: Batch, index: int, fn) -> Batch:
        args = list(batch.clone().args)
        args[index] = fn(args[index].clone())
        return Batch(*args)

    def set_at(position, value):
        def fn(t):
            t.view(-1)[position] = value
            return t
        return fn

    def set_page(row, column, value):  # a page the sequence's tokens sit on (decode row 1 has 33 tokens: 3 pages)
        def fn(t):
            t[row, column] = value
            return t
        return fn

    cases = {  # (entry, batch, argument the checks name or None where the ids are in the contract)
        "decode: page id = num_pages on a used page": ("decode", edit(decode(), 5, set_page(1, 1, pages)),
                                                       "block_table"),
        "decode: page id -num_pages-1": ("decode", edit(decode(), 5, set_page(1, 2, -pages - 1)),
                                                          "block_table"),
        "decode: page id 1e9": ("decode", edit(decode(), 5, set_page(1, 0, 10**9)), "block_table"),
        "decode: negative page ids (wrap)": ("decode", edit(decode(), 5, lambda t: t - pages), None),
        "decode: slot past the cache": ("decode", edit(decode(), 3, set_at(0, CACHE_SLOTS + 3)), "slot_mapping"),
        "decode: slot 2**31-1": ("decode", edit(decode(), 3, set_at(0, 2**31 - 1)), "slot_mapping"),
        "decode: duplicate slots": ("decode", edit(decode(), 3, lambda t: t.fill_(int(t[0]))), None),
        "decode: padding slots": ("decode", edit(decode(), 3, lambda t: t.fill_(-1)), None),
        "decode: context longer than the table": ("decode", edit(decode(), 6, set_at(0, 10**6)), "context_lens"),
        "prefill: page id = num_pages": ("prefill", edit(prefill(), 5, set_page(1, 1, pages)), "block_table"),
        "decode: bad page id past the tokens": ("decode", edit(decode(), 5, set_page(0, 2, pages)), None),
        "prefill: slot past the cache": ("prefill", edit(prefill(), 3, set_at(2, CACHE_SLOTS)), "slot_mapping"),
        "prefill: duplicate slots": ("prefill", edit(prefill(), 3, lambda t: t.fill_(int(t[0]))), None),
    }
    for name, (entry, batch, argument) in cases.items():
        eager_fn, compiled_fn, checked_fn = steps[entry]
        eager_status, eager_out = _call_raw(lambda: eager_fn(*batch.clone().args))
        if eager_status == "ok":
            try:
                assert_matches_eager(eager_fn, compiled_fn, batch)
                record("compiled steps", name, "contract result", "as eager")
            except AssertionError as e:
                record("compiled steps", name, "silent difference", str(e)[:160])
        else:  # eager raises: the contract's masked result (run, memory-safe), and an error under nsa.checks
            status, out = _call_raw(lambda: compiled_fn(*batch.clone().args))
            record("compiled steps", name, "contract result" if status == "ok" else "unclear error",
                   f"eager raises {type(eager_out).__name__}; compiled: masked" if status == "ok" else str(out)[:160])
        if argument is not None:
            status, out = _call_raw(lambda: checked_fn(*batch.clone().args))
            ok = status == "error" and "nsa.checks: " in str(out) and argument in str(out)
            record("compiled steps", f"{name} (nsa.checks)", "clear error" if ok else "silent difference",
                   "" if ok else f"{status}: {str(out)[:160]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-compiled", action="store_true", help="skip the compiled-step probes (two compiles)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1: the Triton kernels run under the interpreter on the CPU")
    torch.manual_seed(0)
    probe_arguments()
    probe_ids_and_values()
    if not args.no_compiled:
        probe_compiled()
    counts = collections.Counter((group, outcome) for group, _, outcome, _ in results)
    groups = list(dict.fromkeys(group for group, *_ in results))
    lines = ["| group | probes | " + " | ".join(OUTCOMES) + " |", "|---|---:|" + "---:|" * len(OUTCOMES)]
    for group in groups:
        total = sum(counts[group, o] for o in OUTCOMES)
        lines.append(f"| {group} | {total} | " + " | ".join(str(counts[group, o]) for o in OUTCOMES) + " |")
    print(f"{nsa_inductor.describe()}\n\n" + "\n".join(lines))
    print("\nAccepted variants: " + ", ".join(p for _, p, o, _ in results if o == "accepted variant"))
    for group, probe, outcome, detail in results:
        if outcome not in ("clear error", "contract result", "accepted variant"):
            print(f"- {outcome}: {probe}: {detail}")


if __name__ == "__main__":
    main()
