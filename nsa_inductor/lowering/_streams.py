"""A second CUDA stream per device for the K side of a decode step (``stream`` of ``nsa.wk_gate_gemm`` and
``nsa.quant_cache_store``; ``join_side_stream`` of ``nsa.paged_mqa_logits``, set by the ``side_stream`` pass).

Why: the K side (the projections of x, the cache store) and the q side (wq_b, the rotation) of a step do not read
each other, and each is a few latency-bound launches that leave most SMs idle; on two streams they overlap (what
serving engines do by hand with an alternate stream). Only while a CUDA graph is being captured: there the fork and
the join become the graph's edges and cost nothing at replay; called eagerly a step is bound by its launches, which
the stream switches and allocator records would only lengthen (BENCHMARKS.md, "The K side on a second CUDA stream").
An op's ``stream``: ``"current"``; ``"fork"``, on the side stream after everything the current stream has queued
(its inputs are ready, earlier readers of what it writes are done); ``"side"``, on the side stream after what is
queued there only (a fork earlier, and every input of the op ready then: Inductor may queue other work on the
current stream in between). Every tensor the side stream touches is recorded on the other stream, so the caching
allocator does not hand that memory out while the other stream may still use it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

STREAMS = ("current", "fork", "side")
_SIDE: dict[int, torch.cuda.Stream] = {}


def _side(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE.get(index)
    if stream is None:
        stream = _SIDE[index] = torch.cuda.Stream(device=index)
    return stream


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def check_stream(stream: str) -> None:
    if stream not in STREAMS:
        raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def on_stream(stream: str, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` on the stream ``stream`` names (``STREAMS``) while a CUDA graph is captured, else as called.
    On the side stream its tensor arguments are recorded there, its outputs (allocated there) on the current stream,
    which reads them after ``join_side_stream``."""
    device = args[0].device  # (every op's first argument is a tensor)
    if stream == "current" or not _capturing(device):  # (every call outside a capture: nothing scanned)
        return fn(*args)
    tensors = _tensors(args)
    main = torch.cuda.current_stream(device)
    side = _side(device)
    if stream == "fork":
        side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn(*args)
    for t in tensors:
        t.record_stream(side)
    for t in _tensors(out):
        t.record_stream(main)
    return out


def join_side_stream(device: torch.device) -> None:
    """While a CUDA graph is captured, the current stream waits for the work queued on the device's side stream so
    far (outside a capture ``on_stream`` queued nothing there)."""
    if _capturing(device):
        torch.cuda.current_stream(device).wait_stream(_side(device))
