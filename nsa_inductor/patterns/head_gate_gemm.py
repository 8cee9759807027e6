"""fp32 head-gate GEMM with casts -> one bf16-input GEMM with fp32 output.

Eager spellings (post-grad form after the arrow)::

    F.linear(x.float(), W32)            -> mm(convert(x_bf16, f32), permute(W32, [1, 0]))   (reshapes around for 3-D x)
    x.to(torch.float32) @ W32.t()       -> the same
    F.linear(x.float(), W32, b32)       -> addmm(b32, convert(x_bf16, f32), permute(W32, [1, 0]))
    F.linear(x, W16).float()            -> convert(mm(x_bf16, permute(W16, [1, 0])), f32)

Rewrite: ``p = nsa.head_gate_gemm(x_bf16, W, splits, mode == "round")``, split-K partial products
``[splits, M, N]`` (bf16 inputs, fp32 accumulation; no cast kernel of x), then ``p[0] + p[1] + ...`` as explicit
pointwise adds, which Inductor fuses into the scale chain's kernel after the GEMM. For an fp32 weight the default mode
"split" multiplies by ``hi + lo`` with ``hi`` = W with its low 16 bits cleared and ``lo = bf16(W - hi)``: about 16
significant bits of W, ~5e-6 relative logits error. The split happens in the op's Triton kernel, in registers, as it
reads W: one launch per call, where a split kernel in the graph plus cuBLAS's split-K GEMM (GEMM and reduction) took
three. Mode "round" (``HeadGateGemm("round")``) uses ``bf16(W)``: 1.0e-3 to 1.7e-3 relative logits error, over
DESIGN's contract (see README). A bf16 weight (``F.linear(x, W16).float()``) is used as is. ``splits`` comes from
the static K alone, at most 4, so that the consumer kernel reading every partial stays under Inductor's
``realize_acc_reads_threshold`` (8 reads). On CPU the op runs its torch reference (the same products in fp32).

The weight ``W`` must be module state: a ``get_attr`` constant (frozen), or a graph input that AOTAutograd lists as
a static input (``TracingContext.fw_metadata.static_input_indices``: parameters, buffers, ``mark_static_address``
tensors; Dynamo does not tell parameters from buffers at this stage).
An activation weight is never rounded. The fp32 result must not be rounded to bf16/fp16/fp8 downstream: there
(e.g. a Hadamard rotation spelled ``F.linear(x.float(), H)`` that feeds act_quant and the K cache) the exact
eager bytes matter more than the GEMM, and the fp32 GEMM is kept. Every failed check is a near miss.
The pointwise scale chain after the GEMM is not touched; Inductor fuses it (with the partials' sum) into one kernel
after the op.
"""

from __future__ import annotations

import collections

import torch
import torch.fx

from ..pass_manager import PassContext, PassResult
from .graph_utils import VIEW_OPS, as_int, describe, erase_dead, insert_call, is_op, sym_equal, tensor_val

aten = torch.ops.aten
prims = torch.ops.prims

_LOW_PRECISION = {torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2,
                  torch.float8_e5m2fnuz}
_DOWNSTREAM_LIMIT = 20000
# Split-K of the op: one split per 1024 columns of K, at most 4 (the consumer kernel reads every partial; with the
# scale chain's own inputs it must stay under Inductor's realize_acc_reads_threshold of 8 reads).
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


def _view_chain(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """Follow reshape/view producers back; the root and the views from the root outwards."""
    views = []
    while is_op(node, *VIEW_OPS):
        views.append(node)
        node = node.args[0]
    return node, views[::-1]


def _replay(graph: torch.fx.Graph, start: torch.fx.Node, views: list[torch.fx.Node]) -> torch.fx.Node:
    """Apply the same views (same size arguments) to ``start``."""
    for view in views:
        start = insert_call(graph, view.target, (start, *view.args[1:]), dict(view.kwargs))
    return start


def _quantized_by_store(node: torch.fx.Node) -> bool:
    """``nsa.quant_cache_store`` (inserted by an earlier pass) rounds its input to bf16 and fp8 itself."""
    return (node.op == "call_function" and node.target is torch.ops.higher_order.auto_functionalized
            and str(node.args[0]) == "nsa.quant_cache_store.default")


def _weight_rows(graph: torch.fx.Graph, b: torch.fx.Node, w: torch.fx.Node) -> torch.fx.Node:
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
            if _quantized_by_store(user):
                return f"quantized to fp8 downstream by {describe(user)}"
            if user not in seen:
                if len(seen) >= _DOWNSTREAM_LIMIT:
                    return f"consumed by more than {_DOWNSTREAM_LIMIT} nodes, not proven to stay fp32"
                seen.add(user)
                queue.append(user)
    return None


def _transposed_weight(b: torch.fx.Node) -> torch.fx.Node | None:
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


class HeadGateGemm:
    """``mode="split"`` (default): W32 = W_hi + W_lo with both halves bf16 (split in the GEMM kernel, ~16 mantissa
    bits of W kept; stays inside DESIGN's 1e-3 logits contract). ``mode="round"``: W rounded to bf16 in the kernel
    (1.0e-3 to 1.7e-3 relative logits error measured, over the contract)."""

    name = "head_gate_gemm"

    def __init__(self, mode: str = "split"):
        if mode not in ("split", "round"):
            raise ValueError(f"head_gate_gemm mode must be 'split' or 'round', got {mode!r}")
        self.mode = mode

    def __call__(self, graph: torch.fx.Graph, ctx: PassContext | None = None) -> PassResult:
        result = PassResult()
        static = static_inputs(graph)
        for node in list(graph.nodes):
            if getattr(node, "_erased", False) or node.graph is not graph:
                continue
            if is_op(node, aten.mm.default, aten.addmm.default):
                reason = self._upcast_gemm(graph, node, static)
            elif is_op(node, prims.convert_element_type.default) and node.args[1] == torch.float32:
                reason = self._gemm_then_upcast(graph, node, static)
            else:
                continue
            if reason is None:
                result.matched += 1
            elif reason:
                result.miss(node, reason)
        return result

    # -----------------------------------------------------------------------------------------------------------

    @staticmethod
    def _weight_reason(w: torch.fx.Node, dtype: torch.dtype, static: set[torch.fx.Node] | None) -> str | None:
        tw = tensor_val(w)
        if tw.dtype != dtype:
            return f"weight {describe(w)} is {tw.dtype} {list(tw.shape)}, not {dtype}"
        if w.op == "get_attr":
            return None
        if w.op != "placeholder":
            return f"weight {describe(w)} is computed in the graph, not a parameter"
        if static is None:
            return f"weight {describe(w)}: no AOTAutograd metadata says whether this graph input is a parameter"
        if w not in static:
            return f"weight {describe(w)} is a non-parameter graph input (an activation); rounding it is not allowed"
        return None

    @staticmethod
    def _split_k_gemm(graph: torch.fx.Graph, x: torch.fx.Node, w_rows: torch.fx.Node, round_weight: bool,
                      k: int) -> torch.fx.Node:
        """``x [M, K] bf16 @ w_rows [N, K]^T`` in fp32: ``nsa.head_gate_gemm``'s partials summed by pointwise adds
        (not a reduction: Inductor fuses the adds into the consumer kernel instead of launching one of its own)."""
        splits = max(1, min(_MAX_SPLITS, k // _K_PER_SPLIT))
        partials = insert_call(graph, torch.ops.nsa.head_gate_gemm.default, (x, w_rows, splits, round_weight))
        total = insert_call(graph, aten.select.int, (partials, 0, 0))
        for s in range(1, splits):
            total = insert_call(graph, aten.add.Tensor, (total, insert_call(graph, aten.select.int, (partials, 0, s))))
        return total

    def _upcast_gemm(self, graph: torch.fx.Graph, mm: torch.fx.Node, static: set[torch.fx.Node] | None
                     ) -> str | None | bool:
        """``mm(convert(x_bf16, f32), W32^T)`` (or addmm). ``False``: not this idiom at all (no report)."""
        is_addmm = is_op(mm, aten.addmm.default)
        a, b = (mm.args[1], mm.args[2]) if is_addmm else (mm.args[0], mm.args[1])
        ta, tm = tensor_val(a), tensor_val(mm)
        if ta is None or tm is None or ta.dtype != torch.float32:
            return False
        root, views = _view_chain(a)
        if not is_op(root, prims.convert_element_type.default):
            return False  # an fp32 GEMM of fp32 activations: nothing to do
        x = root.args[0]
        tx = tensor_val(x)
        w = _transposed_weight(b)
        if w is None:
            return f"GEMM of an upcast activation whose second operand {describe(b)} is computed, not a 2-D weight"
        if tx is None or tx.dtype != torch.bfloat16:
            return f"activation {describe(x)} is {tx.dtype if tx is not None else None} before the upcast, not bfloat16"
        reason = self._weight_reason(w, torch.float32, static)
        if reason:
            return reason
        tw = tensor_val(w)
        tb = tensor_val(b)
        if tb is None or tb.dim() != 2 or not sym_equal(ta.shape[1], tb.shape[0]):
            return f"K dimension mismatch: activation {list(ta.shape)} vs weight operand {list(tw.shape)}"
        if is_addmm and (mm.kwargs.get("beta", 1) != 1 or mm.kwargs.get("alpha", 1) != 1):
            return f"addmm with beta={mm.kwargs.get('beta', 1)} alpha={mm.kwargs.get('alpha', 1)}"
        if is_addmm and (tensor_val(mm.args[0]) is None or tensor_val(mm.args[0]).dtype != torch.float32):
            return f"addmm bias {describe(mm.args[0])} is not fp32"
        rounded = _rounded_downstream(mm)
        if rounded is not None:
            return (f"the fp32 GEMM output is {rounded} (e.g. a Hadamard rotation feeding act_quant): keeping the "
                    "exact fp32 GEMM")
        k = as_int(tb.shape[0])
        if k is None:
            return f"weight {describe(w)} has a symbolic input size {tb.shape[0]}"
        with graph.inserting_before(mm):
            x_2d = _replay(graph, x, views)
            new = self._split_k_gemm(graph, x_2d, _weight_rows(graph, b, w), self.mode == "round", k)
            if is_addmm:
                new = insert_call(graph, aten.add.Tensor, (new, mm.args[0]))
        mm.replace_all_uses_with(new)
        erase_dead(graph, [mm])
        return None

    def _gemm_then_upcast(self, graph: torch.fx.Graph, cvt: torch.fx.Node, static: set[torch.fx.Node] | None
                          ) -> str | None | bool:
        """``convert(mm(x_bf16, W16^T), f32)``, possibly with reshapes between the mm and the convert."""
        src = cvt.args[0]
        ts = tensor_val(src)
        if ts is None or ts.dtype != torch.bfloat16:
            return False
        mm, views = _view_chain(src)
        if not is_op(mm, aten.mm.default):
            return False
        a, b = mm.args
        ta = tensor_val(a)
        w = _transposed_weight(b)
        if w is None or ta is None or ta.dtype != torch.bfloat16:
            return False  # a bf16 product of activations, not a linear layer
        reason = self._weight_reason(w, torch.bfloat16, static)
        if reason:
            return reason
        for node in [mm, *views]:
            if len(node.users) != 1:
                return f"the bf16 GEMM result {describe(node)} is also used in bf16; rewriting would run the GEMM twice"
        rounded = _rounded_downstream(cvt)
        if rounded is not None:
            return f"the fp32 result is {rounded}: keeping the eager bf16 GEMM"
        k = as_int(ta.shape[1])
        if k is None:
            return f"weight {describe(w)} has a symbolic input size {ta.shape[1]}"
        with graph.inserting_before(cvt):
            new = _replay(graph, self._split_k_gemm(graph, a, _weight_rows(graph, b, w), False, k), views)
        cvt.replace_all_uses_with(new)
        erase_dead(graph, [cvt])
        return None


PASS = HeadGateGemm()
