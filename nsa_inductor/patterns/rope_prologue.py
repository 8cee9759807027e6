"""RoPE written into the rows a fused rotation reads -> the RoPE inside that kernel, as its prologue.

Eager idiom (``Indexer.project_q`` / ``store_k``; SGLang's and vLLM's neox and interleaved RoPE)::

    cos, sin = cos_sin[positions].unbind(1)                  # or table[positions, 0], table.index_select(0, pos)
    x1, x2 = x[..., :r].float().chunk(2, -1)                 # or [..., 0::2] / [..., 1::2] (interleaved pairs)
    x[..., :r] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(bf16)   # or cat([that, x[..., r:]])
    nsa.rotate_act_quant(x, H, ...)   /   nsa.quant_cache_store(k=x, rotation=H, ...)

Matches the ``x`` (``k``) of an ``nsa.rotate_act_quant`` or ``nsa.quant_cache_store`` that, through views, is a bf16
tensor the shape of a ``base`` [T, ..., 128], computed by elementwise arithmetic, casts, views, slices, splits and
concatenations from ``base`` and from rows gathered (``index``, ``index_select``) by one ``positions`` [T] from
static tables (graph inputs). Proves it is ``base`` with eager's RoPE on its first ``r`` lanes by running that
computation on random probes against ``indexer.apply_rope`` (neox or interleaved pairs, either table as cos): every
bit must agree, so a changed sign, pairing, table or rounding is a near miss. The RoPE's result may be read only by
the op, whose rows must be ``base``'s with its first dim. Rewrites to the op reading ``base``, with ``rope_cos`` /
``rope_sin`` (the gathered rows' views, taken of the tables: [P, r/2]), ``positions`` and ``rope_interleaved``: the
Inductor kernel that computed the RoPE goes.
Never: tables computed in the graph, positions of another length than ``base``'s first dim, a RoPE result read
elsewhere.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..indexer import apply_rope
from .base import GraphPass, NearMiss, PassContext
from .fx_utils import (VALUE_COPIES, VIEW_OPS, arg, as_int, aten, describe, evaluate, insert_call, is_op, is_store,
                       live_users, norm_dim, prims, same_shape, sym_equal, val, value_root)

# What the RoPE computation may consist of: arithmetic the probes decide, and ops that only move or round values.
_ARITHMETIC = (aten.mul.Tensor, aten.sub.Tensor, aten.add.Tensor, aten.neg.default)
_MOVES = (*VIEW_OPS, *VALUE_COPIES, aten.cat.default, aten.stack.default, aten.split.Tensor,
          aten.split_with_sizes.default, aten.unbind.int, aten.slice.Tensor, aten.select.int, aten.expand.default,
          aten.copy.default, aten.slice_scatter.default, prims.convert_element_type.default, operator.getitem)
# Views of a gathered row that are views of the table row too (they keep dim 0, the token).
_ROW_VIEWS = (aten.select.int, aten.slice.Tensor, operator.getitem)


def _gather(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(table, positions)`` of ``table[positions]`` / ``table.index_select(0, positions)``, else ``None``."""
    if is_op(node, aten.index.Tensor) and len(node.args[1]) == 1 and node.args[1][0] is not None:
        return node.args[0], node.args[1][0]
    if is_op(node, aten.index_select.default) and norm_dim(node.args[1], val(node.args[0]).dim()) == 0:
        return node.args[0], node.args[2]
    return None


def _static_table(table: torch.fx.Node) -> None:
    """The table a gather reads is a graph input's view: its values are the op's to read at run time."""
    root = table
    while is_op(root, aten.select.int, aten.slice.Tensor, *VIEW_OPS):
        root = root.args[0]
    if root.op not in ("placeholder", "get_attr") or val(root).dtype != torch.float32:
        raise NearMiss(f"the RoPE table {describe(root)} is not an fp32 parameter, buffer or constant")


def _computation(written: torch.fx.Node, base: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """``(nodes, gathers)``: the nodes computing ``written`` from ``base`` and the gathers, each checked to be one
    of the ops a RoPE consists of."""
    nodes, gathers, stack, seen = [], [], [written], set()
    while stack:
        node = stack.pop()
        if node in seen or node is base or isinstance(val(node), torch.SymInt):  # (sizes: the probes bind them)
            continue
        seen.add(node)
        if _gather(node) is not None:
            gathers.append(node)
            continue
        if node.op != "call_function" or not is_op(node, *_ARITHMETIC, *_MOVES):
            raise NearMiss(f"the values written into the rotated rows read {describe(node)}: not RoPE arithmetic on "
                           "the rows and gathered table rows")
        nodes.append(node)
        stack.extend(node.all_input_nodes)
    if not gathers:
        raise NearMiss("the values written into the rotated rows gather no table rows by position")
    return nodes, gathers


def _base(written: torch.fx.Node) -> torch.fx.Node:
    """The rows before the RoPE: ``slice_scatter``'s input, or the tensor whose last lanes ``cat`` appends."""
    if is_op(written, aten.slice_scatter.default):
        return written.args[0]
    if is_op(written, aten.cat.default) and len(written.args[0]) == 2:
        rest = written.args[0][1]
        while is_op(rest, aten.slice.Tensor, operator.getitem, aten.split.Tensor, aten.split_with_sizes.default,
                    *VIEW_OPS):
            rest = rest.args[0]
            if isinstance(val(rest), torch.Tensor) and same_shape(rest, written):
                return rest
    raise NearMiss(f"{describe(written)} does not write into the first lanes of a tensor (slice_scatter, or cat "
                   "with its last lanes)")


def _row_tables(gathers: list[torch.fx.Node], nodes: set[torch.fx.Node], tokens) -> list[torch.fx.Node]:
    """The 2-D ``[T, w]`` views of gathered rows that the computation reads other than through more such views
    (candidates for cos and sin)."""
    splits = (*_ROW_VIEWS, aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default)
    found, stack = [], list(gathers)
    while stack:
        node = stack.pop()
        users = [u for u in node.users if u in nodes]
        shape = val(node).shape if isinstance(val(node), torch.Tensor) else None
        if shape is not None and len(shape) == 2 and sym_equal(shape[0], tokens) and any(
                not is_op(u, *splits) for u in users):
            found.append(node)
        stack.extend(u for u in users if is_op(u, *splits))
    return found


def _probe(node: torch.fx.Node, gen: torch.Generator) -> torch.Tensor:
    """Random values of ``node``'s dtype and shape (a symbolic size at the size it was traced with)."""
    fake = val(node)
    shape = [s if isinstance(s, int) else s.node.hint for s in fake.shape]
    if not all(isinstance(s, int) for s in shape):
        raise NearMiss(f"{describe(node)} has a size without a traced value: no probe for the RoPE proof")
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(fake.dtype)


def _table_key(table: torch.fx.Node) -> tuple:
    """The table a gather reads, as its root and the views taken of it (one table spelled twice: one key)."""
    views = []
    while is_op(table, aten.select.int, aten.slice.Tensor, *VIEW_OPS):
        views.append((table.target, tuple(table.args[1:]), tuple(sorted(table.kwargs.items()))))
        table = table.args[0]
    return table, tuple(views)


def _table_view(graph: torch.fx.Graph, row: torch.fx.Node) -> torch.fx.Node:
    """``row`` (views of ``table[positions]`` that keep dim 0) as the same views of ``table``: [P, w]."""
    steps, node = [], row
    while _gather(node) is None:
        steps.append(node)
        node = node.args[0].args[0] if is_op(node, operator.getitem) else node.args[0]  # (getitem of a split)
    view = _gather(node)[0]
    for step in reversed(steps):
        if is_op(step, aten.select.int, aten.slice.Tensor):
            if norm_dim(step.args[1], val(step.args[0]).dim()) == 0:
                raise NearMiss(f"{describe(step)} views the gathered rows across tokens")
            view = insert_call(graph, step.target, (view, *step.args[1:]), dict(step.kwargs))
        elif is_op(step, operator.getitem):
            split, index = step.args
            unbind = is_op(split, aten.unbind.int)
            dim = norm_dim(arg(split, 1 if unbind else 2, "dim", 0), val(split.args[0]).dim())
            if dim == 0:
                raise NearMiss(f"{describe(split)} splits the gathered rows across tokens")
            if unbind:
                view = insert_call(graph, aten.select.int, (view, dim, index))
            else:
                width = as_int(val(split.args[0]).shape[dim])
                sizes = split.args[1] if is_op(split, aten.split_with_sizes.default) else \
                    [split.args[1]] * -(-width // split.args[1])
                start = sum(sizes[:index])
                view = insert_call(graph, aten.slice.Tensor, (view, dim, start, min(start + sizes[index], width)))
        else:
            raise NearMiss(f"{describe(step)} is not a view of one table row")
    return view


class RopePrologue(GraphPass):
    name = "rope_prologue"

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext):
        for node in list(graph.nodes):
            if is_op(node, torch.ops.nsa.rotate_act_quant.default) and "rope_cos" not in node.kwargs:
                yield node
            elif is_store(node) and node.kwargs.get("rope_cos") is None:
                yield node

    def rewrite(self, graph: torch.fx.Graph, anchor: torch.fx.Node, ctx: PassContext) -> torch.fx.Node:
        x = anchor.kwargs["k"] if is_store(anchor) else anchor.args[0]
        written = x
        while is_op(written, *VIEW_OPS):
            written = written.args[0]
        if val(written).dtype != torch.bfloat16 or as_int(val(written).shape[-1]) != 128 or val(written).dim() < 2:
            raise NearMiss(f"{describe(written)} is not bf16 rows of 128 (the RoPE prologue turns bf16 rows)")
        base = _base(written)
        if not sym_equal(val(x).shape[0], val(base).shape[0]):
            raise NearMiss(f"the op reads the rows as {list(val(x).shape)}, not one token per index of the first dim "
                           f"as {describe(base)} {list(val(base).shape)}")
        if len(live_users(written)) != 1:
            raise NearMiss(f"{describe(written)} (the RoPE's result) is also read elsewhere: fusing would compute it "
                           "twice")
        root = value_root(base)  # (the RoPE may read base's lanes through another view of its storage)
        nodes, gathers = _computation(written, root)
        positions = {_gather(g)[1] for g in gathers}
        tokens = val(base).shape[0]
        if len(positions) != 1:
            raise NearMiss(f"the table rows are gathered by {len(positions)} position tensors, not one")
        (pos,) = positions
        pv = val(pos)
        if pv.dim() != 1 or pv.dtype not in (torch.int32, torch.int64) or not sym_equal(pv.shape[0], tokens):
            raise NearMiss(f"the positions are {pv.dtype} {list(pv.shape)}, not one int per token [{tokens}]")
        for g in gathers:
            _static_table(_gather(g)[0])
        cos, sin, interleaved = self._prove(written, base, root, gathers, set(nodes), tokens)
        with graph.inserting_before(anchor):
            cos_table, sin_table = _table_view(graph, cos), _table_view(graph, sin)
        written.replace_all_uses_with(base)
        rope = {"rope_cos": cos_table, "rope_sin": sin_table, "positions": pos, "rope_interleaved": interleaved}
        anchor.kwargs = {**anchor.kwargs, **rope}
        return anchor

    def finish(self, graph: torch.fx.Graph, rewritten: list[torch.fx.Node]) -> None:
        graph.eliminate_dead_code()

    @staticmethod
    def _prove(written, base, root, gathers, nodes, tokens) -> tuple[torch.fx.Node, torch.fx.Node, bool]:
        """Runs the computation on random rows (``root``: base's storage) and table rows: ``(cos view, sin view,
        interleaved)`` for which it is ``apply_rope`` on the first ``r`` lanes of ``base``, bit for bit."""
        gen = torch.Generator().manual_seed(0)
        probes = {root: _probe(root, gen)}
        same = {}
        for g in gathers:  # one probe per distinct (table, positions): spelled twice, still one table
            key = _table_key(_gather(g)[0])
            same.setdefault(key, _probe(g, gen))
            probes[g] = same[key]
        got = evaluate(written, probes)
        rows = _row_tables(gathers, nodes, tokens)
        values = {r: evaluate(r, probes) for r in rows}
        distinct = []
        for r in rows:
            if not any(torch.equal(values[r], values[d]) for d in distinct):
                distinct.append(r)
        if len(distinct) != 2:
            raise NearMiss(f"the RoPE reads {len(distinct)} distinct [T, r/2] views of table rows, not cos and sin")
        x = probes[root] if base is root else evaluate(base, probes)
        for cos, sin in ((distinct[0], distinct[1]), (distinct[1], distinct[0])):
            half = val(cos).shape[1]
            if not 0 < 2 * half <= 128:
                continue
            c, s = (values[t].view(x.shape[0], *[1] * (x.dim() - 2), half) for t in (cos, sin))
            for interleaved in (False, True):
                want = torch.cat([apply_rope(x[..., : 2 * half], c, s, interleaved), x[..., 2 * half:]], dim=-1)
                if torch.equal(got.view(torch.int16), want.view(torch.int16)):
                    return cos, sin, interleaved
        raise NearMiss("the values written into the rotated rows are not eager's RoPE of its first lanes (neox or "
                       "interleaved pairs, products rounded before the sum, then bf16) on random probes")
