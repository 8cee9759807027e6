"""A 128x128 rotation (the indexer's Hadamard) feeding act_quant -> the rotation inside the quantising kernel.

Eager idiom (``Indexer.rotate_activation``, DeepSeek's and SGLang's reference), in any of these spellings::

    y = (x.float() @ H * 128**-0.5).to(torch.bfloat16)    # fp32 GEMM with casts; F.linear(x.float(), H.T) / c too
    y = F.linear(x, H_bf16)    or    y = x @ H_bf16        # bf16 GEMM, one rounding of the fp32 sum
    q_fp8, q_scale = act_quant(y)                         # q side: any leading shape, any group size
    act_quant(y) -> K-cache store                         # k side: already nsa.quant_cache_store

Matches act_quant (``fx_utils.match_act_quant``) of a bf16 tensor that is the product of a bf16 ``x`` and a matrix
``H`` of static shape [128, 128] that is a graph input (parameter, buffer) or a constant, possibly transposed or
cast to fp32, optionally times or divided by a constant, and rounded to bf16. Its values need no proof: the kernel
multiplies by whatever matrix it gets. Every node between ``x`` and the quantized outputs must be read only by the
next one.
Rewrites to ``nsa.rotate_act_quant(x, H, c, ...)`` (q side; its scale output feeds the head-gate chain unchanged),
or gives the ``nsa.quant_cache_store`` that ``quant_cache_store`` made (with its ``(y * c).to(bf16)`` epilogue
already folded in) ``k = x, rotation = H`` (k side). Never: an unrounded fp32 result, a bf16 product scaled
afterwards (two roundings), a matrix of another shape or computed in the graph.
Numerics: the products are summed in another order than cuBLAS's (docs/numerics.md); ``nsa.disable_passes`` with
this pass's name keeps eager's bytes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from ..quant import ROTATED_QUANT_BLOCKS
from .base import GraphPass, NearMiss, PassContext
from .fx_utils import (ActQuant, aten, cone, describe, insert_call, is_op, is_store, live_users, match_act_quant, prims,
                       replace, val, view_chain, walk_back)

ROTATION_SIZE = 128


@dataclass
class Rotation:
    """``((x.float() @ matrix) * scale)`` (``/ scale`` with ``divide``) rounded to bf16: the nodes from ``x`` to the
    rounded result."""

    x: torch.fx.Node  # bf16 [..., 128]
    matrix: torch.fx.Node  # [128, 128] fp32 or bf16, any strides
    scale: float
    divide: bool
    chain: list[torch.fx.Node]  # every node after x and matrix up to the result, each read only by the next


def _single_use(nodes: list[torch.fx.Node], what: str) -> None:
    for node in nodes:
        if len(live_users(node)) != 1:
            others = ", ".join(describe(u) for u in live_users(node))
            raise NearMiss(f"{describe(node)} of {what} is also read elsewhere ({others}): fusing would keep its GEMM")


def _static_matrix(node: torch.fx.Node) -> torch.fx.Node:
    """The rotation operand as the kernel reads it: a [128, 128] graph input or constant, maybe transposed
    (``F.linear``'s weight) or cast from bf16 to fp32 (exact: the kernel reads the bf16 matrix instead)."""
    if is_op(node, prims.convert_element_type.default) and val(node.args[0]).dtype == torch.bfloat16:
        node = node.args[0]
    root = walk_back(node, lambda n: n.args[0] if is_op(n, aten.permute.default, aten.t.default) or (
        is_op(n, prims.convert_element_type.default) and val(n.args[0]).dtype == torch.bfloat16) else None)[0]
    mval = val(root)
    if root.op not in ("placeholder", "get_attr") or not isinstance(mval, torch.Tensor):
        raise NearMiss(f"the rotation matrix {describe(root)} is computed in the graph, not a parameter, buffer or "
                       "constant")
    if tuple(mval.shape) != (ROTATION_SIZE, ROTATION_SIZE) or not all(isinstance(s, int) for s in mval.shape):
        raise NearMiss(f"the rotation matrix is {list(mval.shape)}, not a static [128, 128]")
    if mval.dtype not in (torch.float32, torch.bfloat16):
        raise NearMiss(f"the rotation matrix is {mval.dtype}, not float32 or bfloat16")
    return node


def _product(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, list[torch.fx.Node]]:
    """``node = reshape(mm(reshape(x'), H))`` with ``x' = x`` (bf16 product) or ``x.float()`` (fp32 product):
    ``(x, matrix, chain)``."""
    mm, after = view_chain(node)
    if not is_op(mm, aten.mm.default):
        raise NearMiss(f"the quantized tensor is not a product with a matrix ({describe(mm)})")
    lhs, before = view_chain(mm.args[0])
    out_dtype = val(mm).dtype
    if out_dtype == torch.float32:
        if not is_op(lhs, prims.convert_element_type.default) or val(lhs.args[0]).dtype != torch.bfloat16:
            raise NearMiss("the fp32 product's left operand is not a bf16 tensor cast to fp32")
        before = [lhs, *before]
        lhs = lhs.args[0]
    elif out_dtype != torch.bfloat16 or val(lhs).dtype != torch.bfloat16:
        raise NearMiss(f"the product is {out_dtype}, not a bf16 x times a float32 or bfloat16 matrix")
    if int(val(mm.args[0]).shape[-1]) != ROTATION_SIZE or int(val(lhs).shape[-1]) != ROTATION_SIZE:
        raise NearMiss(f"the product's left operand is {list(val(mm.args[0]).shape)}, not rows of 128")
    return lhs, _static_matrix(mm.args[1]), [*before, mm, *after]


def match_rotation(rotated: torch.fx.Node) -> Rotation:
    """Prove ``rotated`` (bf16) is ``((x.float() @ H) * c).to(bf16)`` or ``x @ H`` in bf16."""
    if val(rotated).dtype != torch.bfloat16:
        raise NearMiss(f"the quantized tensor is {val(rotated).dtype}, not the bf16 result of a rotation")
    if not is_op(rotated, prims.convert_element_type.default):
        x, matrix, chain = _product(rotated)
        return Rotation(x, matrix, 1.0, False, chain)
    inner, scale, scaled = rotated.args[0], 1.0, []
    divide = is_op(inner, aten.div.Tensor)
    if is_op(inner, aten.mul.Tensor, aten.div.Tensor) and isinstance(inner.args[1], (int, float)) and inner.args[1]:
        inner, scale, scaled = inner.args[0], float(inner.args[1]), [inner]
    else:
        divide = False
    if val(inner).dtype != torch.float32:
        raise NearMiss(f"the rotated tensor is rounded to bf16 from {val(inner).dtype}, not from an fp32 product")
    x, matrix, chain = _product(inner)
    return Rotation(x, matrix, scale, divide, [*chain, *scaled, rotated])


def _rotation_of_store(stored: torch.fx.Node) -> Rotation:
    """The rotation that produces a store's ``k``: the fp32 product under an already folded ``(y * c).to(bf16)``
    epilogue, or a whole rotation (bf16 ``k``, no epilogue)."""
    k, scale, dtype = stored.kwargs["k"], stored.kwargs.get("input_scale", 1.0), stored.kwargs.get("input_dtype")
    if dtype == torch.bfloat16 and val(k).dtype == torch.float32:
        x, matrix, chain = _product(k)
        return Rotation(x, matrix, scale, stored.kwargs.get("input_divide", False), chain)
    if dtype is None and scale == 1.0:
        return match_rotation(k)
    raise NearMiss(f"the stored k is {val(k).dtype} with input_dtype {dtype}: not the result of a rotation")


class RotateActQuant(GraphPass):
    name = "rotate_act_quant"
    may_change_cache_bytes = True

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext):
        for node in list(graph.nodes):
            if is_op(node, prims.convert_element_type.default) and val(node).dtype in (
                    torch.float8_e4m3fn, torch.float8_e4m3fnuz):
                yield node
            elif is_store(node) and node.kwargs.get("rotation") is None:
                yield node

    def rewrite(self, graph: torch.fx.Graph, anchor: torch.fx.Node, ctx: PassContext) -> torch.fx.Node:
        if is_store(anchor):
            rotation = _rotation_of_store(anchor)
            _single_use(rotation.chain, "the rotation")
            anchor.kwargs = {**anchor.kwargs, "k": rotation.x, "rotation": rotation.matrix,
                             "input_scale": rotation.scale, "input_divide": rotation.divide,
                             "input_dtype": torch.bfloat16}
            return anchor
        quant = match_act_quant(anchor)
        rotation = match_rotation(quant.x)
        if quant.block not in ROTATED_QUANT_BLOCKS:
            raise NearMiss(f"quant block is {quant.block} wide, the fused kernel quantizes groups of "
                           f"{ROTATED_QUANT_BLOCKS}")
        _single_use(rotation.chain + _quant_private(quant), "the rotation")
        with graph.inserting_before(quant.scale):  # before every reader of either output
            fused = insert_call(graph, torch.ops.nsa.rotate_act_quant.default,
                                (rotation.x, rotation.matrix, rotation.scale, rotation.divide, quant.block,
                                 quant.scale_fmt, quant.fp8_dtype, quant.fp8_max))
            values = insert_call(graph, operator.getitem, (fused, 0))
            scales = insert_call(graph, operator.getitem, (fused, 1))
        # (not before the old scale: replacing the values erases it where only they read it)
        with graph.inserting_after(scales):
            replace(graph, quant.values, values)
            replace(graph, quant.scale, scales)
        return fused

    def finish(self, graph: torch.fx.Graph, rewritten: list[torch.fx.Node]) -> None:
        graph.eliminate_dead_code()


def _quant_private(quant: ActQuant) -> list[torch.fx.Node]:
    """The nodes from the rotated tensor to act_quant's blocks (fp32 cast, reshapes), after checking that act_quant's
    own nodes are read only inside it (its outputs, values and scale, may be read anywhere: they are replaced)."""
    blocks = quant.values.args[0]
    while not is_op(blocks, aten.div.Tensor):
        blocks = blocks.args[0]
    blocks = blocks.args[0]
    inner = set(cone(quant.values, [blocks]) or ()) | set(cone(quant.scale, [blocks]) or ())
    inner -= {quant.values, quant.scale}
    for node in [blocks, *inner]:
        outside = [u for u in live_users(node) if u not in inner and u is not quant.values and u is not quant.scale]
        if outside:
            raise NearMiss(f"{describe(node)} of the act_quant is also read by {describe(outside[0])}: fusing would "
                           "keep its GEMM")
    return walk_back(blocks, lambda n: n.args[0] if n is not quant.x else None)[1][:-1]
