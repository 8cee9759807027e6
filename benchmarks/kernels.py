"""Kernel benchmarks for the ``nsa`` ops on one GPU: Triton kernels against the torch reference, same run.

    python benchmarks/kernels.py [--quick] [--out DIR] [--paged-config CHUNK,BLOCK_N,WARPS,STAGES ...]
                                 [--ragged-config BLOCK_M,BLOCK_N,WARPS,STAGES ...] [--no-torch] [--only NAME ...]

Timings: the paged and ragged logits, the store and the gathers are ``triton.testing.do_bench`` medians (do_bench
clears L2 before every call, so K-cache reads come from HBM, but it also times the host's launch, which outlasts
kernels of a few µs); the rotation, top-k and the GEMMs that read x are CUDA-graph medians (``timing.py``: no host
cost), the GEMMs' weights cycled through copies past the L2 (and once from it). Inputs are random (never zeros).
Bandwidth counts K values + scales read, q, weights and the output written; the prefill counts 2*H*128 flops per
visible (t, n) pair of the causal half.
Floors (DESIGN §6): 4.3 TB/s copy bandwidth and ~1979 TFLOP/s dense fp8 on an H200 (~989 bf16, for the Hugging
Face scores of ``nsa.batched_mqa_logits``, whose "torch" column is HF's scoring in ATen: fp32 matmuls; its masked
cells' rate and floor count the kept share of the bytes or flops).

``--only host``: what one call of each op costs the host (``bench_host``), next to a plain torch op, same run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import sys
import time

import torch

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))  # (last: a package on PYTHONPATH, an A/B's, wins)

from nsa_inductor.layout import KCacheLayout  # noqa: E402
from timing import copies_past_l2, graph_us, graph_us_over  # noqa: E402

HBM_BYTES_PER_S = 4.3e12
FP8_FLOPS_PER_S = 1979e12
BF16_FLOPS_PER_S = 989e12
DEV = "cuda"
LAYOUTS = {"flat": (1, False), "paged": (64, False), "preshuffle": (64, True)}


def _bench(fn, fast: bool) -> float:
    """Median microseconds of ``fn``."""
    import triton.testing

    ms = triton.testing.do_bench(fn, warmup=10 if fast else 25, rep=30 if fast else 100, return_mode="median")
    return ms * 1e3


def _op(name: str):
    """``(triton module, reference module)`` of the op ``name`` (imported here: the script needs a GPU first)."""
    return tuple(importlib.import_module(f"nsa_inductor.lowering.{name}.{m}") for m in ("triton", "reference"))


def _parse_configs(values: list[str] | None, cls, names: tuple[str, ...]) -> list:
    """Configs given on the command line; ``[None]`` (the kernel's own choice) when none are."""
    if not values:
        return [None]
    configs = []
    for value in values:
        parts = [int(p) for p in value.split(",")]
        if len(parts) != len(names):
            raise SystemExit(f"config {value!r} must be {','.join(names)}")
        configs.append(cls(**dict(zip(names, parts))))
    return configs


def _random_fp8(shape) -> torch.Tensor:
    return (torch.randn(shape, device=DEV) * 8).to(torch.float8_e4m3fn)


def _paged_inputs(batch: int, ctx: int, layout: tuple[int, bool], heads: int = 64, next_n: int = 1):
    page_size, preshuffle = layout
    max_pages = -(-ctx // page_size)
    num_pages = batch * max_pages
    lay = KCacheLayout(page_size, preshuffle)
    k = torch.randn(num_pages * page_size, 128, device=DEV).bfloat16()
    cache = lay.allocate(num_pages * page_size, device=DEV)
    torch.ops.nsa.quant_cache_store(k, cache, torch.arange(k.shape[0], device=DEV), page_size, preshuffle, "ue8m0")
    block_table = torch.randperm(num_pages, device=DEV).int().view(batch, max_pages)
    q = _random_fp8((batch, next_n, heads, 128))
    weights = torch.randn(batch * next_n, heads, device=DEV)
    context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    return q, cache, weights, context_lens, block_table, ctx, page_size, preshuffle


def bench_paged(args, rows: list[dict]) -> None:
    tk, reference = _op("paged_mqa_logits")
    configs = _parse_configs(args.paged_config, tk.PagedConfig, ("chunk", "block_n", "num_warps", "num_stages"))
    batches, ctxs = ([1, 64], [8192]) if args.quick else ([1, 8, 64], [2048, 8192, 32768])
    for name, layout in LAYOUTS.items():
        for batch in batches:
            for ctx in ctxs:
                inputs = _paged_inputs(batch, ctx, layout)
                q, weights = inputs[0], inputs[2]
                nbytes = batch * ctx * 132 + q.numel() + weights.numel() * 4 + batch * ctx * 4
                results = {cfg: _bench(lambda cfg=cfg: tk.paged_mqa_logits(*inputs, config=cfg), args.quick)
                           for cfg in configs}
                best = min(results, key=results.get)
                chosen = best or tk._default_paged_config(batch, ctx)
                torch_us = None
                if not args.no_torch:
                    torch_us = _bench(lambda: reference.paged_mqa_logits(*inputs), True)
                rows.append({
                    "kernel": "paged_mqa_logits", "case": f"{name} B={batch} ctx={ctx} H=64 next_n=1",
                    "us": results[best], "torch_us": torch_us, "gbps": nbytes / results[best] / 1e3,
                    "floor_us": nbytes / HBM_BYTES_PER_S * 1e6, "config": str(chosen),
                    "sweep": {str(c or chosen): t for c, t in results.items()},
                })
                del inputs


def _bandwidth_row(kernel: str, case: str, us: float, torch_us: float | None, nbytes: int) -> dict:
    return {"kernel": kernel, "case": case, "us": us, "torch_us": torch_us, "gbps": nbytes / us / 1e3,
            "floor_us": nbytes / HBM_BYTES_PER_S * 1e6, "config": ""}


def bench_quant_store(args, rows: list[dict]) -> None:
    tk, reference = _op("quant_cache_store")
    for tokens in (64, 8192):
        for name, (page_size, preshuffle) in LAYOUTS.items():
            num_slots = 1 << 20
            cache = KCacheLayout(page_size, preshuffle).allocate(num_slots, device=DEV)
            k = torch.randn(tokens, 128, device=DEV).bfloat16()
            slots = torch.randperm(num_slots, device=DEV)[:tokens]
            call = (k, cache, slots, page_size, preshuffle, "ue8m0", torch.float8_e4m3fn)
            nbytes = tokens * (128 * 2 + 8 + 132)
            us = _bench(lambda: tk.quant_cache_store(*call), args.quick)
            torch_us = None if args.no_torch else _bench(lambda: reference.quant_cache_store(*call), True)
            rows.append(_bandwidth_row("quant_cache_store", f"{name} T={tokens}", us, torch_us, nbytes))


def bench_gather(args, rows: list[dict]) -> None:
    tk, reference = _op("gather_k")
    slots_tk, slots_reference = _op("gather_k_slots")
    batch, ctx = 4, 2048
    # the same tokens by (sequence id, position) through the block table, for nsa.gather_k_slots
    seq_ids = torch.arange(batch, dtype=torch.int32, device=DEV).repeat_interleave(ctx)
    positions = torch.arange(ctx, device=DEV).repeat(batch)
    for name, layout in LAYOUTS.items():
        inputs = _paged_inputs(batch, ctx, layout)
        cache, block_table, page_size, preshuffle = inputs[1], inputs[4], inputs[6], inputs[7]
        cu = torch.arange(0, (batch + 1) * ctx, ctx, dtype=torch.int32, device=DEV)
        call = (cache, block_table, cu, page_size, preshuffle, batch * ctx, torch.float8_e4m3fn)
        nbytes = 2 * batch * ctx * 132
        us = _bench(lambda: tk.gather_k(*call), args.quick)
        torch_us = None if args.no_torch else _bench(lambda: reference.gather_k(*call), True)
        rows.append(_bandwidth_row("gather_k", f"{name} T={batch * ctx}", us, torch_us, nbytes))
        call = (cache, positions, page_size, preshuffle, torch.float8_e4m3fn, block_table, seq_ids)
        us = _bench(lambda: slots_tk.gather_k_slots(*call), args.quick)
        torch_us = None if args.no_torch else _bench(lambda: slots_reference.gather_k_slots(*call), True)
        nbytes += batch * ctx * 12  # the two maps
        rows.append(_bandwidth_row("gather_k_slots", f"{name} T={batch * ctx}", us, torch_us, nbytes))


def bench_ragged(args, rows: list[dict]) -> None:
    tk, reference = _op("mqa_logits")
    configs = _parse_configs(args.ragged_config, tk.RaggedConfig, ("block_m", "block_n", "num_warps", "num_stages"))
    tokens, heads = (4096, 64) if args.quick else (8192, 64)
    q = _random_fp8((tokens, heads, 128))
    k = _random_fp8((tokens, 128))
    k_scale = torch.rand(tokens, device=DEV) + 0.01
    weights = torch.randn(tokens, heads, device=DEV)
    ks = torch.zeros(tokens, dtype=torch.int32, device=DEV)
    ke = torch.arange(1, tokens + 1, dtype=torch.int32, device=DEV)
    call = (q, k, k_scale, weights, ks, ke)
    flops = 2 * heads * 128 * tokens * (tokens + 1) / 2
    results = {cfg: _bench(lambda cfg=cfg: tk.mqa_logits(*call, config=cfg), args.quick) for cfg in configs}
    best = min(results, key=results.get)
    torch_us = None if args.no_torch else _bench(lambda: reference.mqa_logits(*call), True)
    rows.append({
        "kernel": "mqa_logits", "case": f"causal prefill T={tokens} H={heads}", "us": results[best],
        "torch_us": torch_us, "tflops": flops / results[best] / 1e6, "floor_us": flops / FP8_FLOPS_PER_S * 1e6,
        "config": str(best or tk.RAGGED_CONFIG), "sweep": {str(c or tk.RAGGED_CONFIG): t for c, t in results.items()},
    })


def bench_batched(args, rows: list[dict]) -> None:
    """``nsa.batched_mqa_logits`` (Hugging Face's indexer scores, 64 heads of 128) at decode and prefill sizes, each
    tiling's configs swept: CUDA-graph medians, a decode's K cycled through copies past the L2 (read once a call)."""
    from hf_indexer import HEAD_DIM, head_scores  # what the op replaces: Hugging Face's scoring in ATen

    tk, _ = _op("batched_mqa_logits")
    cases = [(64, 1, 8192), (8, 1, 8192), (1, 1, 32768), (1, 4096, 4096)]
    decode = [tk.BatchedConfig(False, keys_in_m=km, chunk=c, block_n=n, num_warps=w, num_stages=st)
              for km, c, n, w, st in [(True, 512, 128, 4, 2), (True, 256, 128, 4, 2), (True, 256, 64, 4, 2),
                                      (True, 1024, 128, 4, 2), (True, 2048, 128, 4, 2),
                                      (True, 1024, 64, 4, 2), (True, 1024, 128, 8, 2), (True, 1024, 128, 4, 3),
                                      (False, 1024, 128, 4, 2), (False, 512, 64, 4, 2)]]
    prefill = [tk.BatchedConfig(True, block_m=m, block_n=n, num_warps=w, num_stages=st)
               for m, n, w, st in [(64, 128, 4, 2), (128, 128, 8, 2), (64, 64, 4, 2), (128, 64, 4, 2),
                                   (64, 128, 4, 3), (128, 128, 4, 2)]]
    for batch, tokens, keys in cases[:2] + cases[3:] if args.quick else cases:
        heads, dim, scale = 64, HEAD_DIM, HEAD_DIM**-0.5
        q = torch.randn(batch, tokens, heads, dim, device=DEV).bfloat16()
        weights = torch.randn(batch, tokens, heads, device=DEV) * heads**-0.5
        k_bytes = batch * keys * dim * 2
        copies = copies_past_l2(k_bytes) if tokens == 1 else 3  # (a prefill reads its K from L2 anyway)
        ks = [torch.randn(batch, keys, dim, device=DEV).bfloat16() for _ in range(copies)]
        configs = decode if tokens < tk.ROWS_IN_M_FROM else prefill
        results = {cfg: graph_us_over([lambda k=k, cfg=cfg: tk.batched_mqa_logits(q, k, weights, scale, config=cfg)
                                       for k in ks]) for cfg in configs}
        best = min(results, key=results.get)
        torch_us = None if args.no_torch else graph_us_over([lambda k=k: head_scores(q, k, weights) for k in ks])
        case = f"B={batch} S={tokens} T={keys} H=64 bf16"
        if tokens == 1:
            row = _bandwidth_row("batched_mqa_logits", case, results[best], torch_us,
                                 k_bytes + q.numel() * 2 + weights.numel() * 4 + batch * keys * 4)
        else:
            flops = 2 * heads * dim * batch * tokens * keys
            row = {"kernel": "batched_mqa_logits", "case": case, "us": results[best], "torch_us": torch_us,
                   "tflops": flops / results[best] / 1e6, "floor_us": flops / BF16_FLOPS_PER_S * 1e6}
        rows.append({**row, "config": str(best), "sweep": {str(c): t for c, t in results.items()}})
        # Masked as Hugging Face's indexer masks: a decode's contexts of T/2 to T keys, a prefill's causal mask.
        if tokens == 1:
            lengths = torch.randint(keys // 2, keys + 1, (batch, 1, 1), device=DEV)
            mask = (torch.arange(keys, device=DEV) < lengths).expand(batch, tokens, keys)
        else:
            mask = (torch.arange(keys, device=DEV)[None] <= torch.arange(tokens, device=DEV)[:, None]).expand(
                batch, tokens, keys)
        us = graph_us_over([lambda k=k: tk.batched_mqa_logits(q, k, weights, scale, None, mask) for k in ks])
        torch_us = None if args.no_torch else graph_us_over(
            [lambda k=k: head_scores(q, k, weights).masked_fill(~mask, float("-inf")) for k in ks])
        kept = mask.float().mean().item()  # (the rate and floor: of the kept scores' bytes or flops alone)
        rows.append({**{key: row[key] * kept * row["us"] / us for key in ("gbps", "tflops") if key in row},
                     "kernel": "batched_mqa_logits", "case": f"{case}, masked ({kept:.0%} kept)", "us": us,
                     "torch_us": torch_us, "floor_us": row["floor_us"] * kept,
                     "config": str(tk.config_for(batch, tokens, keys))})
        del ks


def bench_head_gate(args, rows: list[dict]) -> None:
    """weights_proj of DeepSeek-V3.2 (x [M, 7168] bf16, W [64, 7168] fp32, 4 splits as the pass chooses), against
    eager's ``F.linear(x.float(), W)``; the sweep adds the tilings the default was chosen against. CUDA-graph timing
    with the weight read from HBM (``_cold_us``; the row's case gives the default's L2-warm figure, ``_warm_us``)."""
    tk, _ = _op("head_gate_gemm")
    weights = _weight_copies(torch.randn(64, 7168, device=DEV) * 7168**-0.5)
    for tokens in (1, 64, 4096):
        x = torch.randn(tokens, 7168, device=DEV).bfloat16()
        default = tk._default_head_gate_config(tokens)
        configs = [default, *(tk.HeadGateConfig(*c) for c in ((16, 32, 4), (64, 16, 4), (32, 16, 4), (16, 16, 3)))]
        results = {cfg: _cold_us(lambda w, cfg=cfg: tk.head_gate_gemm(x, w, 4, False, config=cfg), weights)
                   for cfg in dict.fromkeys(configs)}
        warm = _warm_us(lambda w: tk.head_gate_gemm(x, w, 4, False, config=default), weights)
        torch_us = None if args.no_torch else _cold_us(lambda w: torch.nn.functional.linear(x.float(), w), weights)
        nbytes = _nbytes(*weights[0]) + x.numel() * 2 + 4 * tokens * 64 * 4
        rows.append({**_bandwidth_row("head_gate_gemm", f"split M={tokens} N=64 K=7168 (L2-warm {warm:.1f} µs)",
                                      results[default], torch_us, nbytes),
                     "config": str(default), "sweep": {str(c): t for c, t in results.items()}})


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _weight_copies(*weights: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Copies of ``weights`` that together fill twice the L2 (``copies_past_l2``), the first the tensors given."""
    return [weights] + [tuple(w.clone() for w in weights) for _ in range(copies_past_l2(_nbytes(*weights)) - 1)]


def _cold_us(call, copies: list[tuple[torch.Tensor, ...]]) -> float:
    """µs per ``call(*weights)`` in a CUDA graph cycling through the copies: each call reads its weights from HBM,
    as in a decode step whose K-cache reads evict them (B=64)."""
    return graph_us_over([lambda c=c: call(*c) for c in copies])


def _warm_us(call, copies: list[tuple[torch.Tensor, ...]]) -> float:
    """``_cold_us``'s calls on the first copy alone: its weights from the L2 (a step with little cache, B=1 ctx
    2048)."""
    return graph_us(lambda: call(*copies[0]), calls=len(copies))


def bench_rotate(args, rows: list[dict]) -> None:
    """The Hadamard rotation fused into act_quant (``nsa.rotate_act_quant``, q: M tokens x 64 heads rows) and into
    the K store (the ``rotation`` prologue, k: [M, 128]), against what runs without the fusion: eager's
    ``act_quant((x.float() @ H * 128**-0.5).to(bf16))`` for q, and for k cuBLAS's fp32 GEMM followed by the store
    kernel with its ``(y * c).to(bf16)`` epilogue (the compiled path before this pass). CUDA-graph timing (GPU time,
    no launch cost); the sweep tries the kernel's rows per program."""
    from nsa_inductor.indexer import hadamard_matrix
    from nsa_inductor.quant import act_quant

    tk, _ = _op("rotate_act_quant")
    store, _ = _op("quant_cache_store")
    h = hadamard_matrix(128).to(DEV)
    c = 128**-0.5
    for tokens in (1, 8, 64, 256):
        x = torch.randn(tokens, 64, 128, device=DEV).bfloat16()
        call = (x, h, c, False, 128, "ue8m0", torch.float8_e4m3fn, 448.0)
        default = tk.block_rows(tokens * 64)
        results = {b: graph_us(lambda b=b: tk.rotate_act_quant(*call, block_m=b))
                   for b in sorted({default, 1, 2, 16, 32})}
        torch_us = None if args.no_torch else graph_us(lambda: act_quant((x.float() @ h * c).to(torch.bfloat16)))
        nbytes = x.numel() * 2 + h.numel() * 4 + x.numel() + tokens * 64 * 4
        rows.append({**_bandwidth_row("rotate_act_quant", f"q M={tokens}x64 rows (vs eager GEMM + act_quant)",
                                      results[default], torch_us, nbytes),
                     "config": f"block_m {default}", "sweep": {f"block_m {b}": t for b, t in results.items()}})
        layout = KCacheLayout(64)
        cache = layout.allocate(1 << 16, device=DEV)
        k = torch.randn(tokens, 128, device=DEV).bfloat16()
        slots = torch.randperm(1 << 16, device=DEV)[:tokens]
        fused = (k, cache, slots, 64, False, "ue8m0", torch.float8_e4m3fn, c, torch.bfloat16, False, h)
        default = store.block_tokens(tokens, True)
        results = {b: graph_us(lambda b=b: store.quant_cache_store(*fused, block_t=b))
                   for b in sorted({default, 1, 2, 16})}
        unfused = None if args.no_torch else graph_us(lambda: store.quant_cache_store(
            k.float() @ h, cache, slots, 64, False, "ue8m0", torch.float8_e4m3fn, c, torch.bfloat16))
        nbytes = k.numel() * 2 + h.numel() * 4 + tokens * 132 + tokens * 8
        rows.append({**_bandwidth_row("quant_cache_store+rotation", f"k M={tokens} (vs cuBLAS GEMM + store epilogue)",
                                      results[default], unfused, nbytes),
                     "config": f"block_t {default}", "sweep": {f"block_t {b}": t for b, t in results.items()}})


XGEMM_ROWS = (1, 4, 8, 64, 256, 4096)
# (gate_splits, k_splits) tried besides the pass's choice; the gate's stay <= 11 (its consumer's read budget).
XGEMM_SPLITS = ((2, 2), (4, 4), (4, 8), (8, 8), (8, 16), (11, 22))
# (block_m, gate_block_n, k_block_n, block_k, num_warps, num_stages) tried besides the launcher's choice.
XGEMM_TILES = ((16, 16, 16, 64, 4, 4), (16, 16, 32, 64, 4, 4), (16, 16, 32, 128, 4, 3), (16, 16, 32, 256, 4, 2),
               (16, 32, 64, 128, 4, 3), (32, 16, 32, 128, 4, 3), (64, 16, 32, 64, 4, 3), (64, 16, 32, 128, 4, 3),
               (64, 16, 32, 256, 8, 2), (64, 32, 64, 64, 4, 3), (128, 64, 64, 64, 8, 3))


def bench_xgemm(args, rows: list[dict]) -> None:
    """wk (x [M, 7168] bf16 @ [128, 7168] bf16) and weights_proj ([64, 7168] fp32, split hi/lo) in one
    ``nsa.wk_gate_gemm`` launch, against cuBLAS ``F.linear(x, wk)`` + eager's ``F.linear(x.float(), W)`` and against
    the pair it replaced (cuBLAS wk + ``nsa.head_gate_gemm``), same run; CUDA-graph timing with the weights read from
    HBM (``_cold_us``; the row's case gives the default's L2-warm figure, ``_warm_us``). Sweeps split counts
    (``SPLITS`` in patterns/wk_gate_gemm.py) and tiles (``CONFIGS`` in lowering/wk_gate_gemm/triton.py);
    ``--xgemm-config`` adds more; ``--quick`` tries only the split counts, with the default tiles. The consumers'
    partial sums are not timed (they fold into kernels that run anyway)."""
    from nsa_inductor.patterns.wk_gate_gemm import splits_for

    tk, _ = _op("wk_gate_gemm")
    head_gate, _ = _op("head_gate_gemm")
    F = torch.nn.functional
    weights = _weight_copies(torch.randn(64, 7168, device=DEV) * 7168**-0.5,
                             (torch.randn(128, 7168, device=DEV) * 7168**-0.5).bfloat16())
    extra = [tuple(int(v) for v in c.split(",")) for c in args.xgemm_config or []]
    for tokens in XGEMM_ROWS:
        x = torch.randn(tokens, 7168, device=DEV).bfloat16()
        default = (splits_for(tokens, 7168), tk.config_for(tokens))
        tiles = [tk.WkGateConfig(tokens, *t) for t in XGEMM_TILES if t[0] <= max(16, 2 * tokens)]
        candidates = [default, *((sp, default[1]) for sp in XGEMM_SPLITS)]
        if not args.quick:  # every tile, with the default splits and with every split count
            candidates += [*((default[0], t) for t in tiles), *((sp, t) for sp in XGEMM_SPLITS for t in tiles)]
        candidates += [((e[6], e[7]), tk.WkGateConfig(tokens, *e[:6])) for e in extra]
        results = {}
        for splits, cfg in dict.fromkeys(candidates):
            results[(splits, cfg)] = _cold_us(
                lambda gate, wk, splits=splits, cfg=cfg: tk.wk_gate_gemm(x, gate, wk, *splits, False, config=cfg),
                weights)
        best = min(results, key=results.get)
        (gate_splits, k_splits), default_tiles = default
        warm = _warm_us(lambda gate, wk: tk.wk_gate_gemm(x, gate, wk, gate_splits, k_splits, False,
                                                         config=default_tiles), weights)
        torch_us = None if args.no_torch else _cold_us(
            lambda gate, wk: (F.linear(x, wk), F.linear(x.float(), gate)), weights)
        before_us = _cold_us(lambda gate, wk: (F.linear(x, wk), head_gate.head_gate_gemm(x, gate, 4, False)), weights)
        nbytes = _nbytes(*weights[0]) + x.numel() * 2 + tokens * (gate_splits * 64 + k_splits * 128) * 4
        rows.append({**_bandwidth_row("wk_gate_gemm", f"M={tokens} wk+gate K=7168 (L2-warm {warm:.1f} µs; before "
                                                      f"{before_us:.1f} µs)", results[default], torch_us, nbytes),
                     "config": f"{_xgemm_name(default)}; best {results[best]:.1f} µs: {_xgemm_name(best)}",
                     "sweep": {_xgemm_name(k): t for k, t in sorted(results.items(), key=lambda kv: kv[1])[:12]}})


def _xgemm_name(key) -> str:
    """``splits G/K, tiles BLOCK_M,GATE_BLOCK_N,K_BLOCK_N,BLOCK_K,WARPS,STAGES`` (the ``--xgemm-config`` order)."""
    (gate_splits, k_splits), c = key
    return (f"splits {gate_splits}/{k_splits}, tiles {c.block_m},{c.gate_block_n},{c.k_block_n},{c.block_k},"
            f"{c.num_warps},{c.num_stages}")


TOPK_CASES = [("decode", 64, 8192, None), ("decode", 8, 8192, None), ("decode", 1, 32768, None),
              ("decode", 64, 65536, None), ("decode ~8192 valid", 64, 65536, 8192),
              ("decode ~1536 valid (rows taken whole)", 64, 65536, 1536),
              ("causal prefill", 8192, 8192, "causal")]


def bench_topk(args, rows: list[dict]) -> None:
    """k = 2048 over random fp32 logits (issue 10's cells): set order and sorted order against torch.topk (over
    the masked logits where rows have lengths), CUDA-graph timing. The floor is the logits read once. Without
    ``--quick`` the sweep adds the warps and the other paths the launcher chose against (``path_for``)."""
    tk, _ = _op("topk_indices")
    k = 2048
    for name, batch, width, valid in TOPK_CASES:
        logits = torch.randn(batch, width, device=DEV)
        lengths = None
        if valid == "causal":
            lengths = torch.arange(1, batch + 1, dtype=torch.int32, device=DEV)
        elif valid is not None:
            lengths = torch.randint(valid - 512, valid + 512, (batch,), dtype=torch.int32, device=DEV)
        cols = torch.arange(width, device=DEV)

        def eager():
            masked = logits if lengths is None else logits.masked_fill(cols >= lengths[:, None], float("-inf"))
            return torch.topk(masked, k, dim=-1)

        torch_us = None if args.no_torch else graph_us(eager)
        nbytes = logits.numel() * 4 + batch * k * 4
        block = tk.block_for(width)
        path = tk.path_for(batch, width, k)
        for order in ("set", "sorted"):
            sort = order == "sorted"
            sort_by = tk.sort_for(batch, k, path) if sort else None
            chosen = {"radix_split": tk.RADIX_SELECT_WARPS, "radix_row": tk.RADIX_ROW_WARPS}.get(path) or tk.warps_for(
                batch, block, sort_by == "in_kernel")
            results = {w: graph_us(lambda w=w: tk.topk_indices(logits, k, lengths, None, "neg1", sort, num_warps=w))
                       for w in sorted({chosen, 4, 8, 16} if not args.quick else {chosen})}
            other_paths = {} if args.quick else {
                p: graph_us(lambda p=p: tk.topk_indices(logits, k, lengths, None, "neg1", sort, path=p))
                for p in tk.PATHS if p != path}
            config = {"radix_split": "radix_split: segment {}, candidate block {}".format(*tk.radix_sizes(batch, width)),
                      "radix_row": f"radix_row: chunk {tk.radix_row_chunk(batch, lengths is not None)}, "
                                   f"candidate block {tk.RADIX_ROW_BLOCK}",
                      "bisect": f"bisect: block {block}, segments {tk.segments_for(width, k, block)}"}[path]
            rows.append({**_bandwidth_row("topk_indices", f"{name} {batch}x{width} ({order})", results[chosen],
                                          torch_us, nbytes),
                         "config": f"{config}, {chosen} warps" + (f", sorted by {sort_by}" if sort else ""),
                         "sweep": {f"{w} warps": t for w, t in results.items()} | {
                             f"path {p} (its default warps)": t for p, t in other_paths.items()}})
        del logits


def _host_us(fn, calls: int = 200, issued_calls: int = 50) -> tuple[float, float]:
    """``(wall, issue)`` µs per call, medians of 5 rounds: wall = ``calls`` back-to-back calls until the GPU has
    finished them all; issue = ``issued_calls`` calls until the host has launched them all, queued behind a GPU sleep
    that outlasts them (checked: its event not done when the last is launched), so the GPU never paces the host (a
    full launch queue would, and a call whose GPU time exceeds its host time would read as its GPU time)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    walls, issues = [], []
    cycles = 1 << 22
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) / calls * 1e6)
        while True:
            torch.cuda._sleep(cycles)
            slept = torch.cuda.Event()
            slept.record()
            start = time.perf_counter()
            for _ in range(issued_calls):
                fn()
            issued = time.perf_counter()
            early = not slept.query()
            torch.cuda.synchronize()
            if early:
                issues.append((issued - start) / issued_calls * 1e6)
                break
            if cycles >= 1 << 34:  # seconds of sleep: the calls wait for the GPU themselves
                raise RuntimeError("the timed calls synchronize with the GPU: their host time cannot be read")
            cycles *= 2
    return sorted(walls)[2], sorted(issues)[2]


def bench_host(args, rows: list[dict]) -> None:
    """Host cost of one call of each nsa op at decode sizes (DeepSeek-V3.2, B=64, ctx 8192; the prefill ops at
    T=256): back-to-back calls through ``torch.ops.nsa`` (as compiled code calls them; replayed host plans from a
    signature's third call, ``NSA_INDUCTOR_DISABLE_HOST_PLANS=1`` for the full path), the launcher alone (the
    Triton launch without custom-op dispatch and checks), and a plain torch op on the op's output (``torch.clone``),
    each against its GPU time (CUDA events over replays of a CUDA graph of the calls); then the floor of
    custom-op dispatch (``_custom_op_floor``)."""
    nsa = torch.ops.nsa
    inputs = _paged_inputs(64, 8192, LAYOUTS["paged"])
    q, cache, weights, context_lens, block_table = inputs[:5]
    k = torch.randn(64, 128, device=DEV).bfloat16()
    slots = torch.randperm(cache.shape[0] * 64, device=DEV)[:64]
    logits = torch.randn(64, 8192, device=DEV)
    x = torch.randn(64, 7168, device=DEV).bfloat16()
    gate_weight = torch.randn(64, 7168, device=DEV) * 7168**-0.5
    tokens = 256
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=DEV)
    k_fp8, k_scale = nsa.gather_k(cache, block_table[:1], cu, 64, False, tokens, torch.float8_e4m3fn)
    q_prefill = _random_fp8((tokens, 64, 128))
    w_prefill = torch.randn(tokens, 64, device=DEV)
    ks = torch.zeros(tokens, dtype=torch.int32, device=DEV)
    ke = torch.arange(1, tokens + 1, dtype=torch.int32, device=DEV)
    store = (k, cache, slots, 64, False, "ue8m0", torch.float8_e4m3fn, 128**-0.5, torch.bfloat16)
    cases = [
        ("quant_cache_store", "T=64, with the Hadamard epilogue", store),
        ("paged_mqa_logits", "B=64 ctx=8192", (q, cache, weights, context_lens, block_table, 8192, 64, False)),
        ("topk_indices", "64x8192 k=2048 sorted", (logits, 2048, context_lens, None, "neg1", True)),
        ("head_gate_gemm", "M=64 K=7168 split", (x, gate_weight, 4, False)),
        ("gather_k", f"T={tokens}", (cache, block_table[:1], cu, 64, False, tokens, torch.float8_e4m3fn)),
        ("mqa_logits", f"T={tokens}", (q_prefill, k_fp8, k_scale, w_prefill, ks, ke)),
    ]
    for name, case, call in cases:
        op, launcher = getattr(nsa, name), getattr(_op(name)[0], name)
        out = op(*call)
        plain = k if out is None else out[0] if isinstance(out, tuple) else out
        wall, issue = _host_us(lambda: op(*call))
        _, launch_issue = _host_us(lambda: launcher(*call))
        torch_wall, torch_issue = _host_us(lambda: torch.clone(plain))
        rows.append({"kernel": name, "case": case, "host": True, "wall_us": wall, "issue_us": issue,
                     "gpu_us": graph_us(lambda: op(*call)), "launcher_issue_us": launch_issue,
                     "torch_issue_us": torch_issue, "torch_wall_us": torch_wall,
                     "torch_gpu_us": graph_us(lambda: torch.clone(plain)), "torch_case": f"clone {list(plain.shape)}"})
    _custom_op_floor(rows)


def _custom_op_floor(rows: list[dict]) -> None:
    """What dispatch alone costs: ops whose bodies do nothing, shaped like the nsa ops (a mutating one with nine
    arguments, like ``quant_cache_store``), as ``torch.library.custom_op`` registers them and as a plain dispatcher
    kernel (``nsa_op``, how the nsa ops are registered)."""
    lib = "nsa_bench"
    if not hasattr(torch.ops, lib) or not hasattr(getattr(torch.ops, lib), "noop"):
        out = torch.empty(1, device=DEV)

        @torch.library.custom_op(f"{lib}::noop", mutates_args=())
        def noop(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor, e: torch.Tensor, n: int,
                 p: int, s: bool) -> torch.Tensor:
            return out

        noop.register_fake(lambda a, b, c, d, e, n, p, s: torch.empty_like(a))

        @torch.library.custom_op(f"{lib}::noop_mutating", mutates_args=("b",))
        def noop_mutating(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, p: int, s: bool, f: str,
                          dt: torch.dtype = torch.float8_e4m3fn, x: float = 1.0,
                          dt2: torch.dtype | None = None) -> None:
            return None

        _DISPATCHER_ONLY.define("noop_mutating_plain(" + str(torch.ops.nsa_bench.noop_mutating.default._schema)
                                .split("(", 1)[1])
        _DISPATCHER_ONLY.impl("noop_mutating_plain", lambda *args: None, "CUDA")

    x = torch.zeros(64, device=DEV)
    ops = getattr(torch.ops, lib)
    mutating = (x, x, x, 64, False, "ue8m0", torch.float8_e4m3fn, 0.5, torch.bfloat16)
    for kernel, case, fn in (("custom_op doing nothing", "8 arguments", lambda: ops.noop(x, x, x, x, x, 1, 2, True)),
                             ("custom_op doing nothing", "mutating, 9 arguments", lambda: ops.noop_mutating(*mutating)),
                             ("dispatcher kernel doing nothing", "mutating, 9 arguments",
                              lambda: ops.noop_mutating_plain(*mutating))):
        wall, issue = _host_us(fn)
        rows.append({"kernel": kernel, "case": case, "host": True, "wall_us": wall,
                     "issue_us": issue, "gpu_us": None, "launcher_issue_us": None, "torch_issue_us": None,
                     "torch_wall_us": None, "torch_gpu_us": None, "torch_case": "-"})


_DISPATCHER_ONLY = torch.library.Library("nsa_bench", "FRAGMENT")


def host_markdown(rows: list[dict]) -> str:
    lines = ["| op | case | wall µs/call | host µs/call | GPU µs | launcher alone: host µs | torch op | "
             "its wall µs | its host µs | its GPU µs |", "|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    def us(value) -> str:
        return "-" if value is None else f"{value:.1f}"

    for r in rows:
        lines.append(f"| {r['kernel']} | {r['case']} | {us(r['wall_us'])} | {us(r['issue_us'])} | {us(r['gpu_us'])} | "
                     f"{us(r['launcher_issue_us'])} | {r['torch_case']} | {us(r['torch_wall_us'])} | "
                     f"{us(r['torch_issue_us'])} | {us(r['torch_gpu_us'])} |")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    lines = [
        "| kernel | case | µs | torch µs | speedup | achieved | floor µs | % of floor | config |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in (r for r in rows if not r.get("host")):
        torch_us = f"{r['torch_us']:.1f}" if r["torch_us"] else "skipped"
        speedup = f"{r['torch_us'] / r['us']:.1f}x" if r["torch_us"] else "-"
        achieved = f"{r['tflops']:.0f} TFLOP/s" if "tflops" in r else f"{r['gbps']:.0f} GB/s"
        lines.append(
            f"| {r['kernel']} | {r['case']} | {r['us']:.1f} | {torch_us} | {speedup} | {achieved} | "
            f"{r['floor_us']:.1f} | {100 * r['floor_us'] / r['us']:.0f}% | {r['config']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller sweep")
    parser.add_argument("--out", type=pathlib.Path, help="write results.json and results.md here")
    parser.add_argument("--paged-config", action="append", metavar="CHUNK,BLOCK_N,WARPS,STAGES",
                        help="paged logits config to try (repeatable; default: the kernel's)")
    parser.add_argument("--ragged-config", action="append", metavar="BLOCK_M,BLOCK_N,WARPS,STAGES",
                        help="ragged logits config to try (repeatable; default: the kernel's)")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch reference timings")
    parser.add_argument("--xgemm-config", action="append",
                        metavar="BLOCK_M,GATE_BLOCK_N,K_BLOCK_N,BLOCK_K,WARPS,STAGES,GATE_SPLITS,K_SPLITS",
                        help="wk_gate_gemm config to try besides the sweep (repeatable)")
    parser.add_argument("--only", action="append",
                        choices=["paged", "ragged", "batched", "quant", "gather", "head_gate", "xgemm", "topk",
                                 "rotate", "host"],
                        help="run only these benchmarks (repeatable)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a GPU")
    torch.manual_seed(0)
    rows: list[dict] = []
    benches = {"quant": bench_quant_store, "gather": bench_gather, "paged": bench_paged, "ragged": bench_ragged,
               "batched": bench_batched, "head_gate": bench_head_gate, "xgemm": bench_xgemm, "topk": bench_topk,
               "rotate": bench_rotate, "host": bench_host}
    selected = args.only or [name for name in benches if name != "host"]  # host: only when asked for
    for name, bench in benches.items():
        if name in selected:
            bench(args, rows)
            print(f"done: {name}", flush=True)
    for r in rows:
        for cfg, us in r.get("sweep", {}).items():
            print(f"{r['kernel']:18s} {r['case']:40s} {us:9.1f} µs  {cfg}")
    table = markdown(rows)
    host_rows = [r for r in rows if r.get("host")]
    if host_rows:
        table = host_markdown(host_rows) if len(host_rows) == len(rows) else f"{table}\n\n{host_markdown(host_rows)}"
    device = torch.cuda.get_device_name(0)
    header = f"device: {device}, torch {torch.__version__}"
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"device": device, "torch": torch.__version__,
                                                           "rows": rows}, indent=2))
        (args.out / "results.md").write_text(header + "\n\n" + table + "\n")
    print()
    print(header)
    print(table)


if __name__ == "__main__":
    main()
