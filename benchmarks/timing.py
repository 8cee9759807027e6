"""GPU time of a call without the host: shared by the benchmark scripts."""

from __future__ import annotations

import torch


def graph_us(fn, calls: int = 20) -> float:
    """Median µs per call over replays of a CUDA graph of ``calls`` calls captured by hand (as engines run a step):
    no host launch cost, inputs left in L2 as they are right after the kernel that wrote them."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]
