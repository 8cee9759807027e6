"""A/B of ``topk_indices`` across copies of the package: CUDA-graph µs per cell, each copy in its own process,
the copies alternated ``--rounds`` times (run-to-run spread shows as the spread of a cell's rounds).

    python3 benchmarks/topk_ab.py --pkg main=dev/main_pkg --pkg new=. [--rounds 2] [--cells 64x8192,8x8192:sorted]
        [--kernels] [--deadline EPOCH_S]

A copy is a folder holding an ``nsa_inductor/`` package: ``.`` (the working tree) or one made from a revision here,
``mkdir -p dev/main_pkg && git archive REV nsa_inductor | tar -x -C dev/main_pkg``, carried to the GPU machine
(``dev/`` is git-ignored: ``carry: ["dev"]``). A cell is ``ROWSxWIDTH`` then ``:``-separated options: ``sorted``;
``lengths=LO-HI`` (drawn in [LO, HI)) or ``causal``; values ``relu`` (the indexer's relu sums) or ``ties``;
``NAME=VALUE`` passed to ``topk_indices`` (``path=radix_split``, ``num_warps=2``, ``segment=512``, ...);
``@NAME=VALUE`` sets the kernel module's constant NAME for that cell (one the launcher reads, as
``RADIX_SMALL_BLOCK``; a global a kernel reads, as ``INTERPOLATION_STEPS``, is fixed once compiled: vary it in a
copy). k = 2048, random rows (the same in every copy); each cell's result is checked (the selected values are
``torch.topk``'s of the masked rows, in its order where sorted) and marked ``!WRONG`` otherwise; a cell whose call
raises shows ``failed`` (the error printed once) and the others run. ``--kernels`` adds each cell's GPU µs per kernel
(torch.profiler over calls outside a graph, after the timings: the time each kernel runs, what holds a cell's time).
``--deadline EPOCH_S`` (Unix seconds): no copy starts and no cell is timed or profiled after it (those show
``skipped``), so a run under a device call's time limit prints what it measured instead of being killed with it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import json
import os
import pathlib
import subprocess
import sys
import time

K = 2048
CELLS = ("64x8192,64x8192:sorted,64x8192:relu,8x8192,1x32768,16x16384,64x65536,64x65536:lengths=7680-8704,"
         "8x65536:lengths=7680-8704,1x65536:lengths=7680-8704")


def _value(text: str):
    """A cell option's value: an int, a bool (``True``/``False``, as ``bounds=True``), else the text."""
    if text in ("True", "False"):
        return text == "True"
    return int(text) if text.lstrip("-").isdigit() else text


def parse_cell(cell: str) -> dict:
    """A cell's rows, width, order, lengths, values, ``topk_indices`` keywords and module constants."""
    size, *options = cell.split(":")
    rows, width = map(int, size.split("x"))
    spec = dict(rows=rows, width=width, sorted=False, lengths=None, values="randn", keywords={}, constants={})
    for option in options:
        name, _, value = option.partition("=")
        if option == "sorted":
            spec["sorted"] = True
        elif option == "causal":
            spec["lengths"] = "causal"
        elif option in ("relu", "ties"):
            spec["values"] = option
        elif name == "lengths":
            spec["lengths"] = tuple(map(int, value.split("-")))
        elif name.startswith("@") and value:
            spec["constants"][name[1:]] = _value(value)
        elif value:
            spec["keywords"][name] = _value(value)
        else:
            raise SystemExit(f"unknown option {option!r} in cell {cell!r}")
    return spec


def _unknown(spec: dict, keywords, constants) -> list[str]:
    """The cell's keywords not among ``keywords`` and constants (``@NAME``) not among ``constants``."""
    return [k for k in spec["keywords"] if k not in keywords] + [
        f"@{c}" for c in spec["constants"] if c not in constants]


def _imported_names(tk) -> tuple[set[str], set[str]]:
    """The keywords of an imported kernel module's ``topk_indices`` and the module's names."""
    return set(inspect.signature(tk.topk_indices).parameters), set(vars(tk))


def _names(folder: str) -> tuple[set[str], set[str]]:
    """The keywords of a copy's ``topk_indices`` and its kernel module's top-level names, read from its source (the
    copies are other revisions of one package: one process cannot import them all)."""
    source = pathlib.Path(folder) / "nsa_inductor" / "lowering" / "topk_indices" / "triton.py"
    keywords: set[str] = set()
    constants: set[str] = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == "topk_indices":
            keywords = {a.arg for a in node.args.args + node.args.kwonlyargs}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            constants |= {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                          if isinstance(t, ast.Name)}
    return keywords, constants


def check_cells(cells: list[str], folders: list[str]) -> None:
    """Every cell parses, and each keyword of ``topk_indices`` and constant of its module it names is in at least one
    of the copies: a typo fails here, before any copy runs; a copy without one shows ``n/a`` for the cell."""
    names = [_names(folder) for folder in folders]
    keywords = set().union(*(k for k, _ in names))
    constants = set().union(*(c for _, c in names))
    for cell in cells:
        unknown = _unknown(parse_cell(cell), keywords, constants)
        if unknown:
            raise SystemExit(f"cell {cell!r}: no copy's topk_indices has {', '.join(unknown)}")


def _inputs(spec: dict):
    import torch

    torch.manual_seed(0)
    rows, width = spec["rows"], spec["width"]
    logits = torch.randn(rows, width, device="cuda")
    if spec["values"] == "relu":
        logits = torch.relu(logits) * 3 + 0.01 * torch.randn_like(logits)
    elif spec["values"] == "ties":
        logits = torch.randint(0, 64, (rows, width), device="cuda").float()
    lengths = None
    if spec["lengths"] == "causal":
        lengths = torch.arange(1, rows + 1, dtype=torch.int32, device="cuda")
    elif spec["lengths"] is not None:
        lengths = torch.randint(*spec["lengths"], (rows,), dtype=torch.int32, device="cuda")
    return logits, lengths


def _agrees(logits, lengths, indices, sorted_: bool) -> bool:
    """The selected values are torch.topk's of the masked rows (as a multiset; in order where sorted)."""
    import torch

    masked = logits if lengths is None else logits.masked_fill(
        torch.arange(logits.shape[1], device=logits.device) >= lengths[:, None], float("-inf"))
    expected = torch.topk(masked, K, dim=-1).values
    index = indices.long()
    got = torch.where(index >= 0, masked.gather(1, index.clamp(min=0)), float("-inf"))
    same = torch.equal(got.sort(dim=-1, descending=True).values, expected)
    return same and (not sorted_ or torch.equal(got, expected))


def _kernel_us(call, calls: int = 20) -> dict[str, float]:
    """GPU µs per call of each kernel ``call`` launches (torch.profiler; our kernels are named ``*_kernel``)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / calls for e in prof.key_averages() if e.key.endswith("_kernel")}


@contextlib.contextmanager
def _cell_call(tk, spec: dict):
    """The cell's call of ``tk.topk_indices`` on its inputs, with its module constants set until the block ends."""
    saved = {name: getattr(tk, name) for name in spec["constants"]}
    for name, value in spec["constants"].items():
        setattr(tk, name, value)
    logits, lengths = _inputs(spec)
    try:
        yield logits, lengths, lambda: tk.topk_indices(logits, K, lengths, None, "neg1", spec["sorted"],
                                                       **spec["keywords"])
    finally:
        for name, value in saved.items():  # (the next cell sees the module as it was)
            setattr(tk, name, value)


def worker(cells: list[str], kernels: bool, deadline: float | None = None) -> None:
    """Times every cell with the package first on the path (this process's copy), then with ``kernels`` profiles
    each (after every timing, so that none runs after the profiler), none after ``deadline``; prints one JSON
    line."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from timing import graph_us

    from nsa_inductor.lowering.topk_indices import triton as tk

    specs = {cell: parse_cell(cell) for cell in cells}
    names = _imported_names(tk)
    runnable = [cell for cell in cells if not _unknown(specs[cell], *names)]  # (others: a copy without what they name)
    results = {cell: None for cell in cells}
    failed = {}
    skipped = []
    for cell in runnable:
        if deadline is not None and time.time() > deadline:
            skipped.append(cell)
            continue
        try:
            with _cell_call(tk, specs[cell]) as (logits, lengths, call):
                results[cell] = [graph_us(call), _agrees(logits, lengths, call(), specs[cell]["sorted"]), {}]
        except Exception as error:  # (one cell's error, as a bad keyword value, leaves the others their timings)
            failed[cell] = f"{type(error).__name__}: {error}"[:300]
    for cell in [cell for cell in runnable if results[cell] is not None] if kernels else ():
        if deadline is not None and time.time() > deadline:
            break
        with _cell_call(tk, specs[cell]) as (_, _, call):
            results[cell][2] = _kernel_us(call)
    print("RESULT " + json.dumps({"package": tk.__file__, "cells": results, "failed": failed, "skipped": skipped}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pkg", action="append", default=[], metavar="NAME=DIR", help="a copy of the package")
    parser.add_argument("--cells", default=CELLS, help="comma-separated cells (see the module docstring)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kernels", action="store_true", help="also GPU µs per kernel of each cell")
    parser.add_argument("--deadline", type=float, default=None, help="Unix time after which nothing new starts")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cells = args.cells.split(",")
    if args.worker:
        return worker(cells, args.kernels, args.deadline)
    if not args.pkg:
        parser.error("give at least one --pkg NAME=DIR")
    copies = [spec.split("=", 1) for spec in args.pkg]
    check_cells(cells, [folder for _, folder in copies])
    times: dict[str, dict[str, list[str]]] = {cell: {} for cell in cells}
    for round_ in range(args.rounds):
        for name, folder in copies:
            if args.deadline is not None and time.time() > args.deadline:
                print(f"{name}: not started in round {round_ + 1} (deadline)")
                continue
            env = dict(os.environ, PYTHONPATH=os.path.abspath(folder))
            run = subprocess.run([sys.executable, __file__, "--worker", "--cells", args.cells]
                                 + ["--kernels"] * args.kernels
                                 + ["--deadline", str(args.deadline)] * (args.deadline is not None),
                                 env=env, capture_output=True, text=True)
            line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(f"{name}: failed\n{run.stderr[-3000:]}")
                continue
            result = json.loads(line[len("RESULT "):])
            if round_ == 0:
                print(f"{name}: {result['package']}")
                for cell, error in result["failed"].items():
                    print(f"{name} {cell} failed: {error}")
            for cell, timed in result["cells"].items():
                us, agrees, by_kernel = timed or (None, True, {})
                shown = ("failed" if cell in result["failed"] else "skipped" if cell in result["skipped"]
                         else "n/a" if us is None else f"{us:.1f}")
                times[cell].setdefault(name, []).append(shown + ("" if agrees else " !WRONG"))
                if by_kernel:
                    print(f"{name} {cell} kernels: " + ", ".join(
                        f"{kernel} {kernel_us:.1f}" for kernel, kernel_us in by_kernel.items()))
        _print_table(times, [name for name, _ in copies], f"after round {round_ + 1} of {args.rounds}")


def _print_table(times: dict[str, dict[str, list[str]]], names: list[str], title: str) -> None:
    """The cells' µs by copy, rounds separated by ``/`` (printed after every round: a run cut short keeps its
    table)."""
    print(f"{title}:\n| cell | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for cell, by_copy in times.items():
        print(f"| {cell} | " + " | ".join(" / ".join(by_copy.get(name, [])) for name in names) + " |")


if __name__ == "__main__":
    main()
