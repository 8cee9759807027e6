"""``full(-inf)`` logits buffers that are overwritten everywhere -> no fill.

    logits = torch.full((R, W), -inf); logits[:, :W] = x           # or logits.copy_(x): (a) every element written
    logits = torch.full((R, W), -inf); logits[:, :m] = paged(m)    # (b) decode logits, max_len m <= W

Matches a ``full`` buffer whose only use is one write (post-grad ``copy(full, x)`` / ``slice_scatter`` /
``select_scatter``) that provably covers (a) every element (start 0, step 1, end >= size, proven without guards),
or (b) columns ``[0, m)`` of an fp32 -inf ``[R, W]`` buffer written by ``nsa.paged_mqa_logits(..., max_len=m)``
with ``max_pages * page_size <= m <= W`` (the op writes every element, -inf past each row's keys, DESIGN §4).
Rewrites to the written value itself (cast/expanded to the buffer), or (b) the op called once with ``max_len=W``.
Never: a buffer read before the write, written by several writes, or partly written (near misses for -inf fills).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

from .base import GraphPass, NearMiss, PassContext
from .fx_utils import (VIEW_OPS, arg, as_int, copy_destination_only, describe, erase_dead, insert_call, is_op, known_ge,
                       norm_dim, same_shape, slice_params, sym_equal, sym_value, tensor_val, value_step, walk_back)

aten = torch.ops.aten
prims = torch.ops.prims

_WRITES = (aten.slice_scatter.default, aten.select_scatter.default, aten.copy.default)


def _op_args(node: torch.fx.Node) -> dict[str, Any] | None:
    """Arguments of a call by schema name (positional and keyword)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    out: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            return None
    return out


def _classify_users(full: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """(writes that take ``full`` as their destination/base, readers of ``full``'s elements)."""
    writes, reads = [], []
    for user in full.users:
        if user.target in _WRITES and user.args[0] is full and full not in user.args[1:]:
            writes.append(user)
        elif (is_op(user, aten.slice.Tensor, aten.select.int, *VIEW_OPS) and user.args[0] is full
              and user.users and copy_destination_only(user)):
            continue
        else:
            reads.append(user)
    return writes, reads


def _fill_is_neg_inf(full: torch.fx.Node) -> bool:
    fill = arg(full, 1, "fill_value")
    return isinstance(fill, (int, float)) and math.isinf(fill) and fill < 0


class EmptyLogitsBuffer(GraphPass):
    name = "empty_logits_buffer"

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext | None):
        for full in list(graph.nodes):
            if full.graph is graph and is_op(full, aten.full.default) and tensor_val(full) is not None \
                    and tensor_val(full).dim() > 0 and _classify_users(full)[0]:
                yield full  # (a full without writes is a constant used as a value, e.g. in ``where``)

    def reported(self, full: torch.fx.Node, miss: NearMiss) -> bool:
        return _fill_is_neg_inf(full)

    def rewrite(self, graph: torch.fx.Graph, full: torch.fx.Node, ctx: PassContext | None) -> None:
        writes, reads = _classify_users(full)
        if reads:
            raise NearMiss(f"buffer {full.name} is read by {', '.join(describe(r) for r in reads)} before it is "
                           "written")
        if len(writes) > 1:
            raise NearMiss(f"buffer {full.name} is the base of {len(writes)} separate writes "
                           f"({', '.join(describe(w) for w in writes)}); each needs the fill")
        self._rewrite(graph, full, writes[0])

    # -----------------------------------------------------------------------------------------------------------

    def _rewrite(self, graph: torch.fx.Graph, full: torch.fx.Node, write: torch.fx.Node) -> None:
        """Replace ``write`` (the only consumer of ``full``'s fill) when it provably overwrites every element."""
        tf = tensor_val(full)
        src = write.args[1]
        if tensor_val(src) is None:
            raise NearMiss(f"no fake tensor metadata on {src}")
        if is_op(write, aten.copy.default):
            return self._replace_whole(graph, full, write, src)
        if is_op(write, aten.select_scatter.default):
            dim = norm_dim(write.args[2], tf.dim())
            if not sym_equal(tf.shape[dim], 1):
                raise NearMiss(f"partial write: {describe(write)} writes one index of dim {dim} (size "
                               f"{tf.shape[dim]}), the rest keeps the fill")
            return self._replace_whole(graph, full, write, src)
        dim, start, end, step = slice_params(write, 2)
        dim = norm_dim(dim, tf.dim())
        size = tf.shape[dim]
        covers = sym_equal(start, 0) and sym_equal(step, 1) and known_ge(end, size)
        if not covers:
            ints = [as_int(x) for x in (start, end, step, size)]
            if None not in ints:
                s0, e0, st0, n = ints
                covers = range(n)[s0:e0:st0] == range(n)
        if covers:
            return self._replace_whole(graph, full, write, src)
        return self._replace_paged(graph, full, write, (dim, start, end, step))

    def _replace_whole(self, graph, full, write, src) -> None:
        tf, ts = tensor_val(full), tensor_val(src)
        with graph.inserting_before(write):
            new = src
            if not same_shape(src, full):
                if is_op(write, aten.copy.default):
                    new = insert_call(graph, aten.expand.default, (new, list(tf.shape)))
                    new = insert_call(graph, aten.clone.default, (new,), {"memory_format": torch.contiguous_format})
                elif is_op(write, aten.select_scatter.default):
                    new = insert_call(graph, aten.unsqueeze.default, (new, norm_dim(write.args[2], tf.dim())))
                else:
                    raise NearMiss(f"full-range write {describe(write)} with a source of another shape "
                                   f"{list(ts.shape)}")
            if ts.dtype != tf.dtype:
                new = insert_call(graph, prims.convert_element_type.default, (new, tf.dtype))
        write.replace_all_uses_with(new)
        erase_dead(graph, [write])

    def _replace_paged(self, graph, full, write, params) -> None:
        tf = tensor_val(full)
        dim, start, end, step = params
        partial = (f"partial write: {describe(write)} covers (dim, start, end, step) = "
                   f"({dim}, {sym_value(start)}, {sym_value(end)}, {sym_value(step)}) of a buffer of shape "
                   f"{list(tf.shape)}")
        op = torch.ops.nsa.paged_mqa_logits.default
        # the value written, through value-preserving steps (each must have one user for the producer to go)
        producer, chain = walk_back(write.args[1], value_step)
        if producer.target is not op:
            raise NearMiss(f"{partial}, and the writer {describe(producer)} is not known to write -inf in the rest")
        args = _op_args(producer)
        tl = tensor_val(producer)
        if args is None or tl is None:
            raise NearMiss(f"{partial}: cannot read the arguments of {describe(producer)}")
        if not _fill_is_neg_inf(full) or tf.dtype != torch.float32 or tl.dtype != torch.float32:
            raise NearMiss(f"{partial}: the buffer is not an fp32 -inf fill ({tf.dtype}, fill {full.args[1]})")
        if tf.dim() != 2 or dim != 1 or not sym_equal(start, 0) or not sym_equal(step, 1):
            raise NearMiss(f"{partial}: paged logits fill whole rows from column 0 of a 2-D buffer only")
        if not same_shape(producer, write.args[1]) or not sym_equal(tl.shape[0], tf.shape[0]):
            raise NearMiss(f"{partial}: the logits {list(tl.shape)} are reshaped before the write "
                           f"({list(tensor_val(write.args[1]).shape)})")
        max_len, width = args["max_len"], full.args[0][1]
        if not known_ge(end, max_len):
            raise NearMiss(f"{partial}: the write ends at {sym_value(end)}, before the logits' max_len "
                           f"{sym_value(max_len)}")
        if not known_ge(width, max_len):
            raise NearMiss(f"{partial}: max_len {sym_value(max_len)} is not provably <= the buffer width "
                           f"{sym_value(width)}")
        pages = tensor_val(args["block_table"]).shape[1]
        if not known_ge(max_len, pages * args["page_size"]):
            raise NearMiss(f"{partial}: max_len {sym_value(max_len)} is not provably >= the block table's reach "
                           f"(max_pages {sym_value(pages)} * page_size {sym_value(args['page_size'])}); longer "
                           "contexts would gain columns")
        for node in chain:
            if len(node.users) != 1:
                raise NearMiss(f"{partial}: {describe(node)} has other users besides the write")
        if len(producer.users) != 1:
            raise NearMiss(f"{partial}: the logits {describe(producer)} are also used elsewhere at width "
                           f"{sym_value(max_len)}")
        names = [a.name for a in producer.target._schema.arguments]
        new_args = tuple(width if n == "max_len" else args[n] for n in names)
        with graph.inserting_before(write):
            new = insert_call(graph, op, new_args)
        write.replace_all_uses_with(new)
        erase_dead(graph, [write])
