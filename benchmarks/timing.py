"""GPU time of a call without the host: shared by the benchmark scripts."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def graph_us(fn, calls: int = 20) -> float:
    """Median µs per call over replays of a CUDA graph of ``calls`` calls captured by hand (as engines run a step):
    no host launch cost, inputs left in L2 as they are right after the kernel that wrote them."""
    return graph_us_over([fn] * calls)


def graph_us_over(fns: Sequence[Callable]) -> float:
    """``graph_us`` of a graph that calls each of ``fns`` once, in order: calls on copies of a weight that together
    outgrow the L2 (``copies_past_l2``) read it from HBM, as a decode step whose cache reads evict it does."""
    for fn in dict.fromkeys(fns):  # (each distinct call once: compiles, workspaces)
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return sorted(times)[len(times) // 2]


def copies_past_l2(nbytes: int) -> int:
    """How many copies of ``nbytes`` of weights fill twice this GPU's L2 (at least 2): cycled through, each call
    finds its copy evicted."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(2, -(-2 * l2 // nbytes))
