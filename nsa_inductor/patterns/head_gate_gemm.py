"""fp32 head-gate GEMM with casts -> one bf16-input GEMM with fp32 output.

Eager spellings (post-grad form after the arrow)::

    F.linear(x.float(), W32)            -> mm(convert(x_bf16, f32), permute(W32, [1, 0]))   (reshapes around for 3-D x)
    x.to(torch.float32) @ W32.t()       -> the same
    F.linear(x.float(), W32, b32)       -> addmm(b32, convert(x_bf16, f32), permute(W32, [1, 0]))
    F.linear(x, W16).float()            -> convert(mm(x_bf16, permute(W16, [1, 0])), f32)

Rewrite: one ``aten.mm.dtype(x_bf16, B_bf16, float32)`` (bf16 inputs, fp32 accumulation and output, no cast
kernel of x). For an fp32 weight the default mode "split" uses ``B = cat([hi, lo])^T`` with ``hi`` = W with its low
16 bits cleared and ``lo = bf16(W - hi)``, and adds the two output halves in fp32 (fused into the scale chain): about
16 significant bits of W, ~5e-6 relative logits error. Mode "round" (``HeadGateGemm("round")``) uses ``bf16(W)``:
half the weight bytes but 1.0e-3 to 1.7e-3 relative logits error, over DESIGN's contract (see README).
``aten.mm.dtype`` exists for CUDA/ROCm (and XPU) only; on other devices (CPU) the same numbers are computed as an
fp32 ``mm`` of the bf16 operands (a product of two bf16 values is exact in fp32; only summation order differs).

The weight ``W`` must be module state: a ``get_attr`` constant (frozen; its bf16 copy is made once here), or a
graph input that AOTAutograd lists as a static input (``TracingContext.fw_metadata.static_input_indices``:
parameters, buffers, ``mark_static_address`` tensors; Dynamo does not tell parameters from buffers at this stage).
An activation weight is never rounded. The fp32 result must not be rounded to bf16/fp16/fp8 downstream: there
(e.g. a Hadamard rotation spelled ``F.linear(x.float(), H)`` that feeds act_quant and the K cache) the exact
eager bytes matter more than the GEMM, and the fp32 GEMM is kept. Every failed check is a near miss.
The pointwise scale chain after the GEMM is not touched; Inductor fuses it into one kernel after the extern GEMM.
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


def _rounded_downstream(node: torch.fx.Node) -> str | None:
    """Why ``node``'s fp32 value may reach a low-precision cast, or ``None`` once proven that it never does.

    Breadth first, so the nearest cast is found; a downstream graph too large to walk counts as "may".
    """
    seen, queue = {node}, collections.deque([node])
    while queue:
        for user in queue.popleft().users:
            if is_op(user, prims.convert_element_type.default) and user.args[1] in _LOW_PRECISION:
                return f"rounded to {user.args[1]} downstream by {describe(user)}"
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
    """``mode="split"`` (default): W32 = W_hi + W_lo with both halves bf16 (one GEMM over the concatenated halves,
    ~16 mantissa bits of W kept; stays inside DESIGN's 1e-3 logits contract). ``mode="round"``: W rounded to bf16
    (half the weight bytes; 1.0e-3 to 1.7e-3 relative logits error measured, over the contract)."""

    name = "head_gate_gemm"

    def __init__(self, mode: str = "split"):
        if mode not in ("split", "round"):
            raise ValueError(f"head_gate_gemm mode must be 'split' or 'round', got {mode!r}")
        self.mode = mode

    def __call__(self, graph: torch.fx.Graph, ctx: PassContext | None = None) -> PassResult:
        result = PassResult()
        self._static = static_inputs(graph)
        for node in list(graph.nodes):
            if getattr(node, "_erased", False) or node.graph is not graph:
                continue
            if is_op(node, aten.mm.default, aten.addmm.default):
                reason = self._upcast_gemm(graph, node)
            elif is_op(node, prims.convert_element_type.default) and node.args[1] == torch.float32:
                reason = self._gemm_then_upcast(graph, node)
            else:
                continue
            if reason is None:
                result.matched += 1
            elif reason:
                result.miss(node, reason)
        return result

    # -----------------------------------------------------------------------------------------------------------

    def _weight_reason(self, w: torch.fx.Node, dtype: torch.dtype) -> str | None:
        tw = tensor_val(w)
        if tw.dtype != dtype:
            return f"weight {describe(w)} is {tw.dtype} {list(tw.shape)}, not {dtype}"
        if w.op == "get_attr":
            return None
        if w.op != "placeholder":
            return f"weight {describe(w)} is computed in the graph, not a parameter"
        if self._static is None:
            return f"weight {describe(w)}: no AOTAutograd metadata says whether this graph input is a parameter"
        if w not in self._static:
            return f"weight {describe(w)} is a non-parameter graph input (an activation); rounding it is not allowed"
        return None

    def _bf16_weight(self, graph: torch.fx.Graph, w: torch.fx.Node, cat_dim: int) -> torch.fx.Node:
        """``W`` as bf16: ``bf16(W)`` (mode "round"), or ``cat([hi, lo], cat_dim)`` with ``W ~= hi + lo`` (mode
        "split"). A frozen constant (``get_attr``) is split once at compile time with ``hi = bf16(W)`` (rounded);
        a graph input is split per call with ``hi`` = W truncated to bf16 (see below). Both keep ~16 bits of W."""
        gm = graph.owning_module
        fake = tensor_val(w)
        if w.op == "get_attr" and gm is not None:
            real = getattr(gm, str(w.target), None)
            if isinstance(real, torch.Tensor) and not isinstance(real, torch._subclasses.FakeTensor):
                real = real.detach()
                folded = real.to(torch.bfloat16)
                if self.mode == "split":
                    folded = torch.cat([folded, (real - folded.float()).to(torch.bfloat16)], cat_dim)
                name = f"{str(w.target).replace('.', '_')}_nsa_{self.mode}_bf16"
                setattr(gm, name, folded)
                node = graph.get_attr(name)
                with torch._guards.detect_fake_mode([fake]):
                    node.meta["val"] = torch.empty_strided(folded.shape, folded.stride(), dtype=folded.dtype,
                                                           device=fake.device)
                return node
        if self.mode != "split":
            return insert_call(graph, prims.convert_element_type.default, (w, torch.bfloat16))
        # hi = W with its low 16 bits cleared (exactly representable in bf16), lo = bf16(W - hi). Not
        # ``bf16(W)`` and ``W - f32(bf16(W))``: Inductor's fused GPU kernels drop the rounding of a bf16 round-trip
        # (they compute in fp32), which would make lo zero. Bit operations are never simplified away.
        bits = insert_call(graph, aten.view.dtype, (w, torch.int32))
        hi32 = insert_call(graph, aten.view.dtype,
                           (insert_call(graph, aten.bitwise_and.Scalar, (bits, -65536)), torch.float32))
        hi = insert_call(graph, prims.convert_element_type.default, (hi32, torch.bfloat16))
        lo = insert_call(graph, prims.convert_element_type.default,
                         (insert_call(graph, aten.sub.Tensor, (w, hi32)), torch.bfloat16))
        return insert_call(graph, aten.cat.default, ([hi, lo], cat_dim))

    @staticmethod
    def _gemm(graph, a_bf16: torch.fx.Node, b_bf16: torch.fx.Node, a_f32: torch.fx.Node | None) -> torch.fx.Node:
        """bf16 x bf16 -> fp32. ``a_f32``: the already existing fp32 copy of ``a`` (CPU path reuses it)."""
        if device_has_mm_dtype(tensor_val(a_bf16).device):
            return insert_call(graph, aten.mm.dtype, (a_bf16, b_bf16, torch.float32))
        if a_f32 is None:
            a_f32 = insert_call(graph, prims.convert_element_type.default, (a_bf16, torch.float32))
        b_f32 = insert_call(graph, prims.convert_element_type.default, (b_bf16, torch.float32))
        return insert_call(graph, aten.mm.default, (a_f32, b_f32))

    def _upcast_gemm(self, graph: torch.fx.Graph, mm: torch.fx.Node) -> str | None | bool:
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
        reason = self._weight_reason(w, torch.float32)
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
        cat_dim = 1 if b is w else 0  # W's output-feature dim
        n = as_int(tw.shape[cat_dim])
        if self.mode == "split" and n is None:
            return f"weight {describe(w)} has a symbolic output size {tw.shape[cat_dim]}"
        with graph.inserting_before(mm):
            w_bf16 = self._bf16_weight(graph, w, cat_dim)
            b_new = w_bf16 if b is w else insert_call(graph, b.target, (w_bf16, *b.args[1:]), dict(b.kwargs))
            if device_has_mm_dtype(ta.device):
                new = self._gemm(graph, _replay(graph, x, views), b_new, None)
            else:
                new = self._gemm(graph, x, b_new, a)  # ``a`` already holds x in fp32 with the right shape
            if self.mode == "split":  # x @ W_hi + x @ W_lo, added in fp32 (fuses into the scale chain)
                new = insert_call(graph, aten.add.Tensor, (insert_call(graph, aten.slice.Tensor, (new, 1, 0, n)),
                                                           insert_call(graph, aten.slice.Tensor, (new, 1, n, 2 * n))))
            if is_addmm:
                new = insert_call(graph, aten.add.Tensor, (new, mm.args[0]))
        mm.replace_all_uses_with(new)
        erase_dead(graph, [mm])
        return None

    def _gemm_then_upcast(self, graph: torch.fx.Graph, cvt: torch.fx.Node) -> str | None | bool:
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
        reason = self._weight_reason(w, torch.bfloat16)
        if reason:
            return reason
        for node in [mm, *views]:
            if len(node.users) != 1:
                return f"the bf16 GEMM result {describe(node)} is also used in bf16; rewriting would run the GEMM twice"
        rounded = _rounded_downstream(cvt)
        if rounded is not None:
            return f"the fp32 result is {rounded}: keeping the eager bf16 GEMM"
        with graph.inserting_before(cvt):
            new = _replay(graph, self._gemm(graph, a, b, None), views)
        cvt.replace_all_uses_with(new)
        erase_dead(graph, [cvt])
        return None


def device_has_mm_dtype(device: torch.device) -> bool:
    """``aten.mm.dtype`` (bf16 inputs, fp32 output) has kernels for CUDA/ROCm and XPU only."""
    return device.type in ("cuda", "xpu") and hasattr(aten.mm, "dtype")


PASS = HeadGateGemm()
