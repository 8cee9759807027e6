"""plain-torch indexer logits of bf16/fp16 q and K, one K per batch entry -> ``nsa.batched_mqa_logits``.

Matches (Hugging Face's DeepSeek-V3.2 indexer and its ports; q ``[B, S, H, D]``, k ``[B, T, D]``, w ``[B, S, H]``)::

    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale
    scores = F.relu(scores)              # or relu(scores * scale), relu(scores) * scale (scale > 0), no scale
    logits = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)        # [B, S, T]
    logits = logits.masked_fill(~mask, float("-inf"))                  # optional: any number, where(mask, .), ...
    # or q.flatten(1, 2).float() @ k.transpose(-1, -2).float() viewed [B, S, H, T], scores^T @ w[..., None],
    # (scores * w[..., None]).sum(2), an einsum's [H, B*S, T] scores summed over dim 0, one K [T, D] for all rows:
    # the reshapes between the tensors and the matmuls are followed element by element (mqa/probe.py)

Rewrites to ``nsa.batched_mqa_logits(q, k, w, scale[, scale_tensor, mask, fill])`` in the head contraction's place: the
``[B, S, H, T]`` fp32 scores (and the fp32 copy of k expanded over S) are never written. A boolean mask that is the
logits' only use (``where(keep, logits, c)`` or ``where(drop, c, logits)``, through reshapes; ``c`` a number: -inf,
``finfo.min``, ...) becomes the op's ``mask`` and ``fill``: the kernels skip the keys and tiles it drops (the same
values: ``c`` there whatever the scores were).
Never: q or K not bf16/fp16 upcast to fp32 (an fp32 q·k has no kernel here; an fp8 one is the MQA passes'), another
activation than relu, a tensor factor on the scores but one 0-d scale inside the relu, heads summed otherwise than
by a matmul with the weights or a sum of their product (one head or one key: torch's matmul is then no bmm).
"""

from __future__ import annotations

import math

import torch
import torch.fx

from .base import GraphPass, NearMiss, PassContext
from .fx_utils import VIEW_OPS, arg, as_int, describe, erase_dead, insert_call, is_op, live_users, replace, \
    reshape, size_arg, tensor_val, val
from .mqa.probe import bmap, follow, linear, shape_of, unravel
from .mqa.proofs import WHERES, constant_number, reads_fp8, relu_input

aten = torch.ops.aten
prims = torch.ops.prims

UPCAST_DTYPES = (torch.bfloat16, torch.float16)
DOTS = (aten.bmm.default, aten.mm.default)  # an mm: a bmm of batch 1 (Inductor's bmm_to_mm on GPUs)
SAMPLES = 48  # (row, key) outputs probed, each for every head and every dot index


def _scores_of(node: torch.fx.Node, coords: torch.Tensor):
    """``(dot, dot coords, scale, scale tensor or None)`` where ``node[coords]`` is ``relu(dot[dot coords] * scale
    [* scale tensor])`` through reshapes and factors, else ``None`` (also for a dot that reads fp8: the fp8 MQA
    passes' idiom, their reports say why they did not fire); ``NearMiss`` for a factor that breaks it.

    Folded: numbers (after the relu only those > 0, with which it commutes), and inside the relu one 0-d fp32 tensor
    applied after them (Dynamo's unspecialised float scale), so that the kernel's ``dot * scale * tensor`` rounds as
    eager does."""
    scale, scale_tensor, relu_seen, problem = 1.0, None, False, None
    node, coords = follow(node, coords)
    for _ in range(6):
        x = relu_input(node)
        if x is not None and not relu_seen:
            relu_seen = True
        elif is_op(node, aten.mul.Tensor):
            full = [a for a in node.args[:2] if tensor_val(a) is not None and list(val(a).shape) ==
                    list(val(node).shape) and val(a).dtype == torch.float32]
            if not full:
                return None
            x = full[0]
            factor = node.args[1] if node.args[0] is x else node.args[0]
            number = isinstance(factor, (int, float)) and not isinstance(factor, bool)
            if number and math.isfinite(factor) and (relu_seen or factor > 0):
                scale *= factor
            elif relu_seen and isinstance(factor, torch.fx.Node) and val(factor).dim() == 0 \
                    and val(factor).dtype == torch.float32 and scale_tensor is None and scale == 1.0:
                scale_tensor = factor
            elif relu_seen or relu_input(follow(x, coords[:0])[0]) is not None:
                problem = problem or (f"the relu's scores are multiplied by {describe(factor)}"
                                      f"{'' if relu_seen else ' after it'}: folded are numbers (after the relu, > 0) "
                                      "and, inside it, one 0-d fp32 tensor applied after them")
            else:
                return None
        else:
            break
        node, coords = follow(x, coords)
    if not (relu_seen and is_op(node, *DOTS)) or reads_fp8(node):
        return None
    if problem is not None:
        raise NearMiss(problem)
    if is_op(node, aten.mm.default):  # (a batch of one: its coordinates as a bmm's)
        coords = torch.cat([torch.zeros_like(coords[:, :1]), coords], 1)
    return node, coords, scale, scale_tensor


def _holds_relu_of_dot(node: torch.fx.Node) -> bool:
    """Whether ``node`` is relu(q·k) of a dot that reads no fp8, or a near miss of it."""
    if tensor_val(node) is None:
        return False
    coords = torch.zeros(1, val(node).dim(), dtype=torch.int64)
    try:
        return _scores_of(node, coords) is not None
    except NearMiss:
        return True  # (a candidate: its near miss says why)


def _upcast_source(node: torch.fx.Node, coords: torch.Tensor, what: str):
    """``(tensor, coords)`` read through reshapes and one bf16/fp16 -> fp32 convert."""
    node, coords = follow(node, coords)
    if not is_op(node, prims.convert_element_type.default) or val(node.args[0]).dtype not in UPCAST_DTYPES:
        dtype = val(node.args[0]).dtype if is_op(node, prims.convert_element_type.default) else val(node).dtype
        raise NearMiss(f"the dot's {what} is {describe(node)} of {str(dtype).removeprefix('torch.')}: the kernel "
                       "multiplies bf16 or fp16 values upcast to fp32")
    return follow(node.args[0], coords)


def _scores_operand(mul: torch.fx.Node) -> int | None:
    """Which operand of ``mul`` holds relu(q·k), if one does."""
    for i, a in enumerate(mul.args[:2]):
        if tensor_val(a) is not None and list(val(a).shape) == list(val(mul).shape) and _holds_relu_of_dot(a):
            return i
    return None


def _head_sum(node: torch.fx.Node) -> tuple[int, torch.fx.Node] | None:
    """``(head dim, mul)`` where ``node`` sums one dim (not the last) of a product holding relu(q·k)."""
    if not is_op(node, aten.sum.dim_IntList) or len(node.args) < 2 or len(node.args[1]) != 1 \
            or node.kwargs.get("dtype") is not None or arg(node, 2, "keepdim", False):
        return None
    mul = node.args[0]
    if not is_op(mul, aten.mul.Tensor) or tensor_val(mul) is None:
        return None
    rank = val(mul).dim()
    dim = node.args[1][0] % rank
    if dim == rank - 1 or _scores_operand(mul) is None:
        return None
    return dim, mul


def _contraction(anchor: torch.fx.Node) -> tuple:
    """``(rows, keys, heads, their sizes (symbols kept), scores, weights, at)`` of a head contraction seen as
    ``[rows, keys]`` outputs; ``at(r, t, h)``: the coordinates of the scores and of the weights output ``(r, t)``
    reads for head ``h``."""
    if is_op(anchor, *DOTS):
        one = [] if is_op(anchor, aten.bmm.default) else [1]  # (an mm: a batch of one)
        rows, m, n = one + shape_of(anchor)
        scores_first = _holds_relu_of_dot(anchor.args[0])  # scores^T @ w: [R, T, H] @ [R, H, 1]
        scores, weights = anchor.args[:2] if scores_first else anchor.args[::-1]
        keys, single = (m, n) if scores_first else (n, m)
        if single != 1:
            raise NearMiss(f"{describe(anchor)} contracts the heads of relu(q·k) with {single} weight rows, "
                           "expected one (a weighted head sum)")
        head_axis = 2 if scores_first else 1
        sizes, scores_sizes = one + list(val(anchor).shape), one + list(val(scores).shape)
        symbolic = (sizes[0], sizes[1 if scores_first else 2], scores_sizes[head_axis])

        def at(r, t, h):
            zero = torch.zeros_like(r)
            return (torch.stack([r, t, h] if scores_first else [r, h, t], 1)[:, len(one):],
                    torch.stack([r, h, zero] if scores_first else [r, zero, h], 1)[:, len(one):])

        return rows, keys, (one + shape_of(scores))[head_axis], symbolic, scores, weights, at
    head_axis, mul = _head_sum(anchor)
    i = _scores_operand(mul)
    scores, weights = mul.args[i], mul.args[1 - i]
    if not isinstance(weights, torch.fx.Node) or val(weights).dim() == 0:
        raise NearMiss(f"the head sum {describe(anchor)} has no weights tensor")
    symbolic = (math.prod(val(anchor).shape[:-1]), val(anchor).shape[-1], val(mul).shape[head_axis])

    def at(r, t, h):
        lead = unravel(r, shape_of(anchor)[:-1])
        at_scores = torch.cat([lead[:, :head_axis], h[:, None], lead[:, head_axis:], t[:, None]], 1)
        return at_scores, bmap(at_scores, shape_of(weights))

    return math.prod(shape_of(anchor)[:-1]), shape_of(anchor)[-1], shape_of(mul)[head_axis], symbolic, scores, \
        weights, at


class BatchedMqaLogits(GraphPass):
    name = "batched_mqa_logits"

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext | None):
        return [n for n in graph.nodes if is_op(n, *DOTS)
                and any(isinstance(a, torch.fx.Node) and _holds_relu_of_dot(a) for a in n.args[:2])
                or _head_sum(n) is not None]

    def rewrite(self, graph: torch.fx.Graph, anchor: torch.fx.Node, ctx: PassContext | None) -> None:
        """Sample outputs ``(r, t)`` of the anchor seen as ``[rows, keys]``, follow each head's scores to the dot and
        each dot index to q and k, and each weight to its tensor; prove the three row-major maps, then rewrite."""
        rows, keys, heads, symbolic, scores_arg, weights_arg, at = _contraction(anchor)
        if rows * keys * heads == 0:
            raise NearMiss(f"{describe(anchor)} {shape_of(anchor)} has an empty dimension: nothing to compute")
        gen = torch.Generator().manual_seed(0)
        pick = torch.randint(0, rows * keys, (SAMPLES,), generator=gen)
        pick[:2] = torch.tensor([0, rows * keys - 1])
        r, t = (pick // keys).repeat_interleave(heads), (pick % keys).repeat_interleave(heads)
        h = torch.arange(heads).repeat(SAMPLES)
        scores_at, weights_at = at(r, t, h)
        found = _scores_of(scores_arg, scores_at)
        if found is None:
            raise NearMiss(f"the heads {describe(anchor)} sums are not relu(q·k) through reshapes")
        dot, dot_at, scale, scale_tensor = found
        dim = shape_of(dot.args[0])[-1]
        if dim == 0:
            raise NearMiss(f"the dot {describe(dot)} contracts no values")
        d = torch.arange(dim).repeat(dot_at.shape[0])
        each = dot_at.repeat_interleave(dim, 0)
        skip = 0 if is_op(dot, aten.bmm.default) else 1  # (an mm's operands have no batch coordinate)
        q, q_at = _upcast_source(dot.args[0], torch.stack([each[:, 0], each[:, 1], d], 1)[:, skip:], "first operand")
        k, k_at = _upcast_source(dot.args[1], torch.stack([each[:, 0], d, each[:, 2]], 1)[:, skip:], "second operand")
        w, w_at = follow(weights_arg, weights_at)
        if val(q).dtype != val(k).dtype:
            raise NearMiss(f"q is {val(q).dtype} and k {val(k).dtype}: the kernel multiplies one type")
        if val(w).dtype != torch.float32:
            raise NearMiss(f"the head weights {describe(w)} are {val(w).dtype}, not fp32")
        batch = math.prod(shape_of(k)) // (keys * dim)
        if batch == 0 or rows % batch or math.prod(shape_of(k)) != batch * keys * dim:
            raise NearMiss(f"k {describe(k)} {shape_of(k)} is not [B, T={keys}, D={dim}] with B dividing the "
                           f"{rows} rows")
        tokens = rows // batch
        r_d, t_d, h_d = (x.repeat_interleave(dim) for x in (r, t, h))
        maps = (("q", q, q_at, (r_d * heads + h_d) * dim + d, "[B, S, H, D]"),
                ("k", k, k_at, ((r_d // tokens) * keys + t_d) * dim + d, "[B, T, D]"),
                ("the weights", w, w_at, r * heads + h, "[B, S, H]"))
        for what, node, at, want, order in maps:
            if not torch.equal(linear(at, shape_of(node)), want):
                raise NearMiss(f"{what} ({describe(node)} {shape_of(node)}) is not read as {order} in row-major "
                               f"order (B={batch}, S={tokens}, H={heads}, T={keys}, D={dim})")
        with graph.inserting_before(anchor):
            size_b, size_s, size_h, size_t, size_d = self._sizes(graph, symbolic, dot, k, [q, k, w])
            out = insert_call(graph, torch.ops.nsa.batched_mqa_logits.default,
                              (reshape(graph, q, [size_b, size_s, size_h, size_d]),
                               reshape(graph, k, [size_b, size_t, size_d]), reshape(graph, w, [size_b, size_s, size_h]),
                               scale, scale_tensor))
            replace(graph, anchor, out)
        _fold_mask(graph, out)

    @staticmethod
    def _sizes(graph: torch.fx.Graph, symbolic: tuple, dot: torch.fx.Node, k: torch.fx.Node,
               sources: list[torch.fx.Node]) -> list:
        """``B, S, H, T, D`` for the op's reshapes from the anchor's ``(rows, keys, heads)`` (sizes or symbols): ints,
        or size nodes of the graph's tensors."""
        rows, keys, heads = symbolic
        dim = val(dot.args[0]).shape[-1]
        batch = val(k).numel() // (keys * dim)
        sources = sources + [n for n in graph.nodes if n.op == "placeholder"]
        return [size_arg(graph, as_int(x) if as_int(x) is not None else x, sources)
                for x in (batch, rows // batch, heads, keys, dim)]


def _fold_mask(graph: torch.fx.Graph, op: torch.fx.Node) -> None:
    """``where(keep, logits, c)`` (or ``where(drop, c, logits)``, ``drop`` maybe ``~keep``) of the op's only use,
    through reshapes, ``c`` a number (-inf, ``finfo.min``, ...) -> the op with ``mask=keep`` broadcast to
    ``[B, S, T]`` and ``fill=c``; anything else stays as it is."""
    logits = op
    while len(live_users(logits)) == 1 and is_op(live_users(logits)[0], *VIEW_OPS):
        logits = live_users(logits)[0]
    users = live_users(logits)
    if len(users) != 1 or not is_op(users[0], *WHERES) or len(users[0].args) != 3:
        return
    where = users[0]
    cond, if_true, if_false = where.args
    if if_true is logits:
        keep, fill = cond, constant_number(if_false)
    elif if_false is logits:
        keep = cond.args[0] if is_op(cond, aten.bitwise_not.default, aten.logical_not.default) \
            and val(cond.args[0]).dtype == torch.bool else None
        fill = constant_number(if_true)
    else:
        return
    if fill is None or tensor_val(cond) is None or val(cond).dtype != torch.bool \
            or val(where).dtype != torch.float32 or list(val(where).shape) != list(val(logits).shape):
        return
    with graph.inserting_before(where):
        sources = [*op.args[:3], keep if keep is not None else cond]  # (not the logits: they would stay alive)
        sizes = [[], []]  # where's and the op's
        try:
            for made, x in zip(sizes, (where, op)):
                for size in val(x).shape:
                    made.append(size_arg(graph, size, sources))
        except NearMiss:  # (a size that is no input's, e.g. B * S: the mask stays a where)
            erase_dead(graph, [n for n in sum(sizes, []) if isinstance(n, torch.fx.Node)])
            return
        keep = keep if keep is not None else insert_call(graph, aten.bitwise_not.default, (cond,))
        if list(val(keep).shape) != list(val(where).shape):
            keep = insert_call(graph, aten.expand.default, (keep, sizes[0]))
        masked = insert_call(graph, torch.ops.nsa.batched_mqa_logits.default,
                             (*op.args[:5], reshape(graph, keep, sizes[1]), None if fill == float("-inf") else fill))
        replace(graph, where, masked)
