"""full(-inf) logits buffers that are overwritten everywhere -> no fill.

Eager spellings::

    logits = torch.full((R, W), -inf); logits.copy_(x)                    # (a) whole buffer written
    logits = torch.full((R, W), -inf); logits[:, :W] = x                  # (a) a slice covering every element
    logits = torch.full((R, W), -inf); logits[:, :m] = paged_logits(m)    # (b) decode, max_len m <= W

Post-grad these are ``copy(full, x)`` and ``slice_scatter(full, x, dim, start, end, step)`` (possibly with the
``slice(full) -> copy`` pair in front of the scatter). The fill is dropped only with a proof:

(a) the write covers every element (``copy`` of the whole buffer, or a slice with start 0, step 1 and end >= the
    dim's size, proven symbolically without guards): the result is the written value itself (cast to the buffer's
    dtype / expanded to its shape when the ``copy`` does that).
(b) the written value is ``nsa.paged_mqa_logits(..., max_len=m, ...)`` of shape ``[R, m]``, written into columns
    ``[0, m)`` of a ``[R, W]`` fp32 buffer filled with -inf, with ``m <= W`` and ``m >= max_pages * page_size``
    (the block table's reach). DESIGN §4: that op writes every element, -inf past each row's visible keys, and a
    row never sees keys beyond its block table, so ``paged_mqa_logits(..., max_len=W)`` is the same ``[R, W]``
    tensor: the op is called once with ``max_len=W`` and writes the whole buffer (the op allocates with ``empty``).

In both cases the buffer must not be read by anything but the one write (a slice of it that is only the
destination of a ``copy`` is no read). Whatever fails is kept and reported as a near miss for -inf buffers.
Inductor already drops ``slice_scatter``s whose source has the buffer's full shape before this pass runs; those
are not counted here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

from ..pass_manager import PassContext, PassResult
from .graph_utils import (VIEW_OPS, as_int, copy_destination_only, describe, erase_dead, insert_call, is_op, known_ge,
                          norm_dim, same_shape, slice_params, sym_equal, sym_value, tensor_val)

aten = torch.ops.aten
prims = torch.ops.prims

_WRITES = (aten.slice_scatter.default, aten.select_scatter.default, aten.copy.default)


def _op_args(node: torch.fx.Node) -> dict[str, Any] | None:
    """Arguments of a call by schema name (positional and keyword)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
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


def _source(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """The value written, through reshapes to the same shape and ``copy(dst, s)`` of equal shape and dtype; the nodes
    on the way (each must have a single user for the producer to be replaceable)."""
    chain = [node]
    while True:
        if is_op(node, *VIEW_OPS) or is_op(node, aten.clone.default, aten.alias.default):
            node = node.args[0]
        elif is_op(node, aten.copy.default):
            dst, src = node.args[0], node.args[1]
            td, ts = tensor_val(dst), tensor_val(src)
            if td is None or ts is None or td.dtype != ts.dtype or not same_shape(dst, src):
                return node, chain
            node = src
        else:
            return node, chain
        chain.append(node)


def _fill_is_neg_inf(full: torch.fx.Node) -> bool:
    fill = full.args[1] if len(full.args) > 1 else full.kwargs.get("fill_value")
    return isinstance(fill, (int, float)) and math.isinf(fill) and fill < 0


class EmptyLogitsBuffer:
    name = "empty_logits_buffer"

    def __call__(self, graph: torch.fx.Graph, ctx: PassContext | None = None) -> PassResult:
        result = PassResult()
        for full in list(graph.nodes):
            if full.graph is not graph or not is_op(full, aten.full.default):
                continue
            tf = tensor_val(full)
            if tf is None or tf.dim() == 0:
                continue
            writes, reads = _classify_users(full)
            if not writes:
                continue  # a constant used as a value (e.g. in ``where``), not a buffer
            report = _fill_is_neg_inf(full)
            reason = None
            if reads:
                reason = (f"buffer {full.name} is read by {', '.join(describe(r) for r in reads)} before it is "
                          "written")
            elif len(writes) > 1:
                reason = (f"buffer {full.name} is the base of {len(writes)} separate writes "
                          f"({', '.join(describe(w) for w in writes)}); each needs the fill")
            else:
                reason = self._rewrite(graph, full, writes[0])
                if reason is None:
                    result.matched += 1
                    continue
            if report:
                result.miss(full, reason)
        return result

    # -----------------------------------------------------------------------------------------------------------

    def _rewrite(self, graph: torch.fx.Graph, full: torch.fx.Node, write: torch.fx.Node) -> str | None:
        """Replace ``write`` (the only consumer of ``full``'s fill) when it provably overwrites every element."""
        tf = tensor_val(full)
        src = write.args[1]
        ts = tensor_val(src)
        if ts is None:
            return f"no fake tensor metadata on {src}"
        if is_op(write, aten.copy.default):
            return self._replace_whole(graph, full, write, src)
        if is_op(write, aten.select_scatter.default):
            dim = norm_dim(write.args[2], tf.dim())
            if not sym_equal(tf.shape[dim], 1):
                return (f"partial write: {describe(write)} writes one index of dim {dim} (size {tf.shape[dim]}), "
                        "the rest keeps the fill")
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

    def _replace_whole(self, graph, full, write, src) -> str | None:
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
                    return f"full-range write {describe(write)} with a source of another shape {list(ts.shape)}"
            if ts.dtype != tf.dtype:
                new = insert_call(graph, prims.convert_element_type.default, (new, tf.dtype))
        write.replace_all_uses_with(new)
        erase_dead(graph, [write])
        return None

    def _replace_paged(self, graph, full, write, params) -> str | None:
        tf = tensor_val(full)
        dim, start, end, step = params
        partial = (f"partial write: {describe(write)} covers (dim, start, end, step) = "
                   f"({dim}, {sym_value(start)}, {sym_value(end)}, {sym_value(step)}) of a buffer of shape "
                   f"{list(tf.shape)}")
        op = torch.ops.nsa.paged_mqa_logits.default
        producer, chain = _source(write.args[1])
        if producer.target is not op:
            return f"{partial}, and the writer {describe(producer)} is not known to write -inf in the rest"
        args = _op_args(producer)
        tl = tensor_val(producer)
        if args is None or tl is None:
            return f"{partial}: cannot read the arguments of {describe(producer)}"
        if not _fill_is_neg_inf(full) or tf.dtype != torch.float32 or tl.dtype != torch.float32:
            return f"{partial}: the buffer is not an fp32 -inf fill ({tf.dtype}, fill {full.args[1]})"
        if tf.dim() != 2 or dim != 1 or not sym_equal(start, 0) or not sym_equal(step, 1):
            return f"{partial}: paged logits fill whole rows from column 0 of a 2-D buffer only"
        if not same_shape(producer, write.args[1]) or not sym_equal(tl.shape[0], tf.shape[0]):
            return (f"{partial}: the logits {list(tl.shape)} are reshaped before the write "
                    f"({list(tensor_val(write.args[1]).shape)})")
        max_len, width = args["max_len"], full.args[0][1]
        if not known_ge(end, max_len):
            return f"{partial}: the write ends at {sym_value(end)}, before the logits' max_len {sym_value(max_len)}"
        if not known_ge(width, max_len):
            return f"{partial}: max_len {sym_value(max_len)} is not provably <= the buffer width {sym_value(width)}"
        pages = tensor_val(args["block_table"]).shape[1]
        reach = pages * args["page_size"]
        if not known_ge(max_len, reach):
            return (f"{partial}: max_len {sym_value(max_len)} is not provably >= the block table's reach "
                    f"(max_pages {sym_value(pages)} * page_size {sym_value(args['page_size'])}); longer contexts "
                    "would gain columns")
        for node in chain[:-1]:
            if len(node.users) != 1:
                return f"{partial}: {describe(node)} has other users besides the write"
        if len(producer.users) != 1:
            return f"{partial}: the logits {describe(producer)} are also used elsewhere at width {sym_value(max_len)}"
        names = [a.name for a in producer.target._schema.arguments]
        new_args = tuple(width if n == "max_len" else args[n] for n in names)
        with graph.inserting_before(write):
            new = insert_call(graph, op, new_args)
        write.replace_all_uses_with(new)
        erase_dead(graph, [write])
        return None


PASS = EmptyLogitsBuffer()
