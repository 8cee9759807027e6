"""GPU time of each kernel in one compiled decode step (torch.profiler), DeepSeek-V3.2, B=64, ctx ~8192 by default;
with ``--prefill T``, of one compiled prefill of a T-token sequence instead.

    python benchmarks/profile_decode.py [--steps 10] [--batch 64] [--ctx 8192] [--topk-order sorted|set] [--checks]
                                        [--prefill T] [--one-stream] [--graph] [--timeline]

The backend is imported from whichever ``nsa_inductor`` comes first on ``PYTHONPATH``, so two versions compare in
one process each, e.g. ``git archive <commit> nsa_inductor | tar -x -C old; PYTHONPATH=old python ...``. Steps run
back to back (no L2 flush; with ``--graph`` as replays of one CUDA graph of the step): the table is device time per
kernel, not the step's wall time. ``--timeline`` prints the last step's kernels in start order with their stream,
start and end (µs from the step's first kernel): where two streams' kernels overlap, and where the GPU idles.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import nsa_inductor
from nsa_inductor.backend import nsa_rocm
from nsa_inductor.indexer import Indexer, IndexerConfig
from nsa_inductor.layout import KCacheLayout
from nsa_inductor.workload import decode_batch, prefill_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=8192, help="the longest context (the others 8 tokens apart)")
    parser.add_argument("--topk-order", choices=("sorted", "set"), default="sorted")
    parser.add_argument("--checks", action="store_true", help="with nsa.checks (the index checks' device asserts)")
    parser.add_argument("--prefill", type=int, default=0, help="profile a prefill of this many tokens instead")
    parser.add_argument("--one-stream", action="store_true", help="with nsa.side_stream=False (no second stream)")
    parser.add_argument("--graph", action="store_true", help="replays of a CUDA graph of the step")
    parser.add_argument("--timeline", action="store_true", help="the last step's kernels by start time and stream")
    args = parser.parse_args()
    steps = args.steps
    shape = f"prefill T={args.prefill}" if args.prefill else f"B={args.batch} ctx={args.ctx}"
    print(f"nsa_inductor from {nsa_inductor.__file__}; {shape} top-k order {args.topk_order}"
          f"{' nsa.checks' if args.checks else ''}{' nsa.side_stream=False' if args.one_stream else ''}"
          f"{' CUDA graph' if args.graph else ''}")
    config = IndexerConfig.deepseek_v32(max_model_len=max(args.ctx, args.prefill))
    layout = KCacheLayout(64)
    model = Indexer(config, layout).cuda()
    model.reset_parameters()
    if args.prefill:
        batch = prefill_batch(config, layout, [args.prefill], device="cuda")
    else:
        batch = decode_batch(config, layout, [args.ctx - 8 * i for i in range(args.batch)], max_len=args.ctx,
                             device="cuda")
    options = {"nsa.layout": "paged", "nsa.page_size": 64, "nsa.topk_order": args.topk_order,
               "nsa.checks": args.checks, "nsa.side_stream": not args.one_stream}
    step = torch.compile(model.prefill if args.prefill else model.decode,
                         backend=functools.partial(nsa_rocm, options=options))
    with torch.no_grad():
        for _ in range(3):
            step(*batch.args)
        torch.cuda.synchronize()
        run = functools.partial(step, *batch.args)
        if args.graph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step(*batch.args)
            graph.replay()
            run = graph.replay
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                run()
            torch.cuda.synchronize()
    total = 0.0
    for event in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total):
        if event.self_device_time_total > 0:
            us = event.self_device_time_total / steps
            total += us
            print(f"{us:8.1f} us  x{event.count // steps:2d}  {event.key[:90]}")
    print(f"total {total:.1f} us of GPU time per step")
    if args.timeline:
        print_timeline(prof, steps)


def print_timeline(prof, steps: int) -> None:
    """The last step's kernels from the profiler's trace: stream, start, end, name; then the step's span."""
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.loads(pathlib.Path(trace.name).read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    last = kernels[-(len(kernels) // steps):]
    t0 = last[0]["ts"]
    for e in last:
        print(f"  stream {e['args'].get('stream', '?'):>3}  {e['ts'] - t0:7.1f} - {e['ts'] + e['dur'] - t0:7.1f} us"
              f"  {e['name'][:80]}")
    print(f"  span {max(e['ts'] + e['dur'] for e in last) - t0:.1f} us, kernels {sum(e['dur'] for e in last):.1f} us")


if __name__ == "__main__":
    main()
