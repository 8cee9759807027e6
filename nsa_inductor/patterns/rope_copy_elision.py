"""RoPE write-backs whose source is proven to be the destination itself -> removed.

Eager idiom (post-grad: ``slice -> copy -> slice_scatter`` / ``select_scatter``)::

    q_pe = q[..., :r]; q_pe.copy_(rope(q_pe)); q[..., :r] = q_pe     # k.narrow(-1, 0, r).copy_(k_rope) alike

Matches ``slice_scatter(base, src, dim, a, b, s)`` (or ``select_scatter``; or a whole-tensor ``copy``) whose ``src``
is, through value-preserving steps (views, clones, same-dtype converts, equal-shape copies), ``slice(x, dim, a, b,
s)`` of an ``x`` holding the same value as ``base``, with the same range (compared symbolically, no guards), and
nothing mutating that value before the write. Rewrites to ``base``.
Never: the in-place ``q_pe.copy_(rope(q_pe))`` itself (a real write; reported as a near miss, kept).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx

from .base import GraphPass, NearMiss, PassContext
from .fx_utils import (VIEW_OPS, as_int, copy_destination_only, describe, erase_dead, is_op, norm_dim, same_shape,
                       slice_params, sym_equal, sym_value, tensor_val, value_root, value_step, view_chain)

aten = torch.ops.aten
prims = torch.ops.prims

SCATTERS = (aten.slice_scatter.default, aten.select_scatter.default)
_SLICE_FOR = {aten.slice_scatter.default: aten.slice.Tensor, aten.select_scatter.default: aten.select.int}


# ---------------------------------------------------------------------------------------------------------------
# value equality in a functional graph
# ---------------------------------------------------------------------------------------------------------------


def same_value(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """``a`` and ``b`` hold equal elements: one root through value-preserving steps, one shape, one dtype."""
    ta, tb = tensor_val(a), tensor_val(b)
    if ta is None or tb is None or ta.dtype != tb.dtype or not same_shape(a, b):
        return False
    return value_root(a) is value_root(b)


def _uses(root: torch.fx.Node, follow: Callable[[torch.fx.Node, torch.fx.Node], bool]
          ) -> Iterator[tuple[torch.fx.Node, torch.fx.Node]]:
    """Every ``(node, user)`` pair from ``root`` on, walking on into the users ``follow(user, node)`` accepts."""
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            yield node, user
            if follow(user, node):
                stack.append(user)


def mutated_before(root: torch.fx.Node, anchor: torch.fx.Node) -> torch.fx.Node | None:
    """A node that mutates ``root`` (or a view of it) placed before ``anchor``, if any."""
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    for _, user in _uses(root, lambda user, _: is_op(user, *VIEW_OPS)):
        schema = getattr(user.target, "_schema", None)
        if user.op == "call_function" and schema is not None and schema.is_mutable \
                and order.get(user, -1) < order[anchor]:
            return user
    return None


# ---------------------------------------------------------------------------------------------------------------
# slice parameters
# ---------------------------------------------------------------------------------------------------------------


def same_range(a: tuple, b: tuple, ndim: int, size: Any) -> bool:
    """Two ``(dim, start, end, step)`` tuples select the same elements of a tensor with ``ndim`` dims."""
    if norm_dim(a[0], ndim) != norm_dim(b[0], ndim):
        return False
    if all(sym_equal(x, y) for x, y in zip(a[1:], b[1:])):
        return True
    ints = [as_int(x) for x in (*a[1:], *b[1:], size)]
    if any(i is None for i in ints):
        return False
    s0, e0, st0, s1, e1, st1, n = ints
    return range(n)[s0:e0:st0] == range(n)[s1:e1:st1]


def same_index(a: tuple, b: tuple, ndim: int, size: Any) -> bool:
    """Two ``(dim, index)`` select positions pick the same slab."""
    if norm_dim(a[0], ndim) != norm_dim(b[0], ndim):
        return False
    if sym_equal(a[1], b[1]):
        return True
    i0, i1, n = as_int(a[1]), as_int(b[1]), as_int(size)
    return None not in (i0, i1, n) and i0 % n == i1 % n


# ---------------------------------------------------------------------------------------------------------------
# the pass
# ---------------------------------------------------------------------------------------------------------------


def _is_rope_like(node: torch.fx.Node, depth: int = 6) -> bool:
    """A concatenation/stack of products within a few producers: how RoPE rotations look once traced."""
    stack, seen = [(node, 0)], set()
    found_cat = found_mul = False
    while stack:
        n, d = stack.pop()
        if n in seen or d > depth or not isinstance(n, torch.fx.Node):
            continue
        seen.add(n)
        found_cat |= is_op(n, aten.cat.default, aten.stack.default)
        found_mul |= is_op(n, aten.mul.Tensor)
        stack.extend((i, d + 1) for i in n.all_input_nodes)
    return found_cat and found_mul


def _why_not_identity(node: torch.fx.Node) -> str:
    """Why the value walk stopped at ``node`` (a computed value, a dtype change, a broadcasting copy)."""
    if is_op(node, aten.copy.default):
        td, ts = tensor_val(node.args[0]), tensor_val(node.args[1])
        return (f"source is a copy that changes dtype or broadcasts ({describe(node)}: dst "
                f"{td.dtype if td is not None else None} {list(td.shape) if td is not None else None}, src "
                f"{ts.dtype if ts is not None else None} {list(ts.shape) if ts is not None else None})")
    what = "a RoPE output computed out of place" if _is_rope_like(node) else "a computed value"
    if is_op(node, prims.convert_element_type.default):
        src = node.args[0]
        inner = view_chain(src, VIEW_OPS + (prims.convert_element_type.default,))[0]
        if is_op(inner, aten.slice.Tensor, aten.select.int):
            return (f"source is a dtype change of a slice ({describe(node)}: {tensor_val(src).dtype} -> "
                    f"{tensor_val(node).dtype}), not the destination's own elements")
        return (f"source is {what} ({describe(node)}, {tensor_val(src).dtype} -> {tensor_val(node).dtype}), "
                "not the destination")
    return f"source is {what} ({describe(node)}), not the destination"


def _looks_like_writeback(scatter: torch.fx.Node) -> bool:
    """A slice/select of the destination's value with the scatter's range exists (the eager idiom's shape)."""
    base = scatter.args[0]
    root = value_root(base)
    sl_target = _SLICE_FOR[scatter.target]
    if value_root(scatter.args[1]).target is sl_target:
        return True  # the source is a slice (of another tensor, or another range)
    first_ndim = tensor_val(base).dim() if tensor_val(base) is not None else 0
    params = slice_params(scatter, 2) if sl_target is aten.slice.Tensor else (scatter.args[2], scatter.args[3])
    for node, user in _uses(root, lambda user, node: value_step(user) is node):
        if user.target is sl_target and user.args[0] is node and tensor_val(node) is not None \
                and tensor_val(node).dim() == first_ndim and not copy_destination_only(user):
            other = slice_params(user, 1) if sl_target is aten.slice.Tensor else (user.args[1], user.args[2])
            if norm_dim(other[0], first_ndim) == norm_dim(params[0], first_ndim):
                return True
    return False


def check_writeback(scatter: torch.fx.Node) -> None:
    """Proves ``scatter`` rewrites its base with its base's own elements; :class:`NearMiss` with the failed check."""
    base, src = scatter.args[0], scatter.args[1]
    tb, ts = tensor_val(base), tensor_val(src)
    if tb is None or ts is None:
        raise NearMiss("no fake tensor metadata on the scatter's inputs")
    sl = value_root(src)
    sl_target = _SLICE_FOR[scatter.target]
    if sl.target is not sl_target:
        raise NearMiss(_why_not_identity(sl))
    tsl = tensor_val(sl)
    if tsl is None or tsl.dtype != ts.dtype or not same_shape(sl, src):
        raise NearMiss(f"source {describe(sl)} is reshaped to another shape before the write "
                       f"({list(tsl.shape) if tsl is not None else None} vs {list(ts.shape)})")
    sliced = sl.args[0]
    if not same_value(sliced, base):
        tsd = tensor_val(sliced)
        raise NearMiss(f"source slices {describe(sliced)} (root {describe(value_root(sliced))}, "
                       f"{tsd.dtype if tsd is not None else None} {list(tsd.shape) if tsd is not None else None}), "
                       f"a different tensor than the destination {describe(base)} (root {describe(value_root(base))}, "
                       f"{tb.dtype} {list(tb.shape)})")
    ndim = tb.dim()
    if sl_target is aten.slice.Tensor:
        mine, theirs = slice_params(scatter, 2), slice_params(sl, 1)
        size = tb.shape[norm_dim(mine[0], ndim)] if ndim else None
        if not same_range(mine, theirs, ndim, size):
            raise NearMiss(f"different ranges: the write covers (dim, start, end, step) = {_fmt(mine)}, the source "
                           f"was read from {_fmt(theirs)}")
    else:
        mine, theirs = (scatter.args[2], scatter.args[3]), (sl.args[1], sl.args[2])
        size = tb.shape[norm_dim(mine[0], ndim)] if ndim else None
        if not same_index(mine, theirs, ndim, size):
            raise NearMiss(f"different positions: the write goes to (dim, index) = {_fmt(mine)}, the source is "
                           f"{_fmt(theirs)}")
    root = value_root(base)
    mutator = mutated_before(root, scatter)
    if mutator is not None:
        raise NearMiss(f"{describe(root)} is mutated by {describe(mutator)} before the write-back")


def _fmt(params: tuple) -> str:
    return "(" + ", ".join(str(sym_value(p)) for p in params) + ")"


class RopeCopyElision(GraphPass):
    name = "rope_copy_elision"

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext | None):
        for node in list(graph.nodes):
            if node.graph is not graph or node.op != "call_function":
                continue
            if node.target in SCATTERS:
                yield node
            elif is_op(node, aten.copy.default) and not any(u.target in SCATTERS for u in node.users) \
                    and same_value(node.args[1], node.args[0]) and mutated_before(value_root(node.args[0]), node) is None:
                yield node  # ``dst.copy_(src)`` of a whole tensor whose source is the destination's own value

    def reported(self, node: torch.fx.Node, miss: NearMiss) -> bool:
        return _looks_like_writeback(node)

    def rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node, ctx: PassContext | None) -> None:
        if node.target in SCATTERS:
            check_writeback(node)
        node.replace_all_uses_with(node.args[0])
        erase_dead(graph, [node])
