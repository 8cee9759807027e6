"""Hugging Face's DeepSeek-V3.2 indexer from its scores to its top-k, as ``transformers`` writes it
(``DeepseekV32Indexer.forward`` after the projections and RoPE): fp32 scores of bf16 q and k, relu, the head
weights, the attention mask, plain top-k indices cast to int32, over ``[B, S, T]``. Eager, default Inductor and
nsa_rocm (the scores on ``nsa.batched_mqa_logits``, the top-k on ``nsa.topk_indices``), µs per call (on a GPU:
replays of a CUDA graph, ``timing.graph_us``; on the CPU: wall time, meaningless but for the agreement), each
compiled variant's top-k against eager's (the mean share of a row's finite-valued eager picks it also picks), and
which of nsa_rocm's two rewrites fired.

    python3 benchmarks/hf_indexer.py [--cells B64xT8192,B8xT8192,B1xT32768,S4096] [--variants ...] [--small]

A cell ``BxxTy`` is a decode step (B sequences of one token, contexts of T/2 to T keys), ``Sn`` a causal prefill
of one sequence of n tokens. ``--small``: 4 heads instead of 64 and k = 16 (CPU-sized).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch
import torch.nn.functional as F

import nsa_inductor
from end_to_end import topk_overlap
from timing import graph_us

HEAD_DIM = 128
VARIANTS = ("eager", "inductor", "nsa_rocm")
REWRITES = ("batched_mqa_logits", "topk_indices")


def head_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[B, S, T]`` unmasked scores: q ``[B, S, H, D]`` and k ``[B, T, D]`` bf16, weights ``[B, S, H]`` (what
    ``nsa.batched_mqa_logits`` computes; ``kernels.py --only batched`` times it in ATen)."""
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * HEAD_DIM**-0.5
    scores = F.relu(scores)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The head scores, masked with ``mask [B, S, T]``."""
    return head_scores(q, k, weights).masked_fill(~mask, float("-inf"))


def indexer_topk(q, k, weights, mask, topk: int) -> torch.Tensor:
    scores = index_scores(q, k, weights, mask)
    return scores.topk(min(topk, scores.shape[-1]), dim=-1).indices.to(torch.int32)


def cell_inputs(cell: str, heads: int, device: str, gen: torch.Generator) -> tuple:
    """``(q, k, weights, mask)`` of a cell (module docstring)."""
    decode = re.fullmatch(r"B(\d+)xT(\d+)", cell)
    if decode:
        batch, width, tokens = int(decode[1]), int(decode[2]), 1
        lengths = torch.randint(width // 2, width + 1, (batch,), generator=gen)
        mask = (torch.arange(width)[None, :] < lengths[:, None])[:, None, :]
    elif re.fullmatch(r"S(\d+)", cell):
        batch, tokens = 1, int(cell[1:])
        width = tokens
        mask = (torch.arange(width)[None, :] <= torch.arange(tokens)[:, None])[None]
    else:
        raise SystemExit(f"a cell is BxxTy or Sn, got {cell!r}")
    q = torch.randn(batch, tokens, heads, HEAD_DIM, generator=gen).bfloat16()
    k = torch.randn(batch, width, HEAD_DIM, generator=gen).bfloat16()
    weights = torch.randn(batch, tokens, heads, generator=gen) * heads**-0.5
    return tuple(t.to(device) for t in (q, k, weights, mask.expand(batch, tokens, width).contiguous()))


def overlap(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor) -> float:
    """Mean share of each row's eager picks of finite score that ``got`` picks too (``end_to_end.topk_overlap`` with
    the picks of -inf, any columns in plain top-k, as its -1 pads)."""
    rows = scores.reshape(-1, scores.shape[-1])
    got, want = (t.reshape(rows.shape[0], -1).long() for t in (got, want))
    got, want = (t.masked_fill(torch.gather(rows, 1, t).isneginf(), -1) for t in (got, want))
    return topk_overlap(want, got)[0].mean().item()


def us_per_call(fn, device: str) -> float:
    if device == "cuda":
        return graph_us(fn)
    for _ in range(3):
        fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def run_cell(cell: str, variants: list[str], heads: int, topk: int, device: str) -> dict:
    inputs = cell_inputs(cell, heads, device, torch.Generator().manual_seed(0))
    want = indexer_topk(*inputs, topk)
    scores = index_scores(*inputs)
    row = {"cell": cell}
    for variant in variants:
        fn = lambda *a: indexer_topk(*a, topk)  # noqa: E731 (a fresh function: its own Dynamo cache entry)
        earlier = {id(r) for r in nsa_inductor.last_reports()}
        if variant != "eager":
            torch._dynamo.reset()
            fn = torch.compile(fn, backend=variant, dynamic=False)
        got = fn(*inputs)
        assert got.dtype == torch.int32 and got.shape == want.shape, (variant, got.dtype, got.shape)
        row[variant] = us_per_call(lambda: fn(*inputs), device)
        row[f"{variant} overlap"] = overlap(got, want, scores)
        if variant == "nsa_rocm":
            reports = [r for r in nsa_inductor.last_reports() if id(r) not in earlier]
            row["rewritten"] = ("unknown (a cache hit without its report)"
                                if any(r["passes"] is None for r in reports) else
                                ", ".join(p["name"] for r in reports for p in r["passes"]
                                          if p["name"] in REWRITES and p["matched"]) or "none")
    return row


def markdown(rows: list[dict], variants: list[str]) -> str:
    lines = ["| cell | " + " | ".join(f"{v} µs" for v in variants) + " | top-k overlap with eager | rewritten |",
             "|---|" + "---:|" * len(variants) + "---|---|"]
    for r in rows:
        shares = ", ".join(f"{v} {r[f'{v} overlap']:.4f}" for v in variants if v != "eager")
        lines.append(f"| {r['cell']} | " + " | ".join(f"{r[v]:.1f}" for v in variants)
                     + f" | {shares or '-'} | {r.get('rewritten', '-')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default="B64xT8192,B8xT8192,B1xT32768,S4096")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--small", action="store_true", help="4 heads, k = 16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    variants = args.variants.split(",")
    heads, topk = (4, 16) if args.small else (64, 2048)
    rows = [run_cell(cell, variants, heads, topk, args.device) for cell in args.cells.split(",")]
    print(markdown(rows, variants))


if __name__ == "__main__":
    main()
