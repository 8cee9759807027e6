"""A GEMM whose operands Inductor's ``pad_mm`` padded with zeros -> the GEMM as the model wrote it.

``pad_mm`` (a joint-graph pass, before ours, GPUs only) pads a GEMM's unaligned sizes (rows, K or columns not a
multiple of 8 in bf16, 4 in fp32) where its benchmark finds the padded GEMM faster, and cuts the product back (see
``padded`` below). In the indexer only token counts are unaligned, and its choice there flips from run to run, so
without this pass the rewrites that take a GEMM (the rotation, the head gate, wk, the prefill logits) fired or not
depending on a timing. Running first, this pass gives them the GEMM eager runs.

Matches ``mm`` / ``bmm`` of operands of which at least one is ``constant_pad_nd`` with zeros on the right of its last
two dimensions (both by the same amount along K), whose product is read only through slices from 0 that cut it back
to the unpadded size. Rewrites to the GEMM of the unpadded operands: each kept entry is the same dot product, the
padding only added zero terms. Never: a pad with another value, on the left or of a batch dimension, a product read
past the unpadded rows or columns, or read by anything else as well.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from .base import GraphPass, NearMiss, PassContext
from .fx_utils import arg, as_int, describe, insert_call, is_op, live_users, slice_params, tensor_val

aten = torch.ops.aten


def padded(a: torch.Tensor, b: torch.Tensor, m: int, k: int, n: int) -> torch.Tensor:
    """What ``pad_mm`` leaves for ``a @ b`` (rows padded by ``m``, K by ``k``, columns by ``n``)."""
    product = torch.mm(F.pad(a, (0, k, 0, m)), F.pad(b, (0, n, 0, k)))
    return product[: product.shape[0] - m, : product.shape[1] - n]


def replacement(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b)


def _zero_padding(operand: torch.fx.Node, ndim: int) -> tuple[torch.fx.Node, tuple[int, int]]:
    """``(unpadded, (rows added, columns added))`` of a GEMM operand: ``constant_pad_nd`` with zeros on the right of
    its last two dimensions, or the operand itself with ``(0, 0)``."""
    if not is_op(operand, aten.constant_pad_nd.default):
        return operand, (0, 0)
    pad = [as_int(p) for p in operand.args[1]]
    pad += [0] * (2 * ndim - len(pad))
    if arg(operand, 2, "value", 0) != 0 or None in pad or any(pad[4:]) or pad[0] or pad[2] or min(pad) < 0:
        raise NearMiss(f"{describe(operand)} pads with {operand.args[1]} and value {arg(operand, 2, 'value', 0)}, "
                       "not zeros on the right of the last two dimensions")
    return operand.args[0], (pad[3], pad[1])


def _cut_back(gemm: torch.fx.Node, sizes: tuple) -> torch.fx.Node:
    """The node that reads ``gemm``'s product cut back to ``sizes`` through slices from 0 (each read only by the
    next; a slice may also keep its dimension whole): every read of the product goes through it."""
    node = gemm
    while tuple(tensor_val(node).shape) != sizes:
        users = live_users(node)
        if len(users) != 1 or not is_op(users[0], aten.slice.Tensor):
            raise NearMiss(f"the padded product {describe(gemm)} is read by "
                           f"{', '.join(map(describe, users)) or 'nothing'}, not only through slices back to "
                           f"{list(sizes)}")
        before, node = tensor_val(node).shape, users[0]
        dim, start, _, step = slice_params(node, 1)
        dim %= len(sizes)
        if start != 0 or step != 1 or tensor_val(node).shape[dim] not in (sizes[dim], before[dim]):
            raise NearMiss(f"{describe(node)} cuts the padded product {describe(gemm)} to other than its unpadded "
                           "rows and columns")
    return node


class UnpadGemm(GraphPass):
    name = "unpad_gemm"

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext | None):
        for node in list(graph.nodes):
            if is_op(node, aten.mm.default, aten.bmm.default) and any(
                    is_op(a, aten.constant_pad_nd.default) for a in node.args[:2]):
                yield node

    def reported(self, gemm: torch.fx.Node, miss: NearMiss) -> bool:
        """A padded product that no slice reads is the model's own padding (``pad_mm`` cuts back every padded row or
        column; a product padded along K alone never misses): no report."""
        return any(is_op(user, aten.slice.Tensor) for user in live_users(gemm))

    def rewrite(self, graph: torch.fx.Graph, gemm: torch.fx.Node, ctx: PassContext | None) -> torch.fx.Node:
        ndim = tensor_val(gemm).dim()
        a, (m, k_a) = _zero_padding(gemm.args[0], ndim)
        b, (k_b, n) = _zero_padding(gemm.args[1], ndim)
        if k_a != k_b:
            raise NearMiss(f"{describe(gemm)}'s operands are padded along K by {k_a} and {k_b}")
        shape = tuple(tensor_val(gemm).shape)
        sizes = (*shape[:-2], shape[-2] - m, shape[-1] - n)
        if any(as_int(s) is None for s in sizes):
            raise NearMiss(f"{describe(gemm)} has symbolic sizes {list(shape)}")
        cut = _cut_back(gemm, sizes)
        with graph.inserting_before(gemm):
            plain = insert_call(graph, gemm.target, (a, b))
        cut.replace_all_uses_with(plain)
        return plain

    def finish(self, graph: torch.fx.Graph, rewritten: list[torch.fx.Node]) -> None:
        graph.eliminate_dead_code()
