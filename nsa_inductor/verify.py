"""``nsa.verify``: on its first calls, a compiled graph is checked against the same graph run without any rewrite.

Why: the passes prove their idioms on sampled elements and shapes; a user who doubts a rewrite on their model should
get a loud, specific answer on real inputs rather than silently different numbers. The reference is the graph as
Dynamo captured it, run op by op (eager semantics), on clones of the inputs; the compiled graph runs on the real
ones. Compared, per docs/numerics.md's contract:

- every tensor input: no element changes where the reference left it unchanged (nothing written outside what eager
  writes); where it changed, uint8 inputs (the K cache) match byte for byte, or, when a pass that reorders sums
  fired, K caches of the compile's layout keep :mod:`.cache_difference`'s bound on their decoded values and scales
  (no slot written that the reference left unchanged); float inputs as float outputs;
- where K values moved within that bound and the outputs read them back from the cache (they differ when the
  reference runs again on the compiled step's cache, its writes into it skipped), the outputs are compared with that
  second run, under the rules below at their own tolerances: a moved key's logits then keep ``LOGITS_RTOL`` of what
  the unrewritten graph computes from those bytes, at any number of tokens;
- float outputs: the same NaN and ±inf positions, and a norm-wise relative error of at most ``LOGITS_RTOL`` over the
  finite entries, or :func:`.cache_difference.logits_rtol` where K values moved and the outputs do not read them
  back; the logits ``topk`` reads then keep ``LOGITS_RTOL`` outside the columns of as many keys as moved;
- top-k index outputs (an output computed from ``topk``'s indices): no column twice in a row; where the output holds
  the columns (through masking, casts and views, or shifted by one offset a row, which the reference run shows and
  verify adds back; ``-1`` entries are fills only where a mask lies on the way), the same number of ``-1`` entries per
  row, and every column that differs from the reference's a near tie of the row's k-th value in the logits ``topk``
  read: the compiled graph's where they are an output too (within ``TOPK_TIE_RTOL`` of the row's largest finite
  magnitude), else the reference's (within ``MOVED_KEYS_LOGITS_RTOL`` of it where K values moved, as a moved key's
  logits may); else (NaN in the row, or another shift) the same set per row, except that up to ``TOPK_ROW_FRACTION``
  of a row's entries (at least one) may differ; other outputs: equal.

A mismatch raises :class:`VerifyError` naming the graph, the passes that fired and the first differing elements.
Costs, on the verified calls only: the graph runs twice (three times where K moved), and every tensor input is
cloned twice (three times where K moved; the K cache included).
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from typing import Any, Callable, NamedTuple

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from .cache_difference import MOVED_KEYS_LOGITS_RTOL, as_rows, changed_slots, error_outside_moved_keys, \
    k_cache_problems, logits_rtol
from .capability import LayoutDecision, cache_layout, capability
from .layout import TOKEN_BYTES, KCacheLayout

LOGITS_RTOL = 1e-3
TOPK_ROW_FRACTION = 1e-2
TOPK_TIE_RTOL = 1e-3  # keys this close to the k-th value (relative to the row's largest) may swap places
# ops between ``topk`` and an output that keep its indices' values (masking writes -1, not other columns) ...
_COLUMN_PATH_OPS = {"where", "masked_fill", "masked_fill_", "to", "int", "long", "view", "reshape", "clone",
                    "contiguous", "getitem", "getattr", "_to_copy", "type"}
# ... and those that shift them (a prefill's per-row offset); of the first, those that write -1 entries
_TOPK_PATH_OPS = _COLUMN_PATH_OPS | {"add", "sub"}
_MASK_OPS = {"where", "masked_fill", "masked_fill_"}


class VerifyError(AssertionError):
    """The compiled graph and the unrewritten graph disagree beyond the documented tolerances."""


def reference_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of Dynamo's graph (sharing its parameters) that compiling ``gm`` cannot change."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def verified(compiled: Callable, reference: torch.fx.GraphModule, calls: int, report: dict[str, Any] | None,
             cache_bytes_passes: set[str], decision: LayoutDecision) -> Callable:
    """``compiled`` checked against ``reference`` on its first ``calls`` calls (same calling convention);
    ``cache_bytes_passes``: the passes whose firing allows cache bytes within the contract; ``decision``: the
    compile's K-cache layout, by which uint8 inputs shaped as caches are decoded."""
    fired = [f"{p['name']} x{p['matched']}" for p in (report or {}).get("passes") or [] if p["matched"]]
    relaxed = any(p["name"] in cache_bytes_passes and p["matched"] for p in (report or {}).get("passes") or [])
    graph_name = (report or {}).get("graph", "?")
    topk_outputs = _topk_outputs(reference)
    outputs = tree_flatten(next(n for n in reference.graph.nodes if n.op == "output").args[0])[0]
    logits_outputs = {outputs.index(source) for path in topk_outputs.values() if path is not None
                      for source in [_topk_source(path.topk)] if source in outputs}
    input_names = [n.name for n in reference.graph.find_nodes(op="placeholder")]
    fp8_dtype = _fp8_dtype(reference)
    left = [calls]

    def run(*args: Any) -> Any:  # Dynamo calls a backend's result with the graph's inputs as arguments
        if left[0] <= 0:
            return compiled(*args)
        left[0] -= 1
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        recorder = _TopkRun(reference, {path.topk for path in topk_outputs.values() if path is not None})
        expected = recorder.run(*ref_args)
        got = compiled(*args)
        problems, moved, moved_caches = [], [], set()
        for i, (name, old, want, new) in enumerate(zip(input_names, before, ref_args, args)):
            layout = _cache_layout(old, decision) if relaxed and isinstance(old, torch.Tensor) else None
            if layout is not None:
                cache_problems, diff = _compare_cache(f"input {name}", layout, fp8_dtype, old, want, new)
                problems, moved = problems + cache_problems, moved + [diff]
                if diff and diff["tokens_moved"]:
                    moved_caches.add(i)
            elif isinstance(old, torch.Tensor):
                problems += _compare_input(name, old, want, new)
        rtol = max([logits_rtol(LOGITS_RTOL, diff) for diff in moved], default=LOGITS_RTOL)
        keys_moved = sum(diff["tokens_moved"] for diff in moved if diff)
        reference_name = "the unrewritten graph"
        if moved_caches and not problems:
            # K moved within its bound: where the outputs read it back, the reference reads the compiled step's K
            # and needs no allowance (which, norm-wise, cannot bound a one-token step's single logit)
            own_k = _CacheReadingRun(reference, recorder.nodes, moved_caches)
            on_own_k = own_k.run(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
            if not _same_outputs(on_own_k, expected):
                expected, recorder, rtol, keys_moved = on_own_k, own_k, LOGITS_RTOL, 0
                reference_name += " reading the compiled step's K cache"
        got_flat, _ = tree_flatten(got)
        want_flat, _ = tree_flatten(expected)
        topk_checks = {i: _topk_check(path, outputs, got_flat, want_flat[i], recorder, rtol > LOGITS_RTOL)
                       for i, path in topk_outputs.items()} if len(got_flat) == len(want_flat) else {}
        problems = _compare_outputs(expected, got, topk_checks, rtol, logits_outputs, keys_moved) + problems
        if problems:
            raise VerifyError(f"nsa.verify: compiled graph {graph_name} differs from {reference_name}: "
                              f"{'; '.join(problems[:4])}. Passes that fired: {', '.join(fired) or 'none'}. "
                              f"nsa.disable_passes=[...] with those names finds the pass; please report it.")
        return got

    return run


class _TopkPath(NamedTuple):
    """How an output is computed from a ``topk`` call's indices: whether an offset was added or subtracted on the
    way, and whether a mask wrote ``-1`` entries (``where``, ``masked_fill``)."""

    topk: torch.fx.Node
    shifted: bool
    masked: bool


def _topk_outputs(gm: torch.fx.GraphModule) -> dict[int, _TopkPath | None]:
    """The flat outputs computed from ``topk``'s indices (through masking, casts, views and offsets), by position:
    their path from ``topk`` where it takes the largest along the last dimension, else None."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    flat, _ = tree_flatten(output.args[0])
    found: dict[int, _TopkPath | None] = {}
    for i, node in enumerate(flat):
        frontier, seen = [(node, False, False)], set()
        while frontier:
            cur, shifted, masked = frontier.pop()
            if not isinstance(cur, torch.fx.Node) or cur in seen:
                continue
            seen.add(cur)
            name = _op_name(cur)
            if name == "topk":
                found[i] = _TopkPath(cur, shifted, masked) if _largest_along_last(cur) else None
                break
            if cur.op in ("call_function", "call_method") and name in _TOPK_PATH_OPS:
                frontier += [(a, shifted or name not in _COLUMN_PATH_OPS, masked or name in _MASK_OPS)
                             for a in cur.args if isinstance(a, torch.fx.Node)]
    return found


def _op_name(node: torch.fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def _topk_source(topk: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose values a ``topk`` call ranks."""
    return topk.args[0] if topk.args else topk.kwargs.get("input")


def _largest_along_last(topk: torch.fx.Node) -> bool:
    """Whether a ``topk`` call (``torch.topk(x, k, dim, largest, ...)`` or ``x.topk(...)``) keeps the largest values
    along the last dimension of ``x``."""
    params = dict(zip(("input", "k", "dim", "largest"), topk.args)) | topk.kwargs
    source = _topk_source(topk)
    rank = getattr(source.meta.get("example_value"), "ndim", None) if isinstance(source, torch.fx.Node) else None
    dim = params.get("dim", -1)
    return params.get("largest", True) is True and isinstance(dim, int) and rank is not None and dim in (-1, rank - 1)


class _TopkCheck(NamedTuple):
    """How a top-k output is compared: the logits its ``topk`` read, the tolerance of a near tie, the amount each
    row was shifted by from ``topk``'s indices (None: not shifted) and whether its ``-1`` entries are a mask's."""

    logits: torch.Tensor
    tie_rtol: float
    shift: torch.Tensor | None
    fills: bool


def _topk_check(path: _TopkPath | None, outputs: list, got: list, want: Any, recorder: _TopkRun,
                keys_moved: bool) -> _TopkCheck | None:
    """The logits a top-k output's columns are checked against: the compiled graph's where ``topk``'s source is an
    output too, else the reference run's, whose logits differ from the compiled ones by a moved key's share where
    ``keys_moved``; for an output shifted by an offset, the reference's shift per row. None: compared as sets."""
    if path is None:
        return None
    shift = None
    if path.shifted:
        shift = _row_shift(want, recorder.indices[path.topk], path.masked) if isinstance(want, torch.Tensor) else None
        if shift is None:
            return None
    source = _topk_source(path.topk)
    compiled_logits = got[outputs.index(source)] if source in outputs else None
    if isinstance(compiled_logits, torch.Tensor):  # (else that output's own error)
        return _TopkCheck(compiled_logits, TOPK_TIE_RTOL, shift, path.masked)
    return _TopkCheck(recorder.inputs[path.topk], MOVED_KEYS_LOGITS_RTOL if keys_moved else TOPK_TIE_RTOL, shift,
                      path.masked)


def _row_shift(output: torch.Tensor, indices: torch.Tensor, fills: bool = True) -> torch.Tensor | None:
    """``indices - output`` per row of a top-k output, over its entries other than ``-1`` where those are a mask's
    (``fills``; 0 where all are), or None where that is not one number a row (the output is not ``topk``'s indices
    shifted by a per-row offset)."""
    if output.shape != indices.shape or output.dim() == 0 or output.shape[-1] == 0:
        return None
    out, idx = as_rows(output).long(), as_rows(indices).long()
    kept = out != -1 if fills else torch.ones_like(out, dtype=torch.bool)
    diff = idx - out
    lowest = diff.masked_fill(~kept, torch.iinfo(torch.int64).max).amin(-1)
    highest = diff.masked_fill(~kept, torch.iinfo(torch.int64).min).amax(-1)
    rows = kept.any(-1)
    if not torch.equal(lowest[rows], highest[rows]):
        return None
    return torch.where(rows, lowest, 0)


def _unshifted(output: torch.Tensor, shift: torch.Tensor, fills: bool = True) -> torch.Tensor:
    """A shifted top-k output's columns (its ``-1`` entries kept where they are a mask's: ``fills``)."""
    rows = as_rows(output).long()
    columns = rows + shift.to(rows.device)[:, None]
    return (torch.where(rows != -1, columns, -1) if fills else columns).reshape(output.shape)


class _TopkRun(torch.fx.Interpreter):
    """Runs the reference graph and keeps, for each of ``nodes`` (``topk`` calls), the tensor it reads and the
    indices it returns."""

    def __init__(self, gm: torch.fx.GraphModule, nodes: set[torch.fx.Node]):
        super().__init__(gm)
        self.nodes, self.inputs, self.indices = nodes, {}, {}

    def run_node(self, n: torch.fx.Node) -> Any:
        if n in self.nodes:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            self.inputs[n] = args[0] if args else kwargs.get("input")
        result = super().run_node(n)
        if n in self.nodes:
            self.indices[n] = result[1]
        return result


class _CacheReadingRun(_TopkRun):
    """The reference run skipping the in-place writes into its inputs at ``caches`` (positions): on clones of the
    inputs as the compiled graph left them, the unrewritten graph's q, gates and sums with the compiled step's K,
    wherever the graph reads its keys back from the cache."""

    def __init__(self, gm: torch.fx.GraphModule, nodes: set[torch.fx.Node], caches: set[int]):
        super().__init__(gm, nodes)
        self.caches, self.storages = caches, set()

    def run(self, *args: Any) -> Any:
        self.storages = {args[i].untyped_storage().data_ptr() for i in self.caches}
        return super().run(*args)

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op in ("call_function", "call_method") and (n.target is operator.setitem
                                                         or _op_name(n).split(".")[0].endswith("_")):
            args, _ = self.fetch_args_kwargs_from_env(n)
            target = args[0] if args else None
            if isinstance(target, torch.Tensor) and target.untyped_storage().data_ptr() in self.storages:
                return None if n.target is operator.setitem else target
        return super().run_node(n)


def _compare_outputs(expected: Any, got: Any, topk_checks: dict[int, _TopkCheck | None],
                     rtol: float = LOGITS_RTOL, logits_outputs: set[int] = frozenset(), keys_moved: int = 0
                     ) -> list[str]:
    """``topk_checks``: the top-k index outputs by position, each with how it is compared (None: as sets);
    ``rtol``: float outputs' tolerance; ``logits_outputs``: the positions of ``topk``'s sources, which keep
    ``LOGITS_RTOL`` outside the columns of the ``keys_moved`` keys whose K moved."""
    want, _ = tree_flatten(expected)
    have, _ = tree_flatten(got)
    if len(want) != len(have):
        return [f"{len(have)} outputs, the unrewritten graph has {len(want)}"]
    problems = []
    for i, (w, h) in enumerate(zip(want, have)):
        what = f"output {i}"
        if not isinstance(w, torch.Tensor):
            if w != h:
                problems.append(f"{what} is {h!r}, expected {w!r}")
        elif not isinstance(h, torch.Tensor) or h.shape != w.shape or h.dtype != w.dtype:
            problems.append(f"{what} is {_describe(h)}, expected {_describe(w)}")
        elif w.is_floating_point():
            problems += _compare_float(what, w, h, rtol) or \
                (_compare_outside_moved_keys(what, w, h, keys_moved) if i in logits_outputs else [])
        elif i in topk_checks and w.dim() >= 1:
            check = topk_checks[i]
            if check is None:
                problems += _compare_topk(what, w, h)
                continue
            if check.shift is not None:  # compared as the columns they were shifted from
                w, h = _unshifted(w, check.shift, check.fills), _unshifted(h, check.shift, check.fills)
            problems += _compare_topk(what, w, h, check.logits, check.tie_rtol)
        elif not torch.equal(w, h):
            problems.append(_first_difference(what, w, h))
    return problems


def _cache_layout(t: torch.Tensor, decision: LayoutDecision) -> KCacheLayout | None:
    """The layout of a uint8 input shaped as K caches (``[..., P * 132]``, contiguous) under ``decision``, else None."""
    if t.dtype != torch.uint8 or t.dim() < 2 or t.shape[-1] % TOKEN_BYTES or not t.is_contiguous():
        return None
    try:
        return cache_layout(decision, (t.numel() // t.shape[-1], t.shape[-1]))
    except ValueError:
        return None


def _fp8_dtype(gm: torch.fx.GraphModule) -> torch.dtype:
    """The fp8 format the graph computes in (its K cache's), else this machine's."""
    found = {v.dtype for n in gm.graph.nodes for v in [n.meta.get("example_value", n.meta.get("val"))]
             if isinstance(v, torch.Tensor) and v.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)}
    return found.pop() if len(found) == 1 else capability().fp8_dtype


def _compare_input(name: str, old: torch.Tensor, want: torch.Tensor, new: torch.Tensor) -> list[str]:
    """Graph input ``name`` after the call: unchanged where the reference left it unchanged, equal where it wrote."""
    what = f"input {name}"
    written = ~_same(old, want)
    outside = written.logical_not() & ~_same(old, new)
    if outside.any():
        index = tuple(int(c) for c in outside.nonzero()[0])
        return [f"{what} changed at {int(outside.sum())} element(s) the unrewritten graph left unchanged, first at "
                f"{list(index)}: {_item(old, index)} -> {_item(new, index)}"]
    if not written.any() or torch.equal(want, new):
        return []
    if old.dtype == torch.uint8:
        differ = ~_same(want, new)
        index = tuple(int(c) for c in differ.nonzero()[0])
        return [f"{what} (uint8) differs in {int(differ.sum())} of the {int(written.sum())} bytes written, first at "
                f"{list(index)}: {_item(new, index)}, expected {_item(want, index)}"]
    if old.is_floating_point():
        return _compare_float(what, want, new)
    return [_first_difference(what, want, new)]


def _compare_cache(what: str, layout: KCacheLayout, fp8_dtype: torch.dtype, old: torch.Tensor, want: torch.Tensor,
                   new: torch.Tensor) -> tuple[list[str], dict[str, float | int] | None]:
    """A K cache where sums may be reordered: the slots the compiled graph changed are among those the reference
    wrote, which keep the bound of :func:`.cache_difference.k_cache_problems`; and their difference (None: the
    compiled graph wrote outside them)."""
    slots, changed = changed_slots(layout, old, want), changed_slots(layout, old, new)
    outside = changed[~torch.isin(changed, slots)]
    if outside.numel():
        return [f"{what} changed {outside.numel()} slot(s) of layout {layout} the unrewritten graph left unchanged, "
                f"first slot {int(outside[0])}"], None
    problems, diff = k_cache_problems(layout, *(c.view(-1, old.shape[-1]) for c in (want, new)), slots, fp8_dtype)
    return [f"{what} (K cache, {layout}): {problem}" for problem in problems], diff


def _compare_float(what: str, want: torch.Tensor, have: torch.Tensor, rtol: float = LOGITS_RTOL) -> list[str]:
    """Identical NaN and +-inf positions, then the norm-wise error over the finite entries."""
    for name, mask in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        if not torch.equal(mask(want), mask(have)):
            index = tuple(int(c) for c in (mask(want) != mask(have)).nonzero()[0])
            return [f"{what}: {name} positions differ, first at {list(index)}: {_item(have, index)}, expected "
                    f"{_item(want, index)}"]
    finite = torch.isfinite(want)
    ref, got = want[finite].double(), have[finite].double()
    err = ((ref - got).norm() / ref.norm().clamp(min=1e-30)).item() if ref.numel() else 0.0
    if err > rtol:
        largest = (want.double() - have.double()).abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).argmax()
        index = tuple(int(c) for c in torch.unravel_index(largest, want.shape))
        return [f"{what}: relative error {err:.2e} over the finite entries (allowed {rtol:.3g}), largest at "
                f"{list(index)}: {_item(have, index)}, expected {_item(want, index)}"]
    return []


def _compare_outside_moved_keys(what: str, want: torch.Tensor, have: torch.Tensor, keys_moved: int) -> list[str]:
    """Logits (keys along the last dimension) of a step whose K moved in ``keys_moved`` keys: the error beyond
    ``LOGITS_RTOL`` lies in those keys' columns."""
    if not keys_moved or want.dim() == 0:
        return []
    error = error_outside_moved_keys(want, have, keys_moved)
    if error <= LOGITS_RTOL:
        return []
    return [f"{what}: relative error {error:.2e} outside the {keys_moved} key column(s) where it is largest (allowed "
            f"{LOGITS_RTOL:g}; {keys_moved} key(s) moved in the K cache, each moving one column)"]


def _compare_topk(what: str, want: torch.Tensor, have: torch.Tensor, logits: torch.Tensor | None = None,
                  tie_rtol: float = TOPK_TIE_RTOL) -> list[str]:
    rows_w, rows_h = as_rows(want).tolist(), as_rows(have).tolist()
    rows_l = None
    if logits is not None and logits.dim() >= 1 and logits.numel() // max(logits.shape[-1], 1) == len(rows_w):
        rows_l = as_rows(logits.detach()).double().cpu()
    k = want.shape[-1]
    allowed = max(1, math.floor(TOPK_ROW_FRACTION * k))
    for r, (w_row, h_row) in enumerate(zip(rows_w, rows_h)):
        w, h = Counter(w_row), Counter(h_row)
        repeated = sorted(c for c, n in h.items() if n > max(w[c], 1) and c >= 0)  # (a fill the reference repeats)
        if repeated:
            return [f"{what}: row {r} repeats column(s) {repeated[:4]}"]
        if rows_l is not None and not rows_l[r].isnan().any():
            problem = _near_ties(what, r, rows_l[r], w_row, h_row, tie_rtol)
            if problem:
                return [problem]
            continue
        missing = sum((w - h).values())  # multisets: the -1 padding repeats
        if missing > allowed:
            return [f"{what}: row {r} misses {missing} of its {k} top-k entries (allowed {allowed}), e.g. "
                    f"{sorted((w - h).elements())[:4]}, and has {sorted((h - w).elements())[:4]} instead"]
    return []


def _near_ties(what: str, r: int, logits: torch.Tensor, want: list[int], have: list[int], tie_rtol: float
               ) -> str | None:
    """Row ``r`` of a top-k output against the reference's: the same count of -1 entries, columns in range, and
    each column in one of the two and not the other within ``tie_rtol`` (of the row's largest finite magnitude) of
    the row's k-th value in ``logits``."""
    w_cols, h_cols = [c for c in want if c >= 0], [c for c in have if c >= 0]
    if len(h_cols) != len(w_cols):
        return f"{what}: row {r} has {len(h_cols)} columns (the rest -1), expected {len(w_cols)}"
    if any(c >= len(logits) for c in h_cols):
        return f"{what}: row {r} has a column past the {len(logits)} logits"
    added, dropped = sorted(set(h_cols) - set(w_cols)), sorted(set(w_cols) - set(h_cols))
    if not added:
        return None
    kth = float(logits.topk(len(w_cols)).values[-1])
    finite = logits[logits.isfinite()]
    tol = tie_rtol * float(finite.abs().max()) if finite.numel() else 0.0
    far = [c for c in added if logits[c] < kth - tol] + [c for c in dropped if logits[c] > kth + tol]
    if not far:
        return None
    return (f"{what}: row {r} has column(s) {added[:4]} (logits {[float(logits[c]) for c in added[:4]]}) in place "
            f"of {dropped[:4]} (logits {[float(logits[c]) for c in dropped[:4]]}): not near ties of the k-th value "
            f"{kth:.6g} (within {tol:.3g})")


def _same_outputs(a: Any, b: Any) -> bool:
    """Two runs' outputs are equal element for element (NaN equal to NaN)."""
    a, b = tree_flatten(a)[0], tree_flatten(b)[0]
    return len(a) == len(b) and all(
        x.shape == y.shape and bool(_same(x, y).all()) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        else x == y for x, y in zip(a, b))


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    equal = a == b
    return equal | (a.isnan() & b.isnan()) if a.is_floating_point() else equal


def _first_difference(what: str, want: torch.Tensor, have: torch.Tensor) -> str:
    differ = ~_same(want, have)
    index = tuple(int(c) for c in differ.nonzero()[0])
    return f"{what} differs in {int(differ.sum())} element(s), first at {list(index)}: {_item(have, index)}, " \
           f"expected {_item(want, index)}"


def _item(t: torch.Tensor, index: tuple[int, ...]) -> Any:
    return t[index].item()


def _describe(x: Any) -> str:
    return f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)
