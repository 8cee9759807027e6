"""The K projection and the head gate, both GEMMs of the hidden state x -> one ``nsa.wk_gate_gemm`` launch.

Matches, after ``head_gate_gemm`` has fired (post-grad form after the arrow)::

    k = self.k_norm(self.wk(x).float())               # mm(x_bf16, permute(Wk_bf16, [1, 0])) -> convert f32 -> LN ...
    ... k reaches the K-cache store                   # nsa.quant_cache_store, or an index_put into the uint8 cache
    gates = F.linear(x.float(), W32) * ...            # nsa.head_gate_gemm(x, W32, s, r) -> select/add partial sum

where both GEMMs read the same x (one value, any views) and Wk is a bf16 parameter [N <= 256, K] (a GEMM that
Inductor's ``pad_mm`` padded is plain again: ``unpad_gemm`` runs first).
Rewrites to ``g, k = nsa.wk_gate_gemm(x, W32, Wk, gate_splits, k_splits, r)``: the gate's sum as before (over
``g``), and ``convert(k[0] + k[1] + ..., bf16)`` in place of the bf16 GEMM. The split counts come from ``SPLITS``
for the static token count.

The K values change only in summation order (fp32 partial sums rounded once to bf16, as cuBLAS rounds its fp32
accumulator), so a few cache bytes may differ from eager. Following the rule for numerics-changing passes, it fires
only where that serves the indexer: the GEMM's output must reach the K-cache store, in decode-sized batches (at
most ``MAX_TOKENS`` tokens). Never (near misses): another activation, a weight that is not a bf16 parameter or has
more than 256 rows, an output that never reaches the store, a prefill-sized token count.
"""

from __future__ import annotations

import collections
import operator

import torch
import torch.fx

from .base import GraphPass, NearMiss, PassContext
from .fx_utils import (VIEW_OPS, as_int, describe, erase_dead, insert_call, is_op, is_store, same_shape, tensor_val,
                       view_chain)
from .head_gate_gemm import (DOWNSTREAM_LIMIT, check_parameter_weight, static_inputs, sum_partials, transposed_weight,
                             weight_rows)

aten = torch.ops.aten
prims = torch.ops.prims

# Rows (largest token count M of the bucket, gate splits, K-projection splits); a symbolic M takes the last row.
# Each partial is one more read in the kernel that consumes its sum. The gate's consumer is the
# q act_quant kernel (the scale chain reads the partials and q's amax): past Inductor's realize_acc_reads_threshold
# (12 under the backend) the sum would be stored by a kernel of its own. The K sum feeds the `.float()` before
# LayerNorm. Tune with `benchmarks/kernels.py --only xgemm` (it reads this table).
SPLITS = ((64, 8, 16), (512, 8, 8), (None, 4, 4))  # H200 sweep: BENCHMARKS.md, wk_gate_gemm
# Fewer splits where K is short: at least this many columns of K per split.
MIN_K_PER_SPLIT = 128

# Largest token count fused (static, or the example value of a symbolic one): decode batches, where the launch saves
# most. At prefill sizes cuBLAS serves wk well, and the reordered sum moved GLM-5 prefill logits 1.4e-3 from eager's
# on the H200 (BENCHMARKS.md, GPU test runs), past the 1e-3 the compiled indexer keeps to eager.
MAX_TOKENS = 256

# Largest K projection folded in: the op's tiles and split table are sized for the indexer's [128, K] wk; a wider
# bf16 projection is a GEMM cuBLAS serves well on its own.
MAX_K_ROWS = 256


def splits_for(rows: int | None, k: int) -> tuple[int, int]:
    """``(gate_splits, k_splits)`` of ``SPLITS`` for ``rows`` tokens (``None``: symbolic) and ``k`` columns."""
    most = max(1, k // MIN_K_PER_SPLIT)
    row = next(r for r in SPLITS if r[0] is None or rows is not None and rows <= r[0])
    return min(row[1], most), min(row[2], most)


def _gate_sum(gate: torch.fx.Node) -> torch.fx.Node:
    """The node holding ``partials[0] + ... + partials[splits - 1]`` as ``head_gate_gemm`` built it (its only use
    of the partials), so the sum can be rebuilt over other partials."""
    splits = gate.args[2]
    selects = {}
    for user in gate.users:
        if not is_op(user, aten.select.int) or user.args[1] != 0 or user.args[2] in selects:
            raise NearMiss(f"the head-gate partials {describe(gate)} are read by {describe(user)}, not only by their "
                           "sum")
        selects[user.args[2]] = user
    if sorted(selects) != list(range(splits)):
        raise NearMiss(f"the head-gate partials {describe(gate)} are not summed over all {splits} splits")
    total = selects[0]
    for s in range(1, splits):
        adds = [u for u in total.users if is_op(u, aten.add.Tensor) and list(u.args) == [total, selects[s]]]
        if len(total.users) != 1 or len(adds) != 1:
            raise NearMiss(f"the head-gate partial sum at {describe(total)} is also read on its own")
        total = adds[0]
    return total


def _cache_write(node: torch.fx.Node) -> bool:
    """``node`` writes the uint8 K cache: ``nsa.quant_cache_store``, or an ``index_put`` into a view or slice of a
    uint8 graph input (eager stores: ``KCacheLayout.store`` writes the cache as int32 words, others index the value
    and scale parts of its pages)."""
    if is_store(node):
        return True
    if not is_op(node, aten.index_put.default, aten.index_put_.default):
        return False
    root, _ = view_chain(node.args[0], (*VIEW_OPS, aten.view.dtype, aten.slice.Tensor))
    t = tensor_val(root)
    return root.op == "placeholder" and t is not None and t.dtype == torch.uint8


def _reaches_k_cache(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value flows into a K-cache write (breadth first; a graph too large to walk: no)."""
    seen, queue = {node}, collections.deque([node])
    while queue:
        for user in queue.popleft().users:
            if _cache_write(user):
                return True
            if user not in seen and len(seen) < DOWNSTREAM_LIMIT:
                seen.add(user)
                queue.append(user)
    return False


def _bf16_linear(mm: torch.fx.Node, static) -> torch.fx.Node:
    """The weight ``W [N, K]`` of ``mm(x_bf16, W^T)``, checked to be a bf16 parameter of at most MAX_K_ROWS rows."""
    w = transposed_weight(mm.args[1])
    if w is None:
        raise NearMiss(f"the second operand {describe(mm.args[1])} of {describe(mm)} is computed, not a 2-D weight")
    check_parameter_weight(w, torch.bfloat16, static)
    rows = tensor_val(mm).shape[1]
    if as_int(rows) is None or as_int(rows) > MAX_K_ROWS:
        raise NearMiss(f"{describe(mm)} has {rows} output columns; only projections of up to {MAX_K_ROWS} (the "
                       "indexer's K) are folded into the gate's launch")
    return w


def _first(graph: torch.fx.Graph, *nodes: torch.fx.Node) -> torch.fx.Node:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return min(nodes, key=order.__getitem__)


def _available_at(graph: torch.fx.Graph, node: torch.fx.Node, first: torch.fx.Node) -> torch.fx.Node:
    """``node`` (a weight or a transposed view of one), usable before ``first``: recreated there when it is a view
    defined later."""
    if node.op in ("placeholder", "get_attr") or _first(graph, node, first) is node and node is not first:
        return node
    return insert_call(graph, node.target, tuple(node.args), dict(node.kwargs))


class WkGateGemm(GraphPass):
    """One launch for the bf16 K projection and the head gate that read the same x."""

    name = "wk_gate_gemm"
    may_change_cache_bytes = True

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext | None):
        static = static_inputs(graph)
        for node in list(graph.nodes):
            if is_op(node, torch.ops.nsa.head_gate_gemm.default):
                yield node, static

    def anchor(self, candidate: tuple) -> torch.fx.Node:
        return candidate[0]

    def rewrite(self, graph: torch.fx.Graph, candidate: tuple, ctx: PassContext | None) -> None:
        gate, static = candidate
        x, gate_w, _, round_weight = gate.args
        gate_total = _gate_sum(gate)
        mm = self._k_projection(graph, x, static)
        rows, k = tensor_val(x).shape
        if as_int(k) is None:
            raise NearMiss(f"activation {describe(x)} has a symbolic K {k}")
        example = as_int(rows) if as_int(rows) is not None else rows.node.hint
        if example is None or example > MAX_TOKENS:
            raise NearMiss(f"activation {describe(x)} has {rows} tokens (example {example}): only decode-sized "
                           f"batches (up to {MAX_TOKENS}) are fused, prefill keeps cuBLAS's wk and eager's bytes")
        gate_splits, k_splits = splits_for(as_int(rows), as_int(k))
        first = _first(graph, gate, mm)
        with graph.inserting_before(first):
            k_w = weight_rows(graph, mm.args[1], transposed_weight(mm.args[1]))
            both = insert_call(graph, torch.ops.nsa.wk_gate_gemm.default,
                               (first.args[0], _available_at(graph, gate_w, first), k_w, gate_splits,
                                k_splits, round_weight))
            gates = sum_partials(graph, insert_call(graph, operator.getitem, (both, 0)), gate_splits)
            k_sum = sum_partials(graph, insert_call(graph, operator.getitem, (both, 1)), k_splits)
            k = insert_call(graph, prims.convert_element_type.default, (k_sum, torch.bfloat16))
        gate_total.replace_all_uses_with(gates)
        mm.replace_all_uses_with(k)
        erase_dead(graph, [gate_total, mm])

    def _k_projection(self, graph: torch.fx.Graph, x: torch.fx.Node, static) -> torch.fx.Node:
        """The one bf16 GEMM of this x (any views of its value) with a parameter weight whose output reaches the
        K-cache store. Near misses: a GEMM of this x with another weight or output; else a GEMM of another x that
        feeds the store."""
        root, _ = view_chain(x)
        k = tensor_val(x).shape[1]
        found, same_x, other_x = [], [], []
        for mm in graph.find_nodes(op="call_function", target=aten.mm.default):
            a = mm.args[0]
            ta = tensor_val(a)
            if ta is None or ta.dtype != torch.bfloat16 or ta.dim() != 2 or tensor_val(mm).dtype != torch.bfloat16:
                continue
            if view_chain(a)[0] is not root or not same_shape(a, x):
                if ta.shape[1] == k and transposed_weight(mm.args[1]) is not None and _reaches_k_cache(mm):
                    other_x.append(f"{describe(mm)} feeds the K cache but reads {describe(a)}, not the gate's "
                                   f"activation {describe(x)}")
                continue
            try:
                _bf16_linear(mm, static)
                if not _reaches_k_cache(mm):
                    raise NearMiss(f"the output of {describe(mm)} never reaches the K-cache store: its summation "
                                   "order may change only where it serves the indexer")
            except NearMiss as miss:
                same_x.append(str(miss))
                continue
            found.append(mm)
        if len(found) > 1:
            raise NearMiss(f"several bf16 projections of {describe(x)} feed the K cache: "
                           f"{', '.join(map(describe, found))}")
        if not found:
            reasons = same_x or other_x or [f"no bf16 GEMM of {describe(x)} feeds the K cache"]
            raise NearMiss("no K projection to share the launch: " + "; ".join(reasons))
        return found[0]
