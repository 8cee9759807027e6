"""One indexer step, eager vs default Inductor vs nsa_rocm, in the same run: median time, kernel launches, agreement.

    python benchmarks/end_to_end.py [--config deepseek_v32|glm5] [--batch 64] [--ctx 8192] [--prefill 4096]
                                    [--layout paged] [--cuda-graphs] [--engine] [--out DIR]

Decode: ``batch`` sequences, ``ctx`` tokens of context each (slightly varied), next_n=1, DeepSeek-V3.2 sizes.
Prefill: one causal sequence of ``prefill`` tokens. ``--engine``: the tests' engine-fed indexer
(``tests/helpers/engine_indexer.py``: ks/ke, per-row lengths, seq ids, positions and slot mapping precomputed by its
batch builder and passed in, K gathered by the model) instead of the reference ``Indexer``, same weights. Times are ``triton.testing.do_bench`` medians (L2 flushed before
every call); kernel counts are the CUDA kernels torch.profiler records for one step after warm-up. Agreement is
checked against eager: K-cache bytes, -inf masks, logits relative error, top-k sets.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch._inductor
from torch.profiler import ProfilerActivity, profile

import nsa_inductor
from nsa_inductor.capability import describe, select_layout
from nsa_inductor.indexer import Indexer, IndexerConfig
from nsa_inductor.workload import decode_batch, prefill_batch


def cuda_kernels(fn, args) -> list[str]:
    """Names of the CUDA kernels (and memcpy/memset) one call launches, in order."""
    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def agreement(eager_out, eager_cache, out, cache) -> dict:
    (logits, topk), (c_logits, c_topk) = eager_out, out
    finite = ~logits.isneginf()
    err = ((logits[finite] - c_logits[finite]).double().norm() / logits[finite].double().norm()).item()
    rows = [len(set(a.tolist()) & set(b.tolist())) / max(1, len(set(a.tolist()))) for a, b in
            zip(topk.cpu(), c_topk.cpu())]
    return {
        "cache_bytes_equal": bool(torch.equal(eager_cache, cache)),
        "neginf_masks_equal": bool(torch.equal(logits.isneginf(), c_logits.isneginf())),
        "logits_rel_err": err,
        "topk_overlap_mean": sum(rows) / len(rows),
        "topk_sets_identical": sum(r == 1.0 for r in rows) / len(rows),
    }


def bench_step(name, fn, make_batch, options, mode, only) -> list[dict]:
    import triton.testing

    batch = make_batch()
    eager_batch = batch.clone()
    with torch.no_grad():
        eager_out = fn(*eager_batch.args)
    variants = {
        "eager": fn,
        "inductor": torch.compile(fn, backend="inductor", mode=mode),
        # torch.compile takes mode or options, not both: the mode's Inductor options travel with the nsa ones.
        "nsa_rocm": torch.compile(fn, backend="nsa_rocm",
                                  options={**options, **(torch._inductor.list_mode_options(mode) if mode else {})}),
    }
    reports_before = len(nsa_inductor.last_reports())
    rows = []
    for variant, step in ((v, s) for v, s in variants.items() if v in only):
        run_batch = batch.clone()
        if mode:
            # CUDA graphs skip graphs that mutate an input unless its address is fixed, as a serving cache's is.
            torch._dynamo.mark_static_address(run_batch.kv_cache)
        with torch.no_grad():
            out = step(*run_batch.args)
            checks = agreement(eager_out, eager_batch.kv_cache, out, run_batch.kv_cache)
            ms = triton.testing.do_bench(lambda: step(*run_batch.args), warmup=50, rep=300, return_mode="median")
            kernel_names = cuda_kernels(step, run_batch.args)
            kernels = len(kernel_names)
        rows.append({"step": name, "variant": variant, "us": ms * 1e3, "kernels": kernels,
                     "kernel_names": kernel_names, **checks})
        print(f"{name:8s} {variant:9s} {ms * 1e3:10.1f} us  {kernels:4d} kernels  {checks}", flush=True)
    if "nsa_rocm" not in only:
        return rows
    if len(nsa_inductor.last_reports()) == reports_before:
        print(f"{name} passes: no report (the graph came from Inductor's FX graph cache)", flush=True)
        return rows
    report = nsa_inductor.last_reports()[-1]
    rows[-1]["passes"] = {p["name"]: p["matched"] for p in report["passes"]}
    print(f"{name} passes: {rows[-1]['passes']}", flush=True)
    return rows


def speedup(base: dict, variant: str, row: dict) -> str:
    return f"{base[variant] / row['us']:.1f}x" if variant in base else "-"


def engine_steps(args, config, reference, options, context_lens, mode, only) -> list[dict]:
    """The engine-fed indexer's decode and prefill (metadata built on the host by its batch builder, then moved)."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # the tests' helpers package
    from helpers.engine_indexer import EngineIndexer, engine_decode_batch, engine_prefill_batch

    layout = reference.layout
    if layout.preshuffle:
        raise SystemExit("--engine: the engine-fed indexer reads row-major pages only (use --layout paged or flat)")
    model = EngineIndexer(config, layout.page_size).cuda().load_from(reference)
    rows = []
    if args.batch:
        rows += bench_step("decode", model.decode, lambda: engine_decode_batch(
            config, layout.page_size, context_lens, 1, args.ctx, None, seed=0).to("cuda"), options, mode, only)
    if args.prefill:
        rows += bench_step("prefill", model.prefill, lambda: engine_prefill_batch(
            config, layout.page_size, [args.prefill], 0, None, seed=0).to("cuda"), options, mode, only)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=("deepseek_v32", "glm5"), default="deepseek_v32")
    parser.add_argument("--batch", type=int, default=64, help="decode sequences (0 to skip decode)")
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--prefill", type=int, default=4096, help="prefill tokens (0 to skip)")
    parser.add_argument("--layout", choices=("flat", "paged", "preshuffle"), default=None)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help='compile both variants with mode="reduce-overhead" (replays take the launch cost away)')
    parser.add_argument("--no-head-gate", action="store_true",
                        help="nsa_rocm without the bf16 head-gate rewrite (to measure what it costs)")
    parser.add_argument("--variants", default="eager,inductor,nsa_rocm",
                        help="comma-separated subset (default Inductor's prefill hits a torch 2.11 bug on GPUs)")
    parser.add_argument("--topk-order", choices=("sorted", "set"), default="sorted",
                        help="nsa.topk_order: torch's order (default) or set order (engines that use indices as a set)")
    parser.add_argument("--engine", action="store_true",
                        help="the engine-fed indexer (metadata as inputs; row-major layouts only)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    decision = select_layout(args.layout)
    layout = decision.layout
    config = getattr(IndexerConfig, args.config)(max_model_len=max(args.ctx, args.prefill))
    print(describe(decision), flush=True)
    model = Indexer(config, layout).cuda()
    model.reset_parameters(torch.Generator().manual_seed(0))
    options = {"nsa.layout": layout.name, "nsa.page_size": layout.page_size,
               "nsa.head_gate_mode": "off" if args.no_head_gate else "split", "nsa.topk_order": args.topk_order}
    context_lens = [args.ctx - (i * 37) % 512 for i in range(args.batch)]
    mode = "reduce-overhead" if args.cuda_graphs else None
    only = set(args.variants.split(","))
    rows = []
    if args.engine:
        rows += engine_steps(args, config, model, options, context_lens, mode, only)
    else:
        if args.batch:
            rows += bench_step("decode", model.decode, lambda: decode_batch(config, layout, context_lens,
                                                                            max_len=args.ctx, device="cuda"),
                               options, mode, only)
        if args.prefill:
            rows += bench_step("prefill", model.prefill,
                               lambda: prefill_batch(config, layout, [args.prefill], device="cuda"), options, mode, only)

    lines = ["| step | variant | µs | vs eager | vs inductor | kernels | cache bytes = eager | logits rel. err | "
             "top-k sets identical |", "|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for row in rows:
        base = {r["variant"]: r["us"] for r in rows if r["step"] == row["step"]}
        lines.append(
            f"| {row['step']} | {row['variant']} | {row['us']:.1f} | {speedup(base, 'eager', row)} | "
            f"{speedup(base, 'inductor', row)} | {row['kernels']} | {row['cache_bytes_equal']} | "
            f"{row['logits_rel_err']:.1e} | {row['topk_sets_identical']:.3f} |")
    table = "\n".join(lines)
    print(f"\ndevice: {torch.cuda.get_device_name()}, torch {torch.__version__}, layout {layout}\n\n{table}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layout": str(layout),
                       "rows": rows}, f, indent=2)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
