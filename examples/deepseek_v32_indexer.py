"""Run the DeepSeek-V3.2 lightning indexer eager and compiled with ``backend="nsa_rocm"``; check that they agree.

Real model sizes on a GPU; a small configuration with the same architecture on a CPU. Prints the capability line,
the agreement checks, how many times each pass rewrote the graph, and a timing whose meaning depends on the device:

- CPU: the nsa ops run their plain-torch reference implementations, so the compiled program is not expected to be
  faster; agreement with eager is the point, and nothing is timed unless ``--runs N`` asks for it.
- GPU: the speed-up of the compiled step over eager, the compiled step replayed as a CUDA graph (unless
  ``--no-cuda-graphs``). Measured figures, with their commands and commits: BENCHMARKS.md.

``-v`` also prints each pass's near misses: the candidates it left alone, and why (most are deliberate: e.g. an fp32
GEMM whose output feeds the fp8 quantisation stays exact).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

import nsa_inductor
from nsa_inductor.capability import describe, select_layout
from nsa_inductor.indexer import Indexer, IndexerConfig
from nsa_inductor.workload import decode_batch, prefill_batch


def median_ms(fn, args, device: torch.device, runs: int) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):  # also lets CUDA graphs warm up and record before the timed replays
        fn(*args)
    times = []
    for _ in range(runs):
        sync()
        start = time.perf_counter()
        fn(*args)
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def check_same(name: str, eager, compiled, eager_cache, compiled_cache) -> None:
    (logits, topk), (c_logits, c_topk) = eager, compiled
    if not torch.equal(eager_cache, compiled_cache):
        raise SystemExit(f"{name}: K-cache bytes differ between eager and compiled")
    if not torch.equal(logits.isneginf(), c_logits.isneginf()):
        raise SystemExit(f"{name}: -inf masks differ between eager and compiled")
    finite = ~logits.isneginf()
    err = ((logits[finite] - c_logits[finite]).double().norm() / logits[finite].double().norm().clamp(min=1e-30)).item()
    same_sets = sum(set(a.tolist()) == set(b.tolist()) for a, b in zip(topk.cpu(), c_topk.cpu()))
    print(f"{name}: cache bytes identical, -inf masks identical, logits rel. error {err:.2e}, "
          f"top-k sets identical in {same_sets}/{topk.shape[0]} rows")
    if err > 1e-3:
        raise SystemExit(f"{name}: logits differ by {err:.2e} (> 1e-3)")


def print_reports(reports: list[dict], verbose: bool) -> None:
    if not reports:
        print("  no pass report: no graph was compiled")
    for report in reports:
        passes = ", ".join(f"{p['name']}={p['matched']}" for p in report["passes"]) or "no passes registered"
        print(f"  {report['graph']}: {passes}")
        if not verbose:
            continue
        for p in report["passes"]:
            for miss in p["near_misses"]:
                print(f"    {p['name']} near miss: {miss['reason']}")
            for given in p.get("taken_as_given", []):
                print(f"    {p['name']} took as given: {'; '.join(given['facts'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=("deepseek_v32", "glm5"), default="deepseek_v32")
    parser.add_argument("--layout", choices=("flat", "paged", "preshuffle"), default=None,
                        help="K-cache layout (default: the capability guard's choice)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--runs", type=int, default=None,
                        help="timed calls per step (default: 20 on a GPU, none on the CPU)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="GPU: time the compiled step without CUDA graphs")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each pass's near misses and their reasons")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    device = torch.device(args.device)
    config = getattr(IndexerConfig, args.config)()
    on_gpu = device.type == "cuda"
    cuda_graphs = on_gpu and not args.no_cuda_graphs
    runs = args.runs if args.runs is not None else (20 if on_gpu else 0)
    if on_gpu:
        context_lens, seq_lens, page_size = [8192 - 97 * i for i in range(64)], [2048, 1000, 517], None
    else:
        config, context_lens, seq_lens, page_size = config.small(), [37, 130, 1, 64], [20, 45, 7], 16
    decision = select_layout(args.layout, page_size)
    layout = decision.layout
    print(describe(decision))
    if on_gpu:
        print(f"timing: median of {runs} calls; eager as written, nsa_rocm "
              f"{'replayed as a CUDA graph' if cuda_graphs else 'without CUDA graphs (launch-bound)'}. "
              "Recorded GPU figures: BENCHMARKS.md")
    else:
        print("CPU: the nsa ops run their plain-torch references, so this run checks agreement with eager, not speed"
              + (f" (timing {runs} calls anyway)" if runs else "") + ". GPU figures: BENCHMARKS.md")

    torch.manual_seed(0)
    model = Indexer(config, layout).to(device)
    model.reset_parameters(torch.Generator().manual_seed(0))
    # fx_graph_cache off: every run compiles and dumps its graphs (a cache hit reports its entry's passes, no graphs).
    options = {"nsa.layout": layout.name, "nsa.page_size": layout.page_size, "fx_graph_cache": False}
    if cuda_graphs:
        options["triton.cudagraphs"] = True  # what mode="reduce-overhead" sets; torch.compile takes mode or options

    for name, make, fn in (
        ("decode", lambda: decode_batch(config, layout, context_lens, next_n=1, device=device), model.decode),
        ("prefill", lambda: prefill_batch(config, layout, seq_lens, padding_tokens=3, device=device), model.prefill),
    ):
        batch = make()
        eager_batch, compiled_batch = batch.clone(), batch.clone()
        if cuda_graphs:
            # A CUDA graph may write the cache in place only when its address is fixed, as a serving engine's is.
            torch._dynamo.mark_static_address(compiled_batch.kv_cache)
        compiled_fn = torch.compile(fn, backend="nsa_rocm", options=options)
        reports_before = len(nsa_inductor.last_reports())
        start = time.perf_counter()
        compiled_out = compiled_fn(*compiled_batch.args)
        compile_s = time.perf_counter() - start
        check_same(name, fn(*eager_batch.args), compiled_out, eager_batch.kv_cache, compiled_batch.kv_cache)
        print_reports(nsa_inductor.last_reports()[reports_before:], args.verbose)
        if not runs:
            print(f"  compile {compile_s:.1f} s")
            continue
        eager_ms = median_ms(fn, eager_batch.args, device, runs)
        compiled_ms = median_ms(compiled_fn, compiled_batch.args, device, runs)
        if on_gpu:
            print(f"  compile {compile_s:.1f} s; eager {eager_ms:.3f} ms, nsa_rocm {compiled_ms:.3f} ms "
                  f"({eager_ms / compiled_ms:.1f}x faster)")
        else:
            print(f"  compile {compile_s:.1f} s; per call on the CPU (torch references): eager {eager_ms:.3f} ms, "
                  f"nsa_rocm {compiled_ms:.3f} ms")


if __name__ == "__main__":
    with torch.no_grad():
        main()
