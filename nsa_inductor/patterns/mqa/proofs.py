"""Proof that a candidate ``where(mask, Σ_h w * relu(dot(q, k)) * k_scale, -inf)`` computes decode or prefill MQA
logits, checked by probing sampled output elements ``(row, col)`` for every head and every dot index:

- mask: exactly ``col <= ctx[b] - next_n + j`` (decode) or ``cu[seq(row)] <= col <= row`` (prefill); a decode sum
  may be written into the leading columns of a wider -inf buffer first, the mask then ``& col < max_pages * P``;
- head sum: a sum over one head axis of a product tree holding ``relu(dot)``, ``k_scale`` and ``weights``
  (``k_scale`` and numbers may instead multiply the sum, ``Σ_h (w * relu(dot)) * k_scale``: the same terms), their
  mean over the heads (the sum times 1/H), or a bmm/mm contracting the heads of two such trees (an einsum of
  ``relu(dot) * k_scale`` with the weights);
- dot: a bmm/mm of fp8 -> fp32 upcasts of q (row ``row``, head ``h``, every dim ``d`` once) and of K;
- weights: an fp32 ``[rows, H]`` tensor indexed ``(row, h)``;
- K read: K's bytes and k_scale's 4 bytes at the layout's offsets of ``slot = block_table[b, s // P] * P + s % P``
  (decode: ``b = row // next_n``, ``s = col``; prefill: key ``col`` is token ``col - cu[seq]`` of sequence ``seq``).
Anything else raises :class:`NearMiss` with the reason (and, when known, the family it belongs to).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...layout import HEAD_DIM, KCacheLayout
from ...quant import FP8_DTYPES
from ..base import NearMiss
from ..fx_utils import VIEW_OPS, arg, as_int, describe, is_op, norm_dim, prims, same_shape, slice_params, tensor_val, \
    val, view_chain
from .probe import INT_DTYPES, RESHAPES, Prober, Probes, bmap, follow, linear, shape_of, unravel

aten = torch.ops.aten

MASK_SAMPLES = 4096
DOT_SAMPLES = 48
WHERES = (aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther)
REINDEX = RESHAPES + (aten.permute.default, aten.expand.default)
HEAD_SUMS = (aten.sum.dim_IntList, aten.mean.dim)  # a mean: the sum times 1/H, folded into the weights


# ---------------------------------------------------------------------------------------------------------------
# candidates
# ---------------------------------------------------------------------------------------------------------------


def constant_number(x: Any) -> float | None:
    """The value of a number, or of a ``full`` / ``scalar_tensor`` of one (how a traced fill arrives); else None."""
    if is_op(x, aten.full.default, aten.scalar_tensor.default):
        x = x.args[1] if is_op(x, aten.full.default) else x.args[0]
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def is_neg_inf(x: Any) -> bool:
    return constant_number(x) == float("-inf")


def cache_values(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes whose bytes are a K cache: uint8 graph inputs and the values copied back into them (after a store)."""
    leaves = set()
    for node in graph.nodes:
        v = val(node)
        if node.op == "placeholder" and isinstance(v, torch.Tensor) and v.dtype == torch.uint8:
            leaves.add(node)
        if is_op(node, aten.copy_.default) and node.args[0].op == "placeholder":
            dst, src = node.args[0], node.args[1]
            if val(dst) is not None and val(dst).dtype == torch.uint8 and isinstance(src, torch.fx.Node) \
                    and val(src) is not None and tuple(val(src).shape) == tuple(val(dst).shape):
                leaves.add(src)
    return leaves


def product_tree(node: torch.fx.Node, numel: int | None = None) -> tuple[list[torch.fx.Node], list[Any]]:
    """Tensor factors and scalar factors of a tree of ``mul``s (through re-indexing) at full size: a smaller
    (broadcast) mul is one factor, e.g. the weights computed as ``gates * q_scale * c``."""
    numel = val(node).numel() if numel is None else numel
    node = view_chain(node, REINDEX)[0]
    if is_op(node, aten.mul.Tensor) and statically_known_true(val(node).numel() == numel):
        tensors, scalars = [], []
        for a in node.args[:2]:
            if isinstance(a, torch.fx.Node) and isinstance(val(a), torch.Tensor) and val(a).dim() > 0:
                t, s = product_tree(a, numel)
                tensors += t
                scalars += s
            else:
                scalars.append(a)
        return tensors, scalars
    return [node], []


def _is_zero(x: Any) -> bool:
    """The number 0, or a ``full`` of 0 (how a traced ``zeros_like`` or the scalar 0 of ``where`` arrives)."""
    if is_op(x, aten.full.default):
        x = x.args[1]
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0


def relu_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """``x`` of ``relu(x)`` spelled ``relu``, ``clamp_min(x, 0)``, ``maximum(x, 0)``, ``where(x > 0, x, 0)`` (or
    ``>=``), or ``where(x < 0, 0, x)`` (or ``<=``: ``masked_fill(x < 0, 0)``, ``threshold(x, 0, 0)``). At a NaN x
    they differ (0 or NaN; the GPU kernels' max gives 0), and at -0.0 in the zero's sign: a NaN q·k comes from NaN
    fp8 codes, whose row's scale is NaN too (docs/indices.md), and -0.0 and 0.0 are equal values."""
    if is_op(node, aten.relu.default) or (is_op(node, aten.clamp_min.default) and _is_zero(node.args[1])):
        return node.args[0]
    if is_op(node, aten.maximum.default):
        x, other = node.args if _is_zero(node.args[1]) else node.args[::-1]
    elif is_op(node, *WHERES) and _compared_with_zero(node.args[0], node.args[1], aten.gt.Scalar, aten.ge.Scalar):
        x, other = node.args[1:]
    elif is_op(node, *WHERES) and _compared_with_zero(node.args[0], node.args[2], aten.lt.Scalar, aten.le.Scalar):
        other, x = node.args[1:]
    else:
        return None
    if not (_is_zero(other) and isinstance(x, torch.fx.Node) and same_shape(x, node)):
        return None
    return x if val(x).dtype == val(node).dtype else None  # (a float64 0 would promote the scores)


def _compared_with_zero(cond: Any, x: Any, *compares) -> bool:
    """``cond`` is ``x <op> 0`` for one of ``compares``."""
    return is_op(cond, *compares) and cond.args[0] is x and _is_zero(cond.args[1])


def activated_dot(node: torch.fx.Node) -> torch.fx.Node | None:
    """The fp8 dot under ``node`` where ``node`` is some other function of it than relu (``abs``, ``gelu``'s
    terms, ``relu(dot) + c``, ``clamp(dot, 0, 6)``): followed through first operands, a few ops deep, for the near
    miss that names it."""
    for _ in range(4):
        if not isinstance(node, torch.fx.Node) or node.op != "call_function" or not node.args:
            return None
        node = view_chain(relu_input(node) or node.args[0], REINDEX)[0]
        if is_dot(node):
            return node if reads_fp8(node) else None
    return None


def _through(factors: list[torch.fx.Node]) -> str:
    """Where the fp8 dot reaches a product only through another function of it: the words that name it."""
    other = next((f for f in factors if not is_dot(f) and activated_dot(f) is not None), None)
    return "" if other is None else (f": the dot reaches the product through {describe(other)}, which is not relu, "
                                     "clamp_min(·, 0), maximum(·, 0) or where(· > 0, ·, 0)/where(· < 0, 0, ·)")


def is_dot(node: torch.fx.Node) -> bool:
    return is_op(node, aten.bmm.default, aten.mm.default)


def product_dots(sum_node: torch.fx.Node) -> list[torch.fx.Node]:
    """The dots among the factors of the product ``sum_node`` sums (inside relu or not); none where the summand is
    not a product of at least two factors."""
    factors, _ = product_tree(sum_node.args[0])
    inner = []
    for f in factors:
        r = relu_input(f)
        inner += [g if is_dot(g) else activated_dot(g) or g for g in (product_tree(r)[0] if r is not None else [f])]
    return [f for f in inner if is_dot(f)] if len(factors) >= 2 else []


def reads_fp8(dot: torch.fx.Node) -> bool:
    """Whether an operand of ``dot`` is fp8 values upcast (through re-indexing): the q·k of indexer logits, not a
    GEMM of bf16 or fp32 activations."""
    for operand in dot.args[:2]:
        source = view_chain(operand, REINDEX)[0]
        if is_op(source, prims.convert_element_type.default):
            values = tensor_val(source.args[0])
            if values is not None and values.dtype in FP8_DTYPES:
                return True
    return False


def written_into_neg_inf(node: torch.fx.Node, src: torch.fx.Node) -> torch.fx.Node | None:
    """The ``slice_scatter`` that writes ``src`` (itself, or through a ``copy`` of its shape and dtype) as the leading
    columns of a ``full(-inf)`` buffer's last dimension (``buf[..., :n] = src``), starting at ``node``; else None."""
    if is_op(node, aten.copy.default) and node.args[1] is src and len(node.users) == 1 and same_shape(node, src) \
            and val(node).dtype == val(src).dtype:
        src, (node,) = node, node.users
    if not is_op(node, aten.slice_scatter.default) or node.args[1] is not src or not is_neg_inf(node.args[0]):
        return None
    dim, start, _, step = slice_params(node, 2)
    return node if norm_dim(dim, val(node).dim()) == val(node).dim() - 1 and start == 0 and step == 1 else None


def mask_chain(sum_node: torch.fx.Node) -> tuple[torch.fx.Node | None, torch.fx.Node, dict]:
    """``(outermost -inf where or None, the last node of the chain, {mul or buffer write: the chain's node it
    takes})``: the head sum's single users through reshapes, permutes, -inf wheres, the write of the sum into the
    leading columns of a wider -inf buffer (its ``slice_scatter``) and, below the first where and that write, muls
    by a factor that keeps the shape (a ``k_scale`` multiplied after the sum; above either it would multiply the
    -inf too)."""
    where, cur, steps, widened = None, sum_node, {}, False
    while len(users := _value_users(cur)) == 1:
        (user,) = users
        scatter = written_into_neg_inf(user, cur)
        if is_op(user, *RESHAPES, aten.permute.default):
            cur = user
        elif is_op(user, *WHERES) and cur in user.args[1:] \
                and any(is_neg_inf(a) for a in user.args[1:] if a is not cur):
            where = cur = user
        elif scatter is not None:
            steps[scatter] = cur
            cur, widened = scatter, True
        elif where is None and not widened and is_op(user, aten.mul.Tensor) and user.args[0] is not user.args[1] \
                and statically_known_true(val(user).numel() == val(cur).numel()):
            steps[user] = cur
            cur = user
        else:
            break
    return where, cur, steps


def _value_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The users that read ``node``'s values: not its ``sym_size`` (under dynamic shapes a reshape's size is read
    from the tensor before it, e.g. an einsum's output view)."""
    return [u for u in node.users if not is_op(u, aten.sym_size.int)]


def candidates(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.fx.Node | None]]:
    """``(sum, outermost -inf where or None)`` for every head-sum (or mean) of a product holding a dot (inside relu
    or not), and for every bmm/mm with a relu of an fp8 dot in an operand's product (heads summed by an einsum with the
    weights)."""
    return [(node, mask_chain(node)[0]) for node in graph.nodes
            if is_op(node, *HEAD_SUMS) and product_dots(node) or is_dot(node) and any(
                isinstance(a, torch.fx.Node) and _holds_relu_of_fp8_dot(a) for a in node.args[:2])]


def _holds_relu_of_fp8_dot(node: torch.fx.Node) -> bool:
    return any(r is not None and any(is_dot(g) and reads_fp8(g) for g in product_tree(r)[0])
               for r in map(relu_input, product_tree(node)[0]))


def unmasked(sum_node: torch.fx.Node) -> NearMiss:
    """The near miss of a head sum with no -inf mask, naming where its chain of users stops."""
    end = mask_chain(sum_node)[1]
    users = ", ".join(f"{u.name} ({u.target})" for u in end.users) or "none (an output)"
    return NearMiss(f"the head-sum of relu(q·k) is not masked with -inf by a where/masked_fill: the mask must apply "
                    f"to the sum (through reshapes, factors multiplied onto it and its write into a wider -inf "
                    f"buffer), but {end.name}'s users are {users}")


# ---------------------------------------------------------------------------------------------------------------
# the proofs
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Match:
    family: str  # "decode" | "prefill"
    where: torch.fx.Node
    q: torch.fx.Node  # fp8 q values, linear index ((row * H) + h) * 128 + d
    weights: list[torch.fx.Node]  # fp32 factors whose product is the weights, each at linear index row * H + h
    heads: int
    rows: int
    keys: int
    cache: torch.fx.Node | None = None
    block_table: torch.fx.Node | None = None
    lens: torch.fx.Node | None = None  # context_lens (decode) / cu_seqlens (prefill)
    # prefill K already gathered by the model: fp8 [N, 128] and fp32 [N] nodes read at key n (the gather stays)
    k_plain: tuple[torch.fx.Node, torch.fx.Node] | None = None
    cached_prefill: bool = False  # the prefill K read is proven to be the cache read of cu_seqlens' sequences
    bounds: tuple[torch.fx.Node | None, torch.fx.Node] | None = None  # prefill (ks or None for 0, ke) graph inputs
    row_lens: torch.fx.Node | None = None  # decode: keys visible to each query row, a graph input [rows]
    weight_scale: float = 1.0  # number factors of the head-sum product, folded into the weights


@dataclass
class Samples:
    """Sampled output elements of the masked logits and what the proofs learnt about them so far."""

    rows: int
    keys: int
    batch: int | None
    probes: Probes
    prober: Prober
    row: torch.Tensor  # every sample
    col: torch.Tensor
    visible: torch.Tensor | None = None  # the mask at every sample
    # the head-sum subset (``DOT_SAMPLES`` samples, each repeated for every head)
    sum_node: torch.fx.Node | None = None
    # the summed product's trees and their coordinates: one for a sum, a bmm/mm's two operands
    roots: list[tuple[torch.fx.Node, torch.Tensor]] | None = None
    heads: int = 0
    m: int = 0
    s_row: torch.Tensor | None = None
    s_col: torch.Tensor | None = None
    pick: torch.Tensor | None = None  # which samples the head-sum subset took
    written: torch.Tensor | None = None  # the samples inside the columns the sum was written to (all, if not widened)
    widened: bool = False  # the sum was written into a wider -inf buffer


def sample_outputs(where: torch.fx.Node, layout: KCacheLayout, leaves: set[torch.fx.Node]
                   ) -> tuple[Samples, torch.Tensor]:
    """Probe inputs, and output elements at the edges, page boundaries and random (with their coordinates)."""
    out_shape = shape_of(where)
    if len(out_shape) < 2:
        raise NearMiss(f"masked logits {where.name} have rank {len(out_shape)}, expected [rows, keys]")
    keys, rows = out_shape[-1], math.prod(out_shape[:-1])
    if rows == 0 or keys == 0:
        raise NearMiss(f"masked logits {where.name} {list(out_shape)} hold no element (an empty batch): nothing to "
                       f"compute")
    block_tables = [n for n in where.graph.nodes if n.op == "placeholder" and isinstance(val(n), torch.Tensor)
                    and val(n).dtype in INT_DTYPES and val(n).dim() == 2]
    batch = shape_of(block_tables[0])[0] if len(block_tables) == 1 else None
    cache_pages = max([1] + [math.prod(shape_of(leaf)) // layout.page_bytes for leaf in leaves])
    max_seq = shape_of(block_tables[0])[1] * layout.page_size if len(block_tables) == 1 else None
    probes = Probes(batch, cache_pages, keys, torch.Generator().manual_seed(1234), max_seq)
    n_out = rows * keys
    if n_out <= MASK_SAMPLES:
        lin = torch.arange(n_out)
    else:
        edge_cols = torch.tensor([0, 1, keys - 1] + [c for p in (layout.page_size, 16) for c in (p - 1, p, p + 1)
                                                     if c < keys])
        edge_rows = torch.tensor(sorted({0, rows - 1, rows // 2}))
        edges = (edge_rows[:, None] * keys + edge_cols[None, :]).flatten()
        lin = torch.cat([edges, torch.randint(0, n_out, (MASK_SAMPLES,), generator=probes.gen)])
    s = Samples(rows, keys, batch, probes, Prober(probes, leaves), lin // keys, lin % keys)
    return s, unravel(lin, out_shape)


def peel_mask(s: Samples, where: torch.fx.Node, sum_node: torch.fx.Node, coords: torch.Tensor, steps: dict
              ) -> tuple[torch.Tensor, list[tuple[Any, torch.Tensor]]]:
    """Evaluate the -inf wheres between ``where`` and the head sum (``s.visible``): the coordinates at the sum, and
    the factors the muls of ``steps`` (:func:`mask_chain`) multiply onto it with the coordinates each is read at."""
    s.visible = torch.ones(coords.shape[0], dtype=torch.bool)
    s.written = torch.ones(coords.shape[0], dtype=torch.bool)
    after = []
    cur, cur_coords = where, coords
    while cur is not sum_node:
        if cur in steps and is_op(cur, aten.slice_scatter.default):  # past the written columns: the buffer's -inf
            width = shape_of(steps[cur])[-1]
            s.written &= cur_coords[:, -1] < width
            s.visible &= s.written
            s.widened = True
            cur_coords = cur_coords.clone()
            cur_coords[:, -1] = cur_coords[:, -1].clamp(max=width - 1)
            cur = steps[cur]
        elif is_op(cur, *WHERES):
            cond, a, b = cur.args
            keep_self = not is_neg_inf(a)
            cond_val = s.prober.value(cond, bmap(cur_coords, shape_of(cond))).bool()
            s.visible &= cond_val if keep_self else ~cond_val
            nxt = a if keep_self else b
            cur, cur_coords = nxt, bmap(cur_coords, shape_of(nxt))
        elif cur in steps:  # a mul
            (factor,) = [a for a in cur.args[:2] if a is not steps[cur]]
            tensor = isinstance(factor, torch.fx.Node) and isinstance(val(factor), torch.Tensor)
            after.append((factor, bmap(cur_coords, shape_of(factor)) if tensor else None))
            cur, cur_coords = steps[cur], bmap(cur_coords, shape_of(steps[cur]))
        cur, cur_coords = follow(cur, cur_coords)
        if cur is not sum_node and not is_op(cur, *WHERES) and cur not in steps:
            raise NearMiss(f"between the mask and the head sum: {cur.name} ({cur.target})")
    return cur_coords, after


def prove_head_sum(s: Samples, sum_node: torch.fx.Node, sum_coords: torch.Tensor) -> None:
    """One summed (head) axis of static size: a sum's, or the contraction of a bmm/mm; picks the dot samples and
    their coordinates in the summed product's trees."""
    if is_dot(sum_node):
        x_shape, red = shape_of(sum_node.args[0]), -1
    else:
        x, dims, keepdim = sum_node.args[0], sum_node.args[1], arg(sum_node, 2, "keepdim", False)
        if arg(sum_node, 3, "dtype", None) not in (None, val(x).dtype):
            raise NearMiss(f"{sum_node.name} sums in {arg(sum_node, 3, 'dtype', None)}, not the product's dtype")
        x_shape = shape_of(x)
        if dims is None or len(dims) != 1:
            raise NearMiss(f"{sum_node.name} reduces {dims}, expected exactly one (head) axis")
        red = dims[0] % len(x_shape)
    heads = x_shape[red]
    if not isinstance(val(sum_node.args[0]).shape[red], int):
        raise NearMiss("the summed axis has a symbolic size")
    written = s.written.nonzero().squeeze(1)  # (a sample past the columns the sum was written to reads no sum)
    n = written.shape[0]
    if n == 0:
        raise NearMiss("no sampled element lies in the columns the head sum was written to")
    m = min(DOT_SAMPLES, n)
    pick = written[torch.cat([torch.arange(min(8, m)), torch.randperm(n, generator=s.probes.gen)[: m - min(8, m)]])]
    base = sum_coords[pick].repeat_interleave(heads, 0)
    hcol = torch.arange(heads).repeat(m)[:, None]
    if is_dot(sum_node):  # out[..., i, j] = Σ_h a[..., i, h] * b[..., h, j]
        roots = [(sum_node.args[0], torch.cat([base[:, :-1], hcol], 1)),
                 (sum_node.args[1], torch.cat([base[:, :-2], hcol, base[:, -1:]], 1))]
    elif keepdim:
        base[:, red] = hcol[:, 0]
        roots = [(x, base)]
    else:
        roots = [(x, torch.cat([base[:, :red], hcol, base[:, red:]], 1))]
    s.sum_node, s.roots, s.heads, s.m, s.pick = sum_node, roots, heads, m, pick
    s.s_row, s.s_col = s.row[pick].repeat_interleave(heads), s.col[pick].repeat_interleave(heads)


def prove_factors(roots: list[torch.fx.Node]) -> tuple[torch.fx.Node, list[tuple[torch.fx.Node, bool]], float]:
    """The product of the trees ``roots`` is ``relu(dot * ...) * ...`` with one relu and one dot: ``(dot, [(other
    factor, inside relu)], product of the number factors outside the relu)``; those numbers (a scale chain Inductor
    left unfolded, e.g. ``* H**-0.5 * D**-0.5`` of the gate) are folded into the weights by the rewrite."""
    factors, scalars = [], []
    for root in roots:
        tensors, numbers = product_tree(root)
        factors += tensors
        scalars += numbers
    if not all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in scalars):
        raise NearMiss(f"scalar factor(s) {scalars} in the head-sum product: only finite numbers are folded")
    weight_scale = math.prod(scalars, start=1.0)
    relus = [f for f in factors if relu_input(f) is not None]
    if not relus:
        raise NearMiss(f"no relu on the q·k scores{_through(factors)}")
    if len(relus) > 1:
        raise NearMiss("more than one relu factor in the head-sum product")
    inner, inner_scalars = product_tree(relu_input(relus[0]))
    if inner_scalars:
        raise NearMiss(f"scalar factor(s) {inner_scalars} inside the relu")
    dots = [f for f in inner if is_dot(f)]
    if len(dots) != 1:
        raise NearMiss(f"{len(dots)} bmm/mm factors inside the relu, expected one{_through(inner)}")
    others = [(f, False) for f in factors if f is not relus[0]] + [(f, True) for f in inner if f is not dots[0]]
    return dots[0], others, weight_scale


def factor_coords(s: Samples, target: torch.fx.Node) -> torch.Tensor:
    """The head-sum samples' coordinates carried down to ``target`` (a factor) through the mul tree and re-indexing."""

    def walk(node, c):
        if node is target:
            return c
        node2, c2 = follow(node, c)
        if node2 is target:
            return c2
        if is_op(node2, aten.mul.Tensor):
            for a in node2.args[:2]:
                if isinstance(a, torch.fx.Node) and isinstance(val(a), torch.Tensor):
                    r = walk(a, bmap(c2, shape_of(a)))
                    if r is not None:
                        return r
        r_in = relu_input(node2)
        return walk(r_in, c2) if r_in is not None else None

    found = next((c for c in (walk(root, coords) for root, coords in s.roots) if c is not None), None)
    if found is None:
        raise NearMiss(f"could not trace {target.name} in the product")
    return found


@dataclass
class DotProof:
    q: torch.fx.Node  # the fp8 q tensor
    k: tuple | None  # (source, coords, transforms) K's elements are read from; None: the read could not be probed
    d: torch.Tensor  # [samples, HEAD_DIM] q dim of each contraction index
    head: torch.Tensor  # [samples] q head of each sample
    k_plain: torch.fx.Node | None = None  # a plain fp8 [keys, 128] tensor read at (key, d), if K is one
    k_why: str = ""  # why K's read could not be probed


def try_locate(s: Samples, node: torch.fx.Node, coords: torch.Tensor) -> tuple[tuple | None, str]:
    """``locate`` or ``(None, reason)``: metadata given as data may index out of the probe tensors' range."""
    try:
        return s.prober.locate(node, coords), ""
    except NearMiss as miss:
        return None, str(miss)


def plain_read(s: Samples, node: torch.fx.Node, coords: torch.Tensor, dtypes: tuple, shape: list[int],
               transforms: list, want: torch.Tensor) -> torch.fx.Node | None:
    """The first tensor of ``dtypes`` and ``shape`` the elements are read from (through re-indexing and the exact
    ``transforms``), if each element ``i`` is its row-major element ``want[i]``; else ``None``."""

    def stop(n):
        v = val(n)
        return isinstance(v, torch.Tensor) and v.dtype in dtypes and shape_of(n) == shape

    try:
        leaf, leaf_coords, found = s.prober.locate(node, coords, stop)
    except NearMiss:
        return None
    if not stop(leaf) or found != transforms or not torch.equal(linear(leaf_coords, shape), want):
        return None
    return leaf


def prove_dot(s: Samples, dot: torch.fx.Node, leaves: set[torch.fx.Node]) -> DotProof:
    """One operand is ``q[row, h, :]`` upcast from fp8, every dim once; the other is K (located, not yet proven)."""
    dot_c = factor_coords(s, dot)
    k_dim = shape_of(dot.args[0])[-1]
    if k_dim != HEAD_DIM:
        raise NearMiss(f"the dot contracts {k_dim} elements, expected {HEAD_DIM}")
    n = dot_c.shape[0]
    kk = torch.arange(k_dim).repeat(n)
    dc = dot_c.repeat_interleave(k_dim, 0)
    if is_op(dot, aten.bmm.default):
        a_c, b_c = torch.stack([dc[:, 0], dc[:, 1], kk], 1), torch.stack([dc[:, 0], kk, dc[:, 2]], 1)
    else:
        a_c, b_c = torch.stack([dc[:, 0], kk], 1), torch.stack([kk, dc[:, 1]], 1)
    located = [try_locate(s, dot.args[0], a_c), try_locate(s, dot.args[1], b_c)]
    operands = [found for found, _ in located]
    row_k, heads = s.s_row.repeat_interleave(k_dim), s.heads
    for qi in (0, 1):
        if operands[qi] is None:
            continue
        q_leaf, q_c, q_tr = operands[qi]
        if q_leaf in leaves or q_tr != [("convert", val(q_leaf).dtype, torch.float32)] or \
                val(q_leaf).dtype not in FP8_DTYPES or math.prod(shape_of(q_leaf)) != s.rows * heads * HEAD_DIM:
            continue
        q_lin = linear(q_c, shape_of(q_leaf))
        if torch.equal(q_lin // (heads * HEAD_DIM), row_k):
            break
    else:
        raise NearMiss("no dot operand is an fp8 -> fp32 upcast of q read as q[row, h, d] (row of the logits)")
    head = ((q_lin // HEAD_DIM) % heads).view(n, k_dim)
    d = (q_lin % HEAD_DIM).view(n, k_dim)
    if not torch.equal(head, head[:, :1].expand_as(head)):
        raise NearMiss("the dot mixes q heads along its contraction")
    if not torch.equal(d.sort(1).values, torch.arange(k_dim).expand_as(d)):
        raise NearMiss("the dot does not contract every q dim exactly once")
    head = head[:, 0]
    if not torch.equal(head.view(s.m, heads).sort(1).values, torch.arange(heads).expand(s.m, heads)):
        raise NearMiss(f"{s.sum_node.name} does not sum over the head axis")
    fp8 = val(q_leaf).dtype
    k_plain = plain_read(s, dot.args[1 - qi], (a_c, b_c)[1 - qi], (fp8,), [s.keys, k_dim],
                         [("convert", fp8, torch.float32)], s.s_col.repeat_interleave(k_dim) * k_dim + d.flatten())
    return DotProof(q_leaf, operands[1 - qi], d, head, k_plain, located[1 - qi][1])


def prove_weights(s: Samples, weights: list[tuple], head: torch.Tensor) -> list[torch.fx.Node]:
    """The factors outside the relu other than k_scale: each an fp32 ``[rows, H]`` tensor read at ``(row, h)`` (one,
    or several whose product is the weights, e.g. the gates and q's scale where Inductor did not fold them)."""
    if not weights:
        raise NearMiss("no per-head weight factor in the head-sum product")
    leaves = []
    for w, w_inside, found in (entry[:3] for entry in weights):
        if found is None:
            raise NearMiss(f"the head weights {w.name} could not be probed")
        w_leaf, w_c, w_tr = found
        if w_inside:
            raise NearMiss("the head weights are applied inside the relu")
        if w_tr or val(w_leaf).dtype != torch.float32 or math.prod(shape_of(w_leaf)) != s.rows * s.heads:
            raise NearMiss(f"weights {w_leaf.name} are not an fp32 [rows={s.rows}, H={s.heads}] tensor")
        if not torch.equal(linear(w_c, shape_of(w_leaf)), s.s_row * s.heads + head):
            raise NearMiss("weights are not applied per (row, head)")
        leaves.append(w_leaf)
    return leaves


def weight_leaves(node: torch.fx.Node) -> tuple[list[torch.fx.Node], list[float]]:
    """A weight factor as tensors and numbers whose product it is: through reshapes (which keep the elements'
    order), a ``mul`` whose tensor operands have its own shape is split (``gates * q_scale * c``); anything else,
    e.g. a broadcast operand, stays one leaf. Every leaf holds the weights' elements in the same order."""
    root = view_chain(node, VIEW_OPS)[0]
    if not is_op(root, aten.mul.Tensor) or val(root).dtype != torch.float32:
        return [node], []
    tensors, numbers = [], []
    for a in root.args[:2]:
        if isinstance(a, torch.fx.Node):
            if not same_shape(a, root) or val(a).dtype != torch.float32:
                return [node], []
            t, n = weight_leaves(a)
            tensors += t
            numbers += n
        elif isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a):
            numbers.append(a)
        else:
            return [node], []
    return tensors, numbers


def summed_partials(node: torch.fx.Node) -> torch.fx.Node | None:
    """``P`` where ``node`` is ``P[0] + P[1] + ... + P[S-1]`` added left to right (how ``head_gate_gemm`` sums its
    split-K partials ``P [S, M, N]``), else None."""
    node = view_chain(node, VIEW_OPS)[0]
    picked = []
    while is_op(node, aten.add.Tensor) and len(node.args) == 2 and is_op(node.args[1], aten.select.int):
        picked.append(node.args[1])
        node = node.args[0]
    picked.append(node)
    picked.reverse()
    if len(picked) < 2 or not all(is_op(p, aten.select.int) and p.args[1] == 0 for p in picked):
        return None
    partials = picked[0].args[0]
    shape = tensor_val(partials).shape if tensor_val(partials) is not None else ()
    if len(shape) != 3 or as_int(shape[0]) != len(picked) or tensor_val(partials).dtype != torch.float32 \
            or any(p.args[0] is not partials or p.args[2] != i for i, p in enumerate(picked)):
        return None
    return partials


def prove_k_read(s: Samples, layout: KCacheLayout, leaves: set[torch.fx.Node], dot: DotProof, scale: tuple,
                 match: Match) -> tuple[set[str], list[str]]:
    """K and k_scale read from one cache at the layout's offsets of a block-table slot: the families whose address
    form fits (a lone sequence from 0 fits both), and the reasons when none does."""
    if dot.k is None or scale is None:
        return set(), [f"the K read could not be probed ({dot.k_why or 'k_scale'})"]
    (k_leaf, k_c, k_tr), (s_leaf, s_c, s_tr) = dot.k, scale
    fp8, k_dim, P = val(dot.q).dtype, HEAD_DIM, layout.page_size
    k_cached = k_leaf in leaves and k_tr == [("view_dtype", torch.uint8, fp8), ("convert", fp8, torch.float32)]
    s_cached = s_leaf in leaves and s_tr == [("view_dtype", torch.uint8, torch.float32)]
    if not (k_cached and s_cached):
        return set(), [f"K ({k_leaf.name}: {k_tr}) / k_scale ({s_leaf.name}: {s_tr}) are not fp8/fp32 reads of "
                       "the K cache"]
    if k_leaf is not s_leaf:
        raise NearMiss("K and k_scale are read from different caches")
    if math.prod(shape_of(k_leaf)) % layout.page_bytes:
        raise NearMiss(f"cache {k_leaf.name} {shape_of(k_leaf)} is not a whole number of {layout} pages")
    probes = s.probes
    bt = probes.values.get(probes.block_table)
    if bt is None:
        raise NearMiss("the K read does not go through a block table graph input")
    k_addr, s_addr = linear(k_c, shape_of(k_leaf)), linear(s_c, shape_of(s_leaf))
    num_pages = math.prod(shape_of(k_leaf)) // layout.page_bytes
    bt64, d_flat = bt.long(), dot.d.flatten()
    bt64 = torch.where(bt64 < 0, bt64 + num_pages, bt64)  # the page a negative id reads, as indexing wraps it

    def check(slots_s: torch.Tensor) -> bool:
        want_k = layout.value_offsets(slots_s.repeat_interleave(k_dim)).gather(1, d_flat[:, None]).squeeze(1)
        return torch.equal(k_addr, want_k) and torch.equal(s_addr, layout.scale_offsets(slots_s)[:, 0])

    families: set[str] = set()
    if s.batch and s.rows % s.batch == 0:
        b = s.s_row // (s.rows // s.batch)
        page_col = (s.s_col // P).clamp(max=bt64.shape[1] - 1)
        if torch.equal(page_col, s.s_col // P) and check(bt64[b, page_col] * P + s.s_col % P):
            families.add("decode")
    cu = probes.values.get(probes.cu_seqlens)
    if cu is not None:
        cu64 = cu.long()
        seq = torch.searchsorted(cu64[1:], s.s_col, right=True).clamp(max=bt64.shape[0] - 1)
        pos = s.s_col - cu64[seq]
        if bool((pos // P < bt64.shape[1]).all()) and check(bt64[seq, pos // P] * P + pos % P):
            families.add("prefill")
            match.lens = probes.cu_seqlens
    match.cache, match.block_table = k_leaf, probes.block_table
    if not families:
        return families, [f"K/k_scale are not read from the cache at the {layout} byte offsets of "
                          "slot block_table[b, s // P] * P + s % P (a negative page id read as indexing wraps it)"]
    return families, []


def row_inputs(s: Samples) -> list[tuple[torch.fx.Node, torch.Tensor]]:
    """The probed 1-D integer graph inputs holding one value per logits row (bounds or lengths given as data)."""
    return [(n, v.long()) for n, v in s.probes.values.items()
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape[0] == s.rows and n.op == "placeholder"]


def prove_mask(s: Samples, families: set[str], match: Match) -> tuple[str | None, list[str]]:
    """The -inf mask is a visibility rule of a family the K read allows: decode ``col <= ctx[b] - next_n + j`` or
    ``col < lens[row]``, prefill ``cu[seq[t]] <= col <= t`` or ``ks[t] <= col < ke[t]`` (``lens``, ``ks``, ``ke``:
    graph inputs with one value per row, taken as data: only their element-wise use is checked)."""
    allowed = families or {"decode", "prefill"}
    family = next(iter(families)) if len(families) == 1 else None
    probes, row, col = s.probes, s.row, s.col
    decode_ok = "decode" in allowed and bool(s.batch) and s.rows % s.batch == 0
    # logits wider than the block table reaches: the op's keys past it are -inf, as the buffer's (docs/indices.md)
    reach = col < probes.max_seq if s.widened and probes.max_seq is not None else torch.ones_like(col, dtype=torch.bool)
    if decode_ok and probes.ctx_lens is not None:
        next_n = s.rows // s.batch
        ctx = probes.values[probes.ctx_lens].long()
        if torch.equal(s.visible, (col <= ctx[row // next_n] - next_n + row % next_n) & reach):
            match.lens = probes.ctx_lens
            return "decode", []
    if "prefill" in allowed and probes.cu_seqlens is not None:
        cu = probes.values[probes.cu_seqlens].long()
        seq = torch.searchsorted(cu[1:], row, right=True)
        if torch.equal(s.visible, (col >= cu[seq]) & (col <= row)):
            match.lens = probes.cu_seqlens
            return "prefill", []
    inputs = row_inputs(s)
    for end, end_v in inputs:
        below = col < end_v[row]
        if decode_ok and torch.equal(s.visible, below & reach):
            match.row_lens = end
            return "decode", []
        if "prefill" not in allowed:
            continue
        if torch.equal(s.visible, below):
            match.bounds = (None, end)
            return "prefill", []
        for begin, begin_v in inputs:
            if begin is not end and torch.equal(s.visible, below & (col >= begin_v[row])):
                match.bounds = (begin, end)
                return "prefill", []
    if probes.ctx_lens is None and probes.cu_seqlens is None and not inputs:
        return family, ["the -inf mask does not read the context lengths / cu_seqlens of the block table's batch, "
                        "nor per-row bounds given as graph inputs"]
    forms = []
    if "decode" in allowed:
        forms.append("col <= context_lens[b] - next_n + j, col < lens[row]")
    if "prefill" in allowed:
        forms.append("cu_seqlens[seq[t]] <= s <= t, ks[t] <= s < ke[t]")
    return family, [f"the mask is not {', '.join(forms)} (lens, ks, ke: graph inputs, one value per row)"]


def analyze(sum_node: torch.fx.Node, where: torch.fx.Node | None, layout: KCacheLayout,
            leaves: set[torch.fx.Node]) -> Match:
    """Prove the candidate computes decode or prefill MQA logits; :class:`NearMiss` (with its family, when the K
    read or the mask tells it) otherwise."""
    if where is None:
        raise unmasked(sum_node)
    s, coords = sample_outputs(where, layout, leaves)
    sum_coords, after = peel_mask(s, where, sum_node, coords, mask_chain(sum_node)[2])
    prove_head_sum(s, sum_node, sum_coords)
    dot, others, weight_scale = prove_factors([root for root, _ in s.roots])
    if is_op(sum_node, aten.mean.dim):
        weight_scale /= s.heads
    factors = [(f, inside, factor_coords(s, f)) for f, inside in others]
    for f, coords in after:  # multiplied onto the sum: outside the relu, read at each head-sum sample's coordinates
        if coords is not None:
            factors.append((f, False, coords[s.pick].repeat_interleave(s.heads, 0)))
        elif isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f):
            weight_scale *= f
        else:
            raise NearMiss(f"factor {f} multiplied onto the head sum: only finite numbers are folded")
    located = []
    for f, inside, coords in factors:
        plain = plain_read(s, f, coords, (torch.float32,), [s.keys], [], s.s_col)
        located.append((f, inside, try_locate(s, f, coords)[0], plain))
    scale, weights = [], []  # (one partition: a factor read twice gives equal entries, which hold tensors)
    for e in located:
        (scale if e[3] is not None or e[2] is not None and (
            e[2][0] in leaves or e[2][2] == [("view_dtype", torch.uint8, torch.float32)]) else weights).append(e)
    q = prove_dot(s, dot, leaves)
    w = prove_weights(s, weights, q.head)
    if len(scale) != 1:
        raise NearMiss(f"{len(scale)} k_scale factors, expected one")
    match = Match("", where, q.q, w, s.heads, s.rows, s.keys, weight_scale=weight_scale)
    plain = (q.k_plain, scale[0][3]) if q.k_plain is not None and scale[0][3] is not None else None
    try:
        families, reasons = prove_k_read(s, layout, leaves, q, scale[0][2], match)
    except NearMiss:
        if plain is None:
            raise
        families, reasons = set(), []
    match.cached_prefill = "prefill" in families
    if plain is not None:  # K and k_scale as plain [N, 128] / [N] tensors read at key n: prefill on those tensors
        match.k_plain, families, reasons = plain, families | {"prefill"}, []
    family, mask_reasons = prove_mask(s, families, match)
    if reasons or mask_reasons:
        raise NearMiss("; ".join(reasons + mask_reasons), family)
    if s.widened and family != "decode":
        raise NearMiss(f"{family} logits written into a wider -inf buffer (the op writes the keys' columns only)",
                       family)
    match.family = family
    return match
