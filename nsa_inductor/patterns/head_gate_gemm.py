"""fp32 head-gate GEMM with casts -> one bf16-input GEMM with fp32 output (see ``search`` / ``replacement`` below).

Matches ``F.linear(x.float(), W32[, b32])`` / ``x.float() @ W32.t()`` (post-grad: ``mm``/``addmm`` of
``convert(x_bf16, f32)``, reshapes around for 3-D x) and ``F.linear(x, W16).float()``, where W is module state (a
frozen ``get_attr``, or a graph input AOTAutograd lists as static: parameters, buffers, static-address tensors).
Rewrites to ``nsa.head_gate_gemm(x_bf16, W, splits, mode == "round")`` split-K partials summed by pointwise adds
(Inductor fuses them into the scale chain after it). Mode "split" keeps W32 as bf16 hi + lo (~5e-6 relative
logits error); "round" uses bf16(W) (1.0e-3 to 1.7e-3, over DESIGN's contract); a bf16 W is used as is.
Fires only where the gates reach indexer logits (the rule for every numerics-changing pass, docs/passes/
head_gate_gemm.md): the output must flow into MQA logits that :func:`~.mqa.proofs.analyze` proves on this graph
(the logits passes run later and rewrite them), or into an ``nsa`` logits op.
Never (near misses): an activation weight; an fp32 result rounded to bf16/fp16/fp8 downstream (e.g. a Hadamard
rotation feeding act_quant, whose exact bytes matter more); a bf16 GEMM result also used in bf16; a GEMM whose
output reaches no indexer logits (a plain ``nn.Linear`` gate elsewhere in a model).
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import torch
import torch.fx
import torch.nn.functional as F

from .base import GraphPass, NearMiss, PassContext
from .fx_utils import as_int, describe, erase_dead, insert_call, is_op, is_store, sym_equal, tensor_val, view_chain
from .mqa import graph_cache_layout
from .mqa.proofs import analyze, cache_values, product_dots, reads_fp8
from .mqa.proofs import candidates as logits_candidates

aten = torch.ops.aten
prims = torch.ops.prims


def search(x: torch.Tensor, weight32: torch.Tensor, bias32: torch.Tensor | None = None) -> torch.Tensor:
    """The eager idioms: x bf16 activations, W32 an fp32 parameter (``x.float() @ W32.t()`` traces the same)..."""
    return F.linear(x.float(), weight32, bias32)


def search_bf16_weight(x: torch.Tensor, weight16: torch.Tensor) -> torch.Tensor:
    """... or a bf16 weight, the GEMM's result upcast."""
    return F.linear(x, weight16).float()


def replacement(x: torch.Tensor, weight: torch.Tensor, splits: int, mode: str) -> torch.Tensor:
    partials = torch.ops.nsa.head_gate_gemm(x.reshape(-1, x.shape[-1]), weight, splits, mode == "round")
    return sum(partials.unbind(0)).reshape(*x.shape[:-1], weight.shape[0])


_LOW_PRECISION = {torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2,
                  torch.float8_e5m2fnuz}
DOWNSTREAM_LIMIT = 20000
# Split-K of the op: one split per 1024 columns of K, at most 4 (the consumer kernel reads every partial; with the
# scale chain's own inputs it must stay under Inductor's default realize_acc_reads_threshold of 8 reads).
_K_PER_SPLIT = 1024
_MAX_SPLITS = 4


def static_inputs(graph: torch.fx.Graph) -> set[torch.fx.Node] | None:
    """Placeholders AOTAutograd marked static (parameters, buffers, static-address tensors); ``None`` if unknown."""
    from torch._guards import TracingContext

    tc = TracingContext.try_get()
    meta = getattr(tc, "fw_metadata", None) if tc is not None else None
    indices = getattr(meta, "static_input_indices", None)
    if indices is None:
        return None
    placeholders = list(graph.find_nodes(op="placeholder"))
    input_info = getattr(meta, "input_info", None)
    if input_info is not None and len(input_info) != len(placeholders):
        return None  # e.g. a backward graph: its placeholders are not the forward inputs
    found = set()
    for i in indices:
        if i >= len(placeholders):
            return None
        node = placeholders[i]
        desc = node.meta.get("desc")
        # the descriptor (torch >= 2.9) must agree with the position; a Param/Buffer descriptor is proof by itself
        kind = type(desc).__name__ if desc is not None else None
        if kind in ("ParamAOTInput", "BufferAOTInput"):
            found.add(node)
        elif kind == "PlainAOTInput" and getattr(desc, "idx", None) == i:
            found.add(node)
        elif desc is None:
            found.add(node)
    for node in placeholders:
        if type(node.meta.get("desc")).__name__ == "ParamAOTInput":
            found.add(node)
    return found


def _replay(graph: torch.fx.Graph, start: torch.fx.Node, views: list[torch.fx.Node]) -> torch.fx.Node:
    """Apply the same views (same size arguments) to ``start``."""
    for view in views:
        start = insert_call(graph, view.target, (start, *view.args[1:]), dict(view.kwargs))
    return start


def weight_rows(graph: torch.fx.Graph, b: torch.fx.Node, w: torch.fx.Node) -> torch.fx.Node:
    """The weight as ``[N, K]`` (the op's layout): ``w`` itself under ``b = permute(w)``, else a transposed view."""
    return w if b is not w else insert_call(graph, aten.permute.default, (w, [1, 0]))


def _rounded_downstream(node: torch.fx.Node) -> str | None:
    """Why ``node``'s fp32 value may reach a low-precision cast, or ``None`` once proven that it never does.

    Breadth first, so the nearest cast is found; a downstream graph too large to walk counts as "may".
    """
    seen, queue = {node}, collections.deque([node])
    while queue:
        for user in queue.popleft().users:
            if is_op(user, prims.convert_element_type.default) and user.args[1] in _LOW_PRECISION:
                return f"rounded to {user.args[1]} downstream by {describe(user)}"
            if is_store(user):  # (the store rounds its input to bf16 and fp8 itself)
                return f"quantized to fp8 downstream by {describe(user)}"
            if user not in seen:
                if len(seen) >= DOWNSTREAM_LIMIT:
                    return f"consumed by more than {DOWNSTREAM_LIMIT} nodes, not proven to stay fp32"
                seen.add(user)
                queue.append(user)
    return None


_LOGITS_OPS = ("nsa.paged_mqa_logits.default", "nsa.mqa_logits.default")


class IndexerLogits(NamedTuple):
    """The nodes holding indexer logits, and why a plain-torch logits idiom was not proven (the first reason; None
    where every candidate was), for the near miss of a gate that reaches none of them."""

    nodes: set[torch.fx.Node]
    unproven: str | None


def indexer_logits(graph: torch.fx.Graph, ctx: PassContext | None) -> IndexerLogits:
    """The nodes holding indexer logits: ``nsa`` logits ops, and the head sums of plain-torch MQA logits that
    :func:`~.mqa.proofs.analyze` proves (on the graph as it is, before the logits passes rewrite them) or that are
    masked with -inf (a head sum of dot products of fp8 values under a ``where(mask, ., -inf)``: the logits idiom,
    also where the proof needs the gate's scale chain folded first, as in a dynamic-shape prefill graph)."""
    found = {n for n in graph.nodes if n.op == "call_function" and str(n.target) in _LOGITS_OPS}
    if ctx is None:
        return IndexerLogits(found, None)
    leaves = cache_values(graph)
    try:
        layout = graph_cache_layout(leaves, ctx.decision)  # the logits passes' layout: the cache's own page size
    except NearMiss as e:
        return IndexerLogits(found, str(e))
    unproven = None
    for sum_node, where in logits_candidates(graph):
        if where is None:
            try:
                analyze(sum_node, where, layout, leaves)
            except NearMiss as e:
                unproven = unproven or str(e)
                continue
        elif not any(reads_fp8(dot) for dot in product_dots(sum_node)):
            unproven = unproven or f"the -inf-masked head sum {describe(sum_node)} has no dot of fp8 values"
            continue
        found.add(sum_node)
    return IndexerLogits(found, unproven)


def _reaches(node: torch.fx.Node, targets: IndexerLogits) -> bool:
    """Whether ``node``'s value flows into one of ``targets`` (breadth first, bounded like the rounding walk)."""
    seen, queue = {node}, collections.deque([node])
    while queue and len(seen) < DOWNSTREAM_LIMIT:
        for user in queue.popleft().users:
            if user in targets.nodes:
                return True
            if user not in seen:
                seen.add(user)
                queue.append(user)
    return False


def _check_reaches_logits(out: torch.fx.Node, logits: IndexerLogits) -> None:
    if not _reaches(out, logits):
        why = f" (a plain-torch logits idiom was not proven: {logits.unproven})" if logits.unproven else ""
        raise NearMiss(f"the GEMM output {describe(out)} reaches no indexer logits (MQA logits idiom or nsa logits "
                       f"op): a GEMM outside the indexer keeps its exact numerics{why}")


def transposed_weight(b: torch.fx.Node) -> torch.fx.Node | None:
    """``W`` for ``b = permute(W, [1, 0])`` / ``t(W)`` (``F.linear``, ``x @ W.t()``) or ``b = W`` (``x @ W``), 2-D."""
    if is_op(b, aten.permute.default) and list(b.args[1]) in ([1, 0], [-1, -2], [1, -2], [-1, 0]):
        w = b.args[0]
    elif is_op(b, aten.t.default):
        w = b.args[0]
    elif isinstance(b, torch.fx.Node) and b.op in ("placeholder", "get_attr"):
        w = b
    else:
        return None
    tw = tensor_val(w)
    return w if tw is not None and tw.dim() == 2 else None


def _upcast_gemm_parts(mm: torch.fx.Node) -> tuple | None:
    """``(x, views, a, b)`` of ``mm(views(convert(x_bf16, f32)), b)`` (or addmm); ``None``: not this idiom."""
    a, b = (mm.args[1], mm.args[2]) if is_op(mm, aten.addmm.default) else (mm.args[0], mm.args[1])
    ta, tm = tensor_val(a), tensor_val(mm)
    if ta is None or tm is None or ta.dtype != torch.float32:
        return None
    root, views = view_chain(a)
    if not is_op(root, prims.convert_element_type.default):
        return None  # an fp32 GEMM of fp32 activations: nothing to do
    return root.args[0], views, a, b


def _gemm_then_upcast_parts(cvt: torch.fx.Node) -> tuple | None:
    """``(mm, views, w)`` of ``convert(views(mm(x_bf16, W16^T)), f32)``; ``None``: not this idiom."""
    ts = tensor_val(cvt.args[0])
    if ts is None or ts.dtype != torch.bfloat16:
        return None
    mm, views = view_chain(cvt.args[0])
    if not is_op(mm, aten.mm.default):
        return None
    a, b = mm.args
    ta = tensor_val(a)
    w = transposed_weight(b)
    if w is None or ta is None or ta.dtype != torch.bfloat16:
        return None  # a bf16 product of activations, not a linear layer
    return mm, views, w


def check_parameter_weight(w: torch.fx.Node, dtype: torch.dtype, static: set[torch.fx.Node] | None) -> None:
    tw = tensor_val(w)
    if tw.dtype != dtype:
        raise NearMiss(f"weight {describe(w)} is {tw.dtype} {list(tw.shape)}, not {dtype}")
    if w.op == "get_attr":
        return
    if w.op != "placeholder":
        raise NearMiss(f"weight {describe(w)} is computed in the graph, not a parameter")
    if static is None:
        raise NearMiss(f"weight {describe(w)}: no AOTAutograd metadata says whether this graph input is a parameter")
    if w not in static:
        raise NearMiss(f"weight {describe(w)} is a non-parameter graph input (an activation); rounding it is not "
                       "allowed")


def _split_k_gemm(graph: torch.fx.Graph, x: torch.fx.Node, w_rows: torch.fx.Node, round_weight: bool,
                  k: int) -> torch.fx.Node:
    """``x [M, K] bf16 @ w_rows [N, K]^T`` in fp32: ``nsa.head_gate_gemm``'s partials summed by pointwise adds
    (not a reduction: Inductor fuses the adds into the consumer kernel instead of launching one of its own)."""
    splits = max(1, min(_MAX_SPLITS, k // _K_PER_SPLIT))
    partials = insert_call(graph, torch.ops.nsa.head_gate_gemm.default, (x, w_rows, splits, round_weight))
    return sum_partials(graph, partials, splits)


def sum_partials(graph: torch.fx.Graph, partials: torch.fx.Node, splits: int) -> torch.fx.Node:
    """``partials[0] + partials[1] + ...`` of split-K partials ``[splits, M, N]``, left to right, as pointwise adds."""
    total = insert_call(graph, aten.select.int, (partials, 0, 0))
    for s in range(1, splits):
        total = insert_call(graph, aten.add.Tensor, (total, insert_call(graph, aten.select.int, (partials, 0, s))))
    return total


class HeadGateGemm(GraphPass):
    """``mode="split"`` (default): W32 = W_hi + W_lo, both bf16, split in the kernel. ``mode="round"``: bf16(W)."""

    name = "head_gate_gemm"
    MODES = ("split", "round")

    def __init__(self, mode: str = "split"):
        if mode not in self.MODES:
            raise ValueError(f"head_gate_gemm mode must be 'split' or 'round', got {mode!r}")
        self.mode = mode

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext | None):
        static = static_inputs(graph)
        logits = None  # proven on the first GEMM candidate: most graphs have none
        for node in list(graph.nodes):
            if getattr(node, "_erased", False) or node.graph is not graph:
                continue
            if is_op(node, aten.mm.default, aten.addmm.default):
                parts = _upcast_gemm_parts(node)
            elif is_op(node, prims.convert_element_type.default) and node.args[1] == torch.float32:
                parts = _gemm_then_upcast_parts(node)
            else:
                continue
            if parts is not None:
                logits = indexer_logits(graph, ctx) if logits is None else logits
                yield node, parts, static, logits

    def anchor(self, candidate: tuple) -> torch.fx.Node:
        return candidate[0]

    def rewrite(self, graph: torch.fx.Graph, candidate: tuple, ctx: PassContext | None) -> None:
        node, parts, static, logits = candidate
        if is_op(node, aten.mm.default, aten.addmm.default):
            self._upcast_gemm(graph, node, *parts, static, logits)
        else:
            self._gemm_then_upcast(graph, node, *parts, static, logits)

    def _upcast_gemm(self, graph: torch.fx.Graph, mm: torch.fx.Node, x: torch.fx.Node, views: list, a, b,
                     static: set[torch.fx.Node] | None, logits: IndexerLogits) -> None:
        """``mm(convert(x_bf16, f32), W32^T)`` (or addmm)."""
        is_addmm = is_op(mm, aten.addmm.default)
        ta, tx = tensor_val(a), tensor_val(x)
        w = transposed_weight(b)
        if w is None:
            raise NearMiss(f"GEMM of an upcast activation whose second operand {describe(b)} is computed, not a 2-D "
                           "weight")
        if tx is None or tx.dtype != torch.bfloat16:
            raise NearMiss(f"activation {describe(x)} is {tx.dtype if tx is not None else None} before the upcast, "
                           "not bfloat16")
        check_parameter_weight(w, torch.float32, static)
        tw, tb = tensor_val(w), tensor_val(b)
        if tb is None or tb.dim() != 2 or not sym_equal(ta.shape[1], tb.shape[0]):
            raise NearMiss(f"K dimension mismatch: activation {list(ta.shape)} vs weight operand {list(tw.shape)}")
        if is_addmm and (mm.kwargs.get("beta", 1) != 1 or mm.kwargs.get("alpha", 1) != 1):
            raise NearMiss(f"addmm with beta={mm.kwargs.get('beta', 1)} alpha={mm.kwargs.get('alpha', 1)}")
        if is_addmm and (tensor_val(mm.args[0]) is None or tensor_val(mm.args[0]).dtype != torch.float32):
            raise NearMiss(f"addmm bias {describe(mm.args[0])} is not fp32")
        rounded = _rounded_downstream(mm)
        if rounded is not None:
            raise NearMiss(f"the fp32 GEMM output is {rounded} (e.g. a Hadamard rotation feeding act_quant): keeping "
                           "the exact fp32 GEMM")
        _check_reaches_logits(mm, logits)
        k = as_int(tb.shape[0])
        if k is None:
            raise NearMiss(f"weight {describe(w)} has a symbolic input size {tb.shape[0]}")
        with graph.inserting_before(mm):
            x_2d = _replay(graph, x, views)
            new = _split_k_gemm(graph, x_2d, weight_rows(graph, b, w), self.mode == "round", k)
            if is_addmm:
                new = insert_call(graph, aten.add.Tensor, (new, mm.args[0]))
        mm.replace_all_uses_with(new)
        erase_dead(graph, [mm])

    def _gemm_then_upcast(self, graph: torch.fx.Graph, cvt: torch.fx.Node, mm: torch.fx.Node, views: list,
                          w: torch.fx.Node, static: set[torch.fx.Node] | None, logits: IndexerLogits) -> None:
        """``convert(mm(x_bf16, W16^T), f32)``, possibly with reshapes between the mm and the convert."""
        a, b = mm.args
        check_parameter_weight(w, torch.bfloat16, static)
        for node in [mm, *views]:
            if len(node.users) != 1:
                raise NearMiss(f"the bf16 GEMM result {describe(node)} is also used in bf16; rewriting would run "
                               "the GEMM twice")
        rounded = _rounded_downstream(cvt)
        if rounded is not None:
            raise NearMiss(f"the fp32 result is {rounded}: keeping the eager bf16 GEMM")
        _check_reaches_logits(cvt, logits)
        k = as_int(tensor_val(a).shape[1])
        if k is None:
            raise NearMiss(f"weight {describe(w)} has a symbolic input size {tensor_val(a).shape[1]}")
        with graph.inserting_before(cvt):
            new = _replay(graph, _split_k_gemm(graph, a, weight_rows(graph, b, w), False, k), views)
        cvt.replace_all_uses_with(new)
        erase_dead(graph, [cvt])
