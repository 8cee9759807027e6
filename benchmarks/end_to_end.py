"""One indexer step, eager vs default Inductor vs nsa_rocm, in the same run: median time, kernel launches, agreement.

    python benchmarks/end_to_end.py [--config deepseek_v32|glm5] [--batch 64] [--ctx 8192] [--prefill 4096]
                                    [--layout paged] [--cuda-graphs] [--engine] [--out DIR]
    python benchmarks/end_to_end.py --sweep [--cells B1,B8,T8192,...] [--small] [--out DIR] [--deadline EPOCH_S]
    python benchmarks/end_to_end.py --merge DIR_OR_JSON ... --out DIR      (tables and plot of earlier sweeps, no GPU)

Decode: ``batch`` sequences, ``ctx`` tokens of context each (slightly varied), next_n=1, DeepSeek-V3.2 sizes.
Prefill: one causal sequence of ``prefill`` tokens. ``--engine``: the tests' engine-fed indexer
(``tests/helpers/engine_indexer.py``: ks/ke, per-row lengths, seq ids, positions and slot mapping precomputed by its
batch builder and passed in, K gathered by the model) instead of the reference ``Indexer``, same weights. Times are ``triton.testing.do_bench`` medians (L2 flushed before
every call); kernel counts are the CUDA kernels torch.profiler records for one step after warm-up. Agreement is
checked against eager: K-cache bytes, -inf masks, logits relative error, top-k sets.

``--sweep``: decode B in {1, 8, 64, 256} x ctx in {2048, 8192, 32768} (next_n 1) and prefill T in {1024, 8192},
eager, default Inductor and nsa_rocm, each without and with a CUDA graph, in one process (see ``run_sweep``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time
import dataclasses
from dataclasses import dataclass

import torch
import torch._inductor
from torch.profiler import ProfilerActivity, profile

import nsa_inductor
from nsa_inductor.capability import describe, select_layout
from nsa_inductor.indexer import Indexer, IndexerConfig
from nsa_inductor.layout import KCacheLayout
from nsa_inductor.workload import Batch, decode_batch, prefill_batch


def cuda_kernels(fn, args) -> list[str]:
    """Names of the CUDA kernels (and memcpy/memset) one call launches, in order."""
    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def topk_overlap(topk: torch.Tensor, c_topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the fraction of eager's top-k indices (>= 0; -1 pads) that the other side also returns, and whether
    the two index sets are identical. Vectorised (a causal prefill of 8192 rows x 2048 is 16M indices)."""
    a, b = topk.long(), c_topk.long()
    b_sorted = b.sort(dim=1).values
    pos = torch.searchsorted(b_sorted, a).clamp(max=b.shape[1] - 1)
    hits = ((b_sorted.gather(1, pos) == a) & (a >= 0)).sum(1)
    n_a, n_b = (a >= 0).sum(1), (b >= 0).sum(1)
    overlap = torch.where(n_a == 0, (n_b == 0).double(), hits / n_a.clamp(min=1))
    return overlap, (hits == n_a) & (n_a == n_b)


def agreement(eager_out, eager_cache, out, cache) -> dict:
    (logits, topk), (c_logits, c_topk) = eager_out, out
    finite = ~logits.isneginf()
    ref = logits[finite].double()
    err = ((ref - c_logits[finite].double()).norm() / ref.norm().clamp(min=1e-30)).item()
    overlap, identical = topk_overlap(topk, c_topk)
    return {
        "cache_bytes_equal": bool(torch.equal(eager_cache, cache)),
        "neginf_masks_equal": bool(torch.equal(logits.isneginf(), c_logits.isneginf())),
        "logits_rel_err": err,
        "topk_overlap_mean": overlap.mean().item(),
        "topk_sets_identical": identical.double().mean().item(),
    }


def bench_step(name, fn, make_batch, options, mode, only, static_inputs=False, replay=False) -> list[dict]:
    """One step of every variant in ``only``: its output against eager's, its time (``triton.testing.do_bench``, or
    with ``replay`` replays of a CUDA graph that holds 10 steps) and its kernels."""
    import triton.testing

    if replay:
        import sys

        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from timing import graph_us

    batch = make_batch()
    eager_batch = batch.clone()
    with torch.no_grad():
        eager_out = fn(*eager_batch.args)
    # torch.compile takes mode or options, not both: the mode's Inductor options travel with the nsa ones.
    mode_options = torch._inductor.list_mode_options(mode) if mode else {}

    def nsa(extra: dict, step=fn):
        return torch.compile(step, backend="nsa_rocm", options={**options, **extra, **mode_options})

    def indices_only(*args):  # what a serving engine's indexer returns: the logits stay inside the step
        return fn(*args)[1]

    variants = {
        "eager": fn,
        "inductor": torch.compile(fn, backend="inductor", mode=mode),
        # nsa_checks: with the index checks' device-side asserts (their cost); nsa_no_slot_gather: without the
        # gather_k_slots pass (Inductor gathers the engine's K: that pass's share); nsa_one_stream: without
        # the side_stream pass (the K side on the current stream); nsa_indices_only: the step returning the top-k only
        # (the paged logits then leave their masked columns unwritten). All before nsa_rocm, whose pass report is the
        # one printed.
        "nsa_checks": nsa({"nsa.checks": True}),
        "nsa_no_slot_gather": nsa({"nsa.disable_passes": ["gather_k_slots"]}),
        "nsa_one_stream": nsa({"nsa.side_stream": False}),
        "nsa_indices_only": nsa({}, indices_only),
        "nsa_rocm": nsa({}),
    }
    reports_before = nsa_inductor.last_reports()
    rows = []
    for variant, step in ((v, s) for v, s in variants.items() if v in only):
        run_batch = batch.clone()
        if mode:
            # CUDA graphs skip graphs that mutate an input unless its address is fixed, as a serving cache's is;
            # with static_inputs every input is, as an engine's persistent buffers are: the graph copies none in.
            for t in run_batch.args if static_inputs else (run_batch.kv_cache,):
                torch._dynamo.mark_static_address(t)
        with torch.no_grad():
            out = step(*run_batch.args)
            if variant == "nsa_indices_only":  # no logits to compare: NaN in their place
                out = (torch.full_like(eager_out[0], float("nan")), out)
            checks = agreement(eager_out, eager_batch.kv_cache, out, run_batch.kv_cache)
            if replay:
                try:
                    us = graph_us(lambda: step(*run_batch.args), calls=10)
                except RuntimeError as error:  # eager's step may not be capturable
                    print(f"{name:8s} {variant:9s} not captured: {str(error).splitlines()[0]}", flush=True)
                    torch.cuda.synchronize()
                    continue
            else:
                us = 1e3 * triton.testing.do_bench(lambda: step(*run_batch.args), warmup=50, rep=300,
                                                   return_mode="median")
            kernel_names = cuda_kernels(step, run_batch.args)
            kernels = len(kernel_names)
        rows.append({"step": name, "variant": variant, "us": us, "kernels": kernels,
                     "kernel_names": kernel_names, **checks})
        print(f"{name:8s} {variant:9s} {us:10.1f} us  {kernels:4d} kernels  {checks}", flush=True)
    if "nsa_rocm" not in only:
        return rows
    reports = _reports_since(reports_before)
    if not reports:
        print(f"{name} passes: no report (the graph came from Inductor's FX graph cache)", flush=True)
        return rows
    report = reports[-1]
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
            config, layout.page_size, context_lens, 1, args.ctx, None, seed=0).to("cuda"), options, mode, only,
            replay=args.graph_replay)
    if args.prefill:
        rows += bench_step("prefill", model.prefill, lambda: engine_prefill_batch(
            config, layout.page_size, [args.prefill], 0, None, seed=0).to("cuda"), options, mode, only)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# --sweep: every cell of the grid, every variant, with and without a CUDA graph, in one process
# ---------------------------------------------------------------------------------------------------------------

SWEEP_GRID = {  # (decode batches, decode contexts, prefill lengths)
    "full": ((1, 8, 64, 256), (2048, 8192, 32768), (1024, 8192)),
    "small": ((1, 4), (96, 320), (64, 160)),  # --small: CPU-sized, IndexerConfig.small(), for the CI test
}
VARIANTS = ("eager", "inductor", "nsa_rocm")
# Default Inductor's prefill trips torch 2.11's searchsorted bug on GPUs: a device-side assert ends the process
# (BENCHMARKS.md, prefill end to end), so the sweep leaves it out there unless asked (--prefill-inductor).
PREFILL_INDUCTOR_SKIP = "default Inductor prefill: torch 2.11 searchsorted bug ends the process on GPUs"


@dataclass(frozen=True)
class Cell:
    """One point of the grid: ``decode`` of ``batch`` sequences of ~``ctx`` tokens, or ``prefill`` of ``ctx``."""

    kind: str
    batch: int
    ctx: int

    @property
    def name(self) -> str:
        return f"decode B={self.batch} ctx={self.ctx}" if self.kind == "decode" else f"prefill T={self.ctx}"

    @property
    def token(self) -> str:
        return f"B{self.batch}x{self.ctx}" if self.kind == "decode" else f"T{self.ctx}"


def sweep_cells(grid: str, selection: str | None) -> list[Cell]:
    """The grid's cells, decode first (a batch > 1 first, so the first compile is the dynamic one), filtered by
    ``selection``: comma-separated ``decode``, ``prefill``, ``B<b>`` (one batch, every ctx), ``B<b>x<ctx>``,
    ``T<t>``."""
    batches, contexts, lengths = SWEEP_GRID[grid]
    cells = [Cell("decode", b, c) for b in sorted(batches, key=lambda b: (b == 1, b)) for c in contexts]
    cells += [Cell("prefill", 1, t) for t in lengths]
    if not selection:
        return cells
    wanted = [w.strip() for w in selection.split(",") if w.strip()]
    known = {"decode", "prefill"} | {f"B{b}" for b in batches} | {c.token for c in cells}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise SystemExit(f"--cells: unknown {unknown}; known: {sorted(known)}")
    return [c for c in cells if c.kind in wanted or c.token in wanted or f"B{c.batch}" in wanted and c.kind == "decode"]


def _mark_shapes(batch: Batch, kind: str) -> Batch:
    """Sizes that change between cells become symbols on the first compile (one graph for every batch > 1 and
    every context; Dynamo still specialises size 1); the cache keeps its one shape, as a serving cache does."""
    torch._dynamo.mark_static(batch.kv_cache)
    for t in (batch.x, batch.q_lora, batch.positions, batch.slot_mapping):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    torch._dynamo.maybe_mark_dynamic(batch.block_table, 1)
    if kind == "decode":
        torch._dynamo.maybe_mark_dynamic(batch.block_table, 0)
        torch._dynamo.maybe_mark_dynamic(batch.lens, 0)
    return batch


class SweepRunner:
    """One model, one K cache sized for the largest cell (filled once with random quantised K), and one compiled
    function per (variant, entry point) that every cell reuses; each cell gets its own block table, random pages
    of that cache."""

    def __init__(self, args, device: torch.device):
        self.args, self.device = args, device
        batches, contexts, lengths = SWEEP_GRID[args.grid]
        config = getattr(IndexerConfig, args.config)()
        config = config.small() if args.grid == "small" else config
        # The model's own max_model_len (65536; 1024 small), wider than every cell: a cell whose block table spans
        # the whole logits row compiles another graph (its slice write covers the buffer, nothing is left to fill).
        self.max_model_len = args.max_model_len or config.max_model_len
        if self.max_model_len < max(contexts + lengths):
            raise SystemExit(f"--max-model-len {self.max_model_len} is below the grid's largest context")
        self.config = dataclasses.replace(config, max_model_len=self.max_model_len)
        decision = select_layout(args.layout)
        self.layout: KCacheLayout = decision.layout
        self.describe = describe(decision)
        self.model = Indexer(self.config, self.layout).to(device)
        self.model.reset_parameters(torch.Generator().manual_seed(0))
        page = self.layout.page_size
        self.num_pages = max(max(batches) * self.layout.num_pages(max(contexts)), self.layout.num_pages(max(lengths)))
        self.base_cache = self._filled_cache()
        self.cache = self.base_cache.clone()
        self.options = {"nsa.layout": self.layout.name, "nsa.page_size": page, "nsa.topk_order": args.topk_order}
        self.compiles: list[dict] = []
        self.fns = {(v, kind): self._compiled(v, kind) for v in VARIANTS for kind in ("decode", "prefill")}

    def _filled_cache(self) -> torch.Tensor:
        cache = self.layout.allocate(self.num_pages * self.layout.page_size, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(1)
        chunk = 1 << 20
        for start in range(0, cache.shape[0] * self.layout.page_size, chunk):
            slots = torch.arange(start, min(start + chunk, cache.shape[0] * self.layout.page_size), device=self.device)
            k = torch.randn(len(slots), self.config.head_dim, generator=gen, device=self.device)
            torch.ops.nsa.quant_cache_store(k, cache, slots, self.layout.page_size, self.layout.preshuffle,
                                            self.config.scale_fmt, self.config.fp8_dtype)
        return cache

    def _compiled(self, variant: str, kind: str):
        fn = getattr(self.model, kind)
        if variant == "eager":
            return fn
        if variant == "inductor":
            from torch._dynamo.backends.registry import lookup_backend

            inner = lookup_backend("inductor")
        else:
            from nsa_inductor.backend import nsa_rocm

            def inner(gm, example_inputs):
                return nsa_rocm(gm, example_inputs, options=self.options)

        def counted(gm, example_inputs):
            self.compiles.append({"variant": variant, "kind": kind})  # replaced by _record_compile
            return inner(gm, example_inputs)

        return torch.compile(fn, backend=counted)

    def inputs(self, cell: Cell, seed: int) -> Batch:
        """Inputs of one cell; the cache is ``self.cache`` (restored from ``base_cache`` before each run)."""
        c, page, dev = self.config, self.layout.page_size, self.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        if cell.kind == "decode":
            spread = max(1, min(512, cell.ctx // 4))
            lens = torch.tensor([cell.ctx - (i * 37) % spread for i in range(cell.batch)], dtype=torch.int32,
                                device=dev)
            width = self.layout.num_pages(cell.ctx)
            table = torch.randperm(self.num_pages, generator=gen, device=dev)[: cell.batch * width]
            table = table.view(cell.batch, width).int()
            positions = lens.long() - 1
            tokens = cell.batch
        else:
            width = self.layout.num_pages(cell.ctx)
            table = torch.randperm(self.num_pages, generator=gen, device=dev)[:width].view(1, width).int()
            positions = torch.arange(cell.ctx, device=dev)
            lens = torch.tensor([0, cell.ctx], dtype=torch.int32, device=dev)
            tokens = cell.ctx
        row = torch.arange(table.shape[0], device=dev).repeat_interleave(tokens // table.shape[0])
        slots = table[row, positions // page].long() * page + positions % page
        x = torch.randn(tokens, c.hidden_size, generator=gen, device=dev).bfloat16()
        q_lora = torch.randn(tokens, c.q_lora_rank, generator=gen, device=dev).bfloat16()
        return _mark_shapes(Batch(x, q_lora, positions, slots, self.cache, table, lens), cell.kind)

    # -- measurements --------------------------------------------------------------------------------------------

    def time_us(self, fn) -> float:
        if self.device.type == "cuda":
            import triton.testing

            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return sorted(times)[len(times) // 2]

    def kernels(self, fn, steps: int = 3) -> tuple[float | None, float | None]:
        """(kernels per step, GPU µs per step) from torch.profiler: CUDA kernels, memcpy and memset."""
        if self.device.type != "cuda":
            return None, None
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return len(events) / steps, sum(e.time_range.elapsed_us() for e in events) / steps

    def graphed(self, fn, args):
        """``(replay, outputs)``: one step captured in a CUDA graph after two warm-up calls on a side stream. The
        inputs are the graph's own (fixed addresses, as a serving engine's buffers are): no input copies."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the graph's private pool cannot use blocks cached for plain calls
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(*args)
        return graph, out

    def run_cell(self, cell: Cell, variants: list[str], rows: list[dict]) -> None:
        """Eager's output and cache bytes, then every variant without and with a CUDA graph. A variant that raises
        gets a row saying so and the sweep goes on (a device-side assert still ends the process)."""
        batch = self.inputs(cell, seed=cell.batch * 100_003 + cell.ctx)
        with torch.no_grad():
            self.cache.copy_(self.base_cache)
            eager = self.fns["eager", cell.kind](*batch.args), self.cache.clone()
            for variant in variants:
                base = {"cell": cell.name, "kind": cell.kind, "batch": cell.batch, "ctx": cell.ctx,
                        "variant": variant, "graphs": False}
                if (variant == "inductor" and cell.kind == "prefill" and self.device.type == "cuda"
                        and not self.args.prefill_inductor):
                    rows.append({**base, "skipped": f"skipped: {PREFILL_INDUCTOR_SKIP}"})
                    continue
                for graphs in (False, True) if self.device.type == "cuda" and not self.args.no_graphs else (False,):
                    try:
                        row = {**base, "graphs": graphs,
                               **self.measure(self.fns[variant, cell.kind], batch, eager, graphs, (variant, cell))}
                    except Exception as error:  # noqa: BLE001  (one failing variant must not end the sweep)
                        row = {**base, "graphs": graphs, "skipped": f"failed: {type(error).__name__}: "
                                                                    f"{str(error).splitlines()[0][:160]}"}
                        print(f"{cell.name} {variant} graphs={graphs}: {row['skipped']}", flush=True)
                        if not graphs:
                            break
                    else:
                        _print_row(row)
                    rows.append(row)
                    if self.device.type == "cuda":
                        torch.cuda.empty_cache()

    def measure(self, fn, batch: Batch, eager, graphs: bool, what: tuple[str, Cell]) -> dict:
        """One variant on one cell: the first call (or the graph capture), agreement with ``eager`` (its output and
        cache bytes), median time, kernels and GPU time per step."""
        cuda = self.device.type == "cuda"
        self.cache.copy_(self.base_cache)
        if graphs:
            graph, out = self.graphed(fn, batch.args)
            self.cache.copy_(self.base_cache)
            graph.replay()
            step = graph.replay
            first_s = peak_gb = None
        else:
            compiles_before, reports_before = len(self.compiles), nsa_inductor.last_reports()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                resident = torch.cuda.memory_allocated()
            start = time.perf_counter()
            out = fn(*batch.args)
            if cuda:
                torch.cuda.synchronize()
            first_s = time.perf_counter() - start
            peak_gb = (torch.cuda.max_memory_allocated() - resident) / 1e9 if cuda else None
            if len(self.compiles) > compiles_before:
                self._record_compile(what, first_s, compiles_before, reports_before)
            else:
                first_s = None
            step = lambda: fn(*batch.args)  # noqa: E731
        checks = agreement(*eager, out, self.cache)
        del out
        us = self.time_us(step)
        kernels, gpu_us = self.kernels(step)
        return {"us": us, "kernels": kernels, "gpu_us": gpu_us, "compile_s": first_s, "peak_gb": peak_gb, **checks}

    def _record_compile(self, what: tuple[str, Cell], seconds: float, compiles_before: int,
                        reports_before: list[dict]) -> None:
        """One record per (variant, cell) whose first call compiled, however many graphs it compiled."""
        variant, cell = what
        graphs = len(self.compiles) - compiles_before
        del self.compiles[compiles_before:]
        reports = _reports_since(reports_before)
        self.compiles.append({"variant": variant, "kind": cell.kind, "cell": cell.name, "seconds": seconds,
                              "graphs_compiled": graphs,
                              "passes": _pass_counts(reports) if variant == "nsa_rocm" else None})


def _reports_since(before: list[dict]) -> list[dict]:
    """The reports made since ``last_reports()`` returned ``before``: compared by identity, as ``last_reports()``
    keeps only the last 64 (its length stops growing in a long process); ``before`` keeps those objects alive."""
    ids = {id(r) for r in before}
    return [r for r in nsa_inductor.last_reports() if id(r) not in ids]


def _pass_counts(reports: list[dict]) -> str:
    if not reports:
        return "no report (graph from Inductor's FX graph cache)"
    return "; ".join(", ".join(f"{p['name']} {p['matched']}" for p in r["passes"] if p["matched"]) or "none"
                     for r in reports)


def _print_row(row: dict) -> None:
    mode = "graph" if row["graphs"] else "plain"
    print(f"{row['cell']:26s} {row['variant']:9s} {mode:5s} {row['us']:10.1f} us  kernels {row['kernels']}  "
          f"cache={row['cache_bytes_equal']} err={row['logits_rel_err']:.1e} "
          f"topk={row['topk_overlap_mean']:.4f}", flush=True)


def _key(row: dict) -> tuple:
    return row["cell"], row["variant"], row["graphs"]


def _ratio(rows_by_key: dict, row: dict, other: str) -> str:
    base = rows_by_key.get((row["cell"], other, row["graphs"]))
    if not base or "us" not in base or "us" not in row:
        return "-"
    return f"{base['us'] / row['us']:.2f}x"


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def sweep_tables(result: dict) -> tuple[str, str]:
    """(full table, short table) in markdown."""
    rows = sorted(result["rows"], key=lambda r: (r["kind"] != "decode", r["batch"], r["ctx"],
                                                VARIANTS.index(r["variant"]), r["graphs"]))
    by_key = {_key(r): r for r in rows}
    full = ["| cell | variant | CUDA graph | µs | vs eager | vs inductor | kernels | GPU µs | compile s | peak GB | "
            "cache = eager | logits rel. err | top-k overlap | top-k sets identical |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        graph = "yes" if r["graphs"] else "no"
        if "skipped" in r:
            full.append(f"| {r['cell']} | {r['variant']} | {graph} | {r['skipped']} |" + " |" * 10)
            continue
        full.append(
            f"| {r['cell']} | {r['variant']} | {graph} | {r['us']:.1f} | {_ratio(by_key, r, 'eager')} | "
            f"{_ratio(by_key, r, 'inductor')} | {_fmt(r['kernels'], '.0f')} | {_fmt(r['gpu_us'], '.1f')} | "
            f"{_fmt(r['compile_s'], '.1f')} | {_fmt(r['peak_gb'], '.2f')} | {r['cache_bytes_equal']} | "
            f"{r['logits_rel_err']:.1e} | {r['topk_overlap_mean']:.4f} | {r['topk_sets_identical']:.3f} |")
    columns = [(v, g) for v in VARIANTS for g in (False, True)]
    short = ["| cell | " + " | ".join(f"{v}{' graph' if g else ''}" for v, g in columns)
             + " | nsa_rocm vs inductor, graph |", "|---|" + "---:|" * (len(columns) + 1)]
    for cell in dict.fromkeys(r["cell"] for r in rows):
        cells = [by_key.get((cell, v, g)) for v, g in columns]
        nsa, ind = by_key.get((cell, "nsa_rocm", True)), by_key.get((cell, "inductor", True))
        ratio = _ratio(by_key, nsa, "inductor") if nsa and ind else "-"
        short.append(f"| {cell} | " + " | ".join(f"{r['us']:.1f}" if r and "us" in r else "-" for r in cells)
                     + f" | {ratio} |")
    compiles = ["| variant | entry | first cell | compile s | graphs | nsa passes matched |",
                "|---|---|---|---:|---:|---|"]
    for c in result.get("compiles", []):
        if "cell" in c:
            compiles.append(f"| {c['variant']} | {c['kind']} | {c['cell']} | {c['seconds']:.1f} | "
                            f"{c['graphs_compiled']} | {c['passes'] or '-'} |")
    return "\n".join(full) + "\n\n" + "\n".join(compiles), "\n".join(short)


def sweep_plot(result: dict, path: pathlib.Path) -> None:
    """µs per step against ctx, one panel per decode batch (and one for prefill against T), one line per variant
    (solid: CUDA graph, dashed: none). Needs the optional extra ``bench`` (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is missing (pip install -e '.[bench]'); {path.name} not written", flush=True)
        return
    rows = [r for r in result["rows"] if "us" in r]
    panels = [("decode", b) for b in sorted({r["batch"] for r in rows if r["kind"] == "decode"})]
    panels += [("prefill", 1)] if any(r["kind"] == "prefill" for r in rows) else []
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    colors = {"eager": "tab:gray", "inductor": "tab:blue", "nsa_rocm": "tab:red"}
    for ax, (kind, batch) in zip(axes[0], panels):
        for variant in VARIANTS:
            for graphs in (False, True):
                line = sorted((r["ctx"], r["us"]) for r in rows if r["kind"] == kind and r["variant"] == variant
                              and r["graphs"] == graphs and (kind == "prefill" or r["batch"] == batch))
                if line:
                    ax.plot(*zip(*line), marker="o", color=colors[variant], linestyle="-" if graphs else "--",
                            label=f"{variant}{', CUDA graph' if graphs else ''}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"decode B={batch}" if kind == "decode" else "prefill (one sequence)")
        ax.set_xlabel("context tokens" if kind == "decode" else "tokens T")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("µs per step (median)")
    handles = {label: handle for ax in axes[0] for handle, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(f"{result['meta']['config']}, {result['meta']['device']}, layout {result['meta']['layout']}, "
                 f"max_model_len {result['meta']['max_model_len']}", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}", flush=True)


def _load_result(path: pathlib.Path) -> dict:
    return json.loads((path / "sweep.json" if path.is_dir() else path).read_text())


def merge_results(base: dict | None, new: dict) -> dict:
    """``new``'s rows replace ``base``'s rows of the same cell, variant and graph mode. Results of another model,
    layout or device do not merge."""
    if base is None:
        return new
    if base["meta"] != new["meta"]:
        raise SystemExit(f"cannot merge sweeps of different setups: {base['meta']} vs {new['meta']}")
    rows = {_key(r): r for r in base["rows"]}
    rows.update({_key(r): r for r in new["rows"]})
    return {"meta": base["meta"], "rows": list(rows.values()), "compiles": base["compiles"] + new["compiles"],
            "not_run": sorted(set(new.get("not_run", [])))}


def write_sweep(result: dict, out: pathlib.Path | None, plot: bool = True) -> str:
    full, short = sweep_tables(result)
    meta = result["meta"]
    header = (f"device: {meta['device']}, torch {meta['torch']}, {meta['config']}, layout {meta['layout']}, "
              f"max_model_len {meta['max_model_len']}")
    text = f"{header}\n\n{full}\n\n{short}\n"
    if result.get("not_run"):
        text += f"\nnot run (deadline): {', '.join(result['not_run'])}\n"
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps(result, indent=1))
        (out / "sweep.md").write_text(text)
        (out / "sweep_short.md").write_text(f"{header}\n\n{short}\n")
        if plot:
            sweep_plot(result, out / "sweep.png")
    return text


def run_sweep(args) -> None:
    """Compile each variant once per entry point with symbolic batch, token count and block-table width (Dynamo
    still specialises size 1: B=1 gets its own graph), allocate one cache for the largest cell, then per cell:
    eager's output and cache bytes, and for each variant the first call (compile), agreement, do_bench median,
    profiler kernels and GPU time, then the same with the step captured in a CUDA graph. The table is rewritten
    after every cell, so a run stopped by a time limit keeps what it measured; ``--deadline`` (Unix seconds)
    stops before a cell that starts after it and lists the cells not run."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.grid == "full" and device.type != "cuda":
        raise SystemExit("the full sweep needs a GPU; --small runs on the CPU")
    for name, value in (("recompile_limit", 64), ("accumulated_recompile_limit", 1024)):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), value))
    cells = sweep_cells(args.grid, args.cells)
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    start = time.perf_counter()
    runner = SweepRunner(args, device)
    print(f"{runner.describe}\nsetup {time.perf_counter() - start:.1f} s: cache of {runner.num_pages} pages "
          f"({runner.base_cache.numel() / 1e9:.2f} GB), cells: {', '.join(c.token for c in cells)}", flush=True)
    out = pathlib.Path(args.out) if args.out else None
    previous = _load_result(out) if out is not None and (out / "sweep.json").exists() else None
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "config": args.config + (" (small)" if args.grid == "small" else ""), "layout": str(runner.layout),
            "max_model_len": runner.max_model_len, "topk_order": args.topk_order}
    rows: list[dict] = []
    not_run: list[str] = []
    for cell in cells:
        if args.deadline and time.time() > args.deadline:
            not_run.append(cell.token)
            continue
        runner.run_cell(cell, variants, rows)
        result = merge_results(previous, {"meta": meta, "rows": rows, "compiles": runner.compiles,
                                          "not_run": not_run})
        write_sweep(result, out, plot=False)
    result = merge_results(previous, {"meta": meta, "rows": rows, "compiles": runner.compiles, "not_run": not_run})
    print("\n" + write_sweep(result, out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=("deepseek_v32", "glm5"), default="deepseek_v32")
    parser.add_argument("--batch", type=int, default=64, help="decode sequences (0 to skip decode)")
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--prefill", type=int, default=4096, help="prefill tokens (0 to skip)")
    parser.add_argument("--layout", choices=("flat", "paged", "preshuffle"), default=None)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help='compile both variants with mode="reduce-overhead" (replays take the launch cost away)')
    parser.add_argument("--graph-replay", action="store_true",
                        help="time each compiled step (no reduce-overhead) as engines run it: 10 steps captured in "
                             "one CUDA graph by hand, replayed (no Python, no input copies in the figure)")
    parser.add_argument("--static-inputs", action="store_true",
                        help="with --cuda-graphs: every input at a fixed address (an engine's persistent buffers), "
                             "so the graph copies none of them in")
    parser.add_argument("--no-head-gate", action="store_true",
                        help="nsa_rocm without the bf16 head-gate rewrite (to measure what it costs)")
    parser.add_argument("--variants", default="eager,inductor,nsa_rocm",
                        help="comma-separated subset; nsa_checks is nsa_rocm with nsa.checks, nsa_no_slot_gather "
                             "without the gather_k_slots pass (default Inductor's prefill hits a torch 2.11 bug on "
                             "GPUs), nsa_one_stream with nsa.side_stream=False, nsa_indices_only nsa_rocm's step "
                             "returning the top-k only")
    parser.add_argument("--topk-order", choices=("sorted", "set"), default="sorted",
                        help="nsa.topk_order: torch's order (default) or set order (engines that use indices as a set)")
    parser.add_argument("--engine", action="store_true",
                        help="the engine-fed indexer (metadata as inputs; row-major layouts only)")
    parser.add_argument("--out", default=None)
    sweep = parser.add_argument_group("--sweep and --merge")
    sweep.add_argument("--sweep", action="store_true", help="every cell of the grid (run_sweep), tables and a plot")
    sweep.add_argument("--small", action="store_true", help="the CPU-sized grid and IndexerConfig.small()")
    sweep.add_argument("--cells", default=None,
                       help="subset, comma-separated: decode, prefill, B<b>, B<b>x<ctx>, T<t> (e.g. B1,B8 or T8192)")
    sweep.add_argument("--max-model-len", type=int, default=None,
                       help="decode logits width (--sweep: default the config's, 65536, every cell shares it; one "
                            "cell: default --ctx, a wider one as an engine allocates it)")
    sweep.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph rows")
    sweep.add_argument("--prefill-inductor", action="store_true", help="run default Inductor's prefill too")
    sweep.add_argument("--deadline", type=float, default=None, help="Unix time after which no new cell starts")
    sweep.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    sweep.add_argument("--merge", nargs="+", metavar="DIR_OR_JSON",
                       help="merge earlier sweeps (sweep.json or their --out folders) into --out; runs nothing")
    args = parser.parse_args()
    if args.merge:
        result = None
        for path in args.merge:
            result = merge_results(result, _load_result(pathlib.Path(path)))
        print(write_sweep(result, pathlib.Path(args.out) if args.out else None))
        return
    if args.sweep:
        args.grid = "small" if args.small else "full"
        run_sweep(args)
        return

    decision = select_layout(args.layout)
    layout = decision.layout
    config = getattr(IndexerConfig, args.config)(max_model_len=max(args.ctx, args.prefill, args.max_model_len or 0))
    print(describe(decision), flush=True)
    model = Indexer(config, layout).cuda()
    model.reset_parameters(torch.Generator().manual_seed(0))
    options = {"nsa.layout": layout.name, "nsa.page_size": layout.page_size,
               "nsa.head_gate_mode": "off" if args.no_head_gate else "split", "nsa.topk_order": args.topk_order}
    context_lens = [args.ctx - (i * 37) % 512 for i in range(args.batch)]
    if args.cuda_graphs and args.graph_replay:
        raise SystemExit("--cuda-graphs (torch.compile's own graphs) and --graph-replay (graphs by hand) exclude "
                         "each other")
    mode = "reduce-overhead" if args.cuda_graphs else None
    only = set(args.variants.split(","))
    rows = []
    if args.engine:
        rows += engine_steps(args, config, model, options, context_lens, mode, only)
    else:
        if args.batch:
            rows += bench_step("decode", model.decode, lambda: decode_batch(config, layout, context_lens,
                                                                            max_len=args.ctx, device="cuda"),
                               options, mode, only, args.static_inputs, args.graph_replay)
        if args.prefill:
            rows += bench_step("prefill", model.prefill,
                               lambda: prefill_batch(config, layout, [args.prefill], device="cuda"), options, mode, only,
                               args.static_inputs, args.graph_replay)

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
