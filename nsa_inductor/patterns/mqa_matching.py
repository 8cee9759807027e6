"""Shared matching for the two MQA-logits passes: find ``where(mask, -inf, Σ_h w * relu(dot(q, k)) * k_scale)`` in a
post-grad graph and PROVE what it computes by probing it, whatever its spelling.

The proof is sample-based and works at any size: a :class:`Prober` evaluates single elements of a tensor node
(``value``) or follows an element back through pure re-indexing ops (reshape/permute/expand/slice/select/index/
gather, dtype reinterpretation, exact fp8->fp32 upcasts) to the tensor it was read from (``locate``). Small tensors
(index metadata) are evaluated densely with their real aten ops; large ones (K gathered from the cache, the score
tensor, masks) element by element, so a 64K-column decode costs the same as a 48-column one. The graph inputs the
probed sub-graphs read (block table, context lengths / cu_seqlens) get probe values; symbolic sizes use their hints
and are never guarded on.

For sampled output elements ``(row, col)`` of the masked logits and every head and every dot index it checks:
- the score is a sum over the head axis of a product tree holding ``relu(dot)``, ``k_scale`` and ``weights``;
- the dot is a bmm/mm whose operands are fp8 -> fp32 upcasts of q (row ``row``, head ``h``, dim ``d``, the same
  ``d`` on both sides, every ``d`` once) and of K;
- K's bytes (and k_scale's 4 consecutive bytes) are read from the cache at the compile-time layout's byte offsets
  of ``slot = block_table[b, s // P] * P + s % P`` (decode: ``b = row // next_n``, ``s = col``; prefill: the key
  ``col`` is token ``col - cu[seq]`` of sequence ``seq``), or K/k_scale are plain ``[N,128]``/``[N]`` tensors;
- weights are an fp32 ``[rows, H]`` tensor indexed ``(row, h)``;
- the -inf mask is exactly ``col <= ctx[b] - next_n + j`` (decode) or ``cu[seq(row)] <= col <= row`` (prefill).
Anything else raises :class:`Unproven` with the reason, which the passes record as a near miss.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..layout import HEAD_DIM, KCacheLayout
from ..quant import FP8_DTYPES
from ..pass_manager import PassContext, PassResult
from .graph_utils import VIEW_OPS, erase_dead, insert_call, is_op, val

aten = torch.ops.aten
prims = torch.ops.prims

DENSE_LIMIT = 1 << 18  # largest tensor (elements) evaluated densely while probing
MASK_SAMPLES = 4096
DOT_SAMPLES = 48

RESHAPES = VIEW_OPS + (aten.clone.default, aten.contiguous.default, aten.flatten.using_ints)
INT_DTYPES = (torch.int32, torch.int64)


class Unproven(Exception):
    """The candidate does not provably compute the MQA logits; the message says why."""


def hint(x: Any) -> int:
    """The example value of a size (``SymNode.hint`` exists on torch 2.11 and 2.13 alike)."""
    if isinstance(x, int):
        return x
    if x.node.hint is None:
        raise Unproven(f"size {x} has no example value (data-dependent)")
    return int(x.node.hint)


def shape_of(node: torch.fx.Node) -> list[int]:
    v = val(node)
    if not isinstance(v, torch.Tensor):
        raise Unproven(f"{node.name} has no tensor metadata")
    return [hint(s) for s in v.shape]


def linear(coords: torch.Tensor, shape: list[int]) -> torch.Tensor:
    lin = torch.zeros(coords.shape[0], dtype=torch.int64)
    for i, size in enumerate(shape):
        lin = lin * size + coords[:, i]
    return lin


def unravel(lin: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """Row-major coordinates of linear indices; the outermost coordinate is not wrapped (probe pages may lie past
    the real cache: addresses are compared, never read)."""
    out = torch.empty(lin.shape[0], len(shape), dtype=torch.int64)
    for i in range(len(shape) - 1, 0, -1):
        out[:, i] = lin % shape[i] if shape[i] else 0
        lin = lin // shape[i] if shape[i] else lin
    if shape:
        out[:, 0] = lin
    return out


def bmap(coords: torch.Tensor, in_shape: list[int]) -> torch.Tensor:
    """Coordinates of a broadcast input (right-aligned, size-1 dims read index 0)."""
    r = len(in_shape)
    sub = coords[:, coords.shape[1] - r:].clone() if r else coords[:, :0]
    for i, size in enumerate(in_shape):
        if size == 1:
            sub[:, i] = 0
    return sub


def is_neg_inf(arg: Any) -> bool:
    if isinstance(arg, (int, float)):
        return arg == float("-inf")
    if is_op(arg, aten.full.default, aten.scalar_tensor.default):
        value = arg.args[1] if is_op(arg, aten.full.default) else arg.args[0]
        return isinstance(value, (int, float)) and value == float("-inf")
    return False


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


# ---------------------------------------------------------------------------------------------------------------
# probing
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Probes:
    """Probe values of the graph inputs index sub-graphs read, bound on first use."""

    batch: int | None  # rows of the block table
    num_pages: int
    keys: int  # key columns of the logits (decode max_len / prefill N)
    gen: torch.Generator
    max_seq: int | None = None  # tokens one block-table row reaches (prefill probe lengths stay within it)
    block_table: torch.fx.Node | None = None
    ctx_lens: torch.fx.Node | None = None
    cu_seqlens: torch.fx.Node | None = None
    values: dict[torch.fx.Node, Any] = field(default_factory=dict)

    def bind(self, node: torch.fx.Node) -> Any:
        if node in self.values:
            return self.values[node]
        v = val(node)
        if isinstance(v, torch.SymInt):
            value = hint(v)
        elif isinstance(v, (int, float, bool)):
            value = v
        elif isinstance(v, torch.Tensor) and v.dtype in INT_DTYPES and v.dim() == 2 and self.block_table in (None, node):
            rows, cols = shape_of(node)
            n = rows * cols
            # distinct pages (more than the cache holds if need be: addresses are only compared, never read)
            pages = torch.randperm(max(self.num_pages, n), generator=self.gen)
            value = pages[:n].view(rows, cols).to(v.dtype)
            self.block_table = node
        elif isinstance(v, torch.Tensor) and v.dtype in INT_DTYPES and v.dim() == 1 and self.batch is not None:
            (size,) = shape_of(node)
            if size == self.batch and self.ctx_lens in (None, node):
                value = torch.randint(0, self.keys + 3, (size,), generator=self.gen)
                value[: min(size, 2)] = torch.tensor([0, self.keys])[: min(size, 2)]
                self.ctx_lens = node
            elif size == self.batch + 1 and self.cu_seqlens in (None, node):
                cap = self.max_seq or self.keys
                for _ in range(32):  # random cuts with every length within the block table's reach
                    cuts = torch.randint(0, self.keys + 1, (size - 2,), generator=self.gen).sort().values
                    value = torch.cat([torch.tensor([0]), cuts, torch.tensor([self.keys])])
                    if bool((value.diff() <= cap).all()):
                        break
                else:
                    value = self._greedy_cu(size, cap)
                self.cu_seqlens = node
            else:
                raise Unproven(f"index sub-graph reads graph input {node.name} {list(v.shape)}, which is neither "
                               f"the context lengths [B={self.batch}] nor cu_seqlens [B+1]")
            value = value.to(v.dtype)
        else:
            desc = f"{v.dtype} {list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise Unproven(f"index sub-graph reads graph input {node.name} ({desc}) that cannot be probed")
        self.values[node] = value
        return value

    def _greedy_cu(self, size: int, cap: int) -> torch.Tensor:
        """cu_seqlens of ``size - 1`` random lengths, each at most ``cap`` where the total allows, summing to keys."""
        lens = torch.zeros(size - 1, dtype=torch.int64)
        left = self.keys
        for i in torch.randperm(size - 1, generator=self.gen).tolist():
            take = min(cap, left, int(torch.randint(0, cap + 1, (1,), generator=self.gen)))
            lens[i], left = take, left - take
        for i in range(size - 1):
            take = min(cap - int(lens[i]), left)
            lens[i], left = lens[i] + take, left - take
        lens[-1] += left
        return torch.cat([torch.tensor([0]), lens.cumsum(0)])


class Prober:
    """Element-wise evaluation of FX nodes on probe inputs (see the module docstring)."""

    def __init__(self, probes: Probes, leaves: set[torch.fx.Node]):
        self.probes = probes
        self.leaves = leaves
        self.dense_memo: dict[torch.fx.Node, Any] = {}

    # dense evaluation of small sub-graphs ------------------------------------------------------------------
    def dense(self, node: Any) -> Any:
        if not isinstance(node, torch.fx.Node):
            return node
        if node in self.dense_memo:
            return self.dense_memo[node]
        result = self._dense(node)
        self.dense_memo[node] = result
        return result

    _NO = object()

    def _dense(self, node: torch.fx.Node) -> Any:
        if node in self.leaves:
            return self._NO
        if node.op == "placeholder":
            return self.probes.bind(node)
        if node.op != "call_function":
            return self._NO
        v = val(node)
        if isinstance(v, torch.Tensor) and math.prod(hint(s) for s in v.shape) > DENSE_LIMIT:
            return self._NO
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return self._NO
        flat_inputs = node.all_input_nodes
        values = {n: self.dense(n) for n in flat_inputs}
        if any(x is self._NO for x in values.values()):
            return self._NO

        def load(a):
            return values[a] if isinstance(a, torch.fx.Node) else a

        args = torch.utils._pytree.tree_map(load, node.args)
        kwargs = torch.utils._pytree.tree_map(load, dict(node.kwargs))
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        try:
            return node.target(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any failure means "cannot prove"
            raise Unproven(f"probing {node.name} ({node.target}) failed: {e}") from e

    # element-wise evaluation -------------------------------------------------------------------------------
    def value(self, node: Any, coords: torch.Tensor) -> torch.Tensor:
        """``node[coords]`` for coords ``[K, rank]`` (a Python scalar broadcasts)."""
        if not isinstance(node, torch.fx.Node):
            return torch.full((coords.shape[0],), node)
        d = self.dense(node)
        if d is not self._NO:
            if isinstance(d, torch.Tensor):
                return d[tuple(coords[:, i] for i in range(d.dim()))] if d.dim() else d.expand(coords.shape[0])
            return torch.full((coords.shape[0],), d)
        if node in self.leaves or node.op != "call_function":
            raise Unproven(f"the index/mask sub-graph reads {node.name}, which is not index metadata")
        if is_op(node, aten.view.dtype):
            src = node.args[0]
            if val(src).dtype.itemsize != val(node).dtype.itemsize:
                raise Unproven(f"{node.name}: index metadata reinterpreted with another element size")
            return self.value(src, coords).view(val(node).dtype)
        if not is_op(node, prims.convert_element_type.default):
            mapped = self._map(node, coords)
            if mapped is not None:
                src, src_coords, _ = mapped
                return self.value(src, src_coords)
        target = node.target
        if is_op(node, prims.iota.default):
            start, step = node.kwargs.get("start", 0), node.kwargs.get("step", 1)
            return start + coords[:, 0] * step
        if is_op(node, aten.full.default):
            return torch.full((coords.shape[0],), node.args[1], dtype=val(node).dtype)
        if is_op(node, aten.searchsorted.Tensor) or is_op(node, aten.bucketize.Tensor):
            seq_arg, x_arg = (node.args[0], node.args[1]) if is_op(node, aten.searchsorted.Tensor) else node.args[1::-1]
            boundaries = self.dense(seq_arg)
            if boundaries is self._NO or boundaries.dim() != 1:
                raise Unproven(f"{node.name}: boundaries are not small 1-D metadata")
            x = self.value(x_arg, bmap(coords, shape_of(x_arg)))
            kw = dict(node.kwargs)
            if is_op(node, aten.searchsorted.Tensor):
                return torch.searchsorted(boundaries, x, out_int32=kw.get("out_int32", False),
                                          right=kw.get("right", False), side=kw.get("side"))
            return torch.bucketize(x, boundaries, out_int32=kw.get("out_int32", False), right=kw.get("right", False))
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
            def load(a):
                if isinstance(a, torch.fx.Node):
                    if not isinstance(val(a), torch.Tensor):
                        return self.dense(a)
                    return self.value(a, bmap(coords, shape_of(a)))
                return a

            args = [load(a) for a in node.args]
            kwargs = {k: load(a) for k, a in node.kwargs.items()}
            try:
                return target(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                raise Unproven(f"probing {node.name} ({target}) failed: {e}") from e
        raise Unproven(f"cannot probe {node.name} ({target}) element-wise")

    # re-indexing ------------------------------------------------------------------------------------------
    def _map(self, node: torch.fx.Node, coords: torch.Tensor):
        """``(input, input_coords, transform)`` when ``node`` only re-indexes (or reinterprets) one input."""
        out_shape = shape_of(node) if isinstance(val(node), torch.Tensor) else None
        if is_op(node, *RESHAPES):
            src = node.args[0]
            return src, unravel(linear(coords, out_shape), shape_of(src)), None
        if is_op(node, aten.permute.default):
            src, dims = node.args
            dims = [d % len(dims) for d in dims]
            inc = torch.empty_like(coords)
            for i, d in enumerate(dims):
                inc[:, d] = coords[:, i]
            return src, inc, None
        if is_op(node, aten.expand.default):
            src = node.args[0]
            return src, bmap(coords, shape_of(src)), None
        if is_op(node, aten.slice.Tensor):
            src = node.args[0]
            dim = node.args[1] if len(node.args) > 1 else 0
            start = node.args[2] if len(node.args) > 2 else 0
            step = node.args[4] if len(node.args) > 4 else 1
            in_shape = shape_of(src)
            dim %= len(in_shape)
            start = 0 if start is None else hint(start)
            start = min(max(start + in_shape[dim] if start < 0 else start, 0), in_shape[dim])
            inc = coords.clone()
            inc[:, dim] = start + coords[:, dim] * step
            return src, inc, None
        if is_op(node, aten.select.int):
            src, dim, index = node.args
            in_shape = shape_of(src)
            dim %= len(in_shape)
            index = hint(index)
            index = index + in_shape[dim] if index < 0 else index
            inc = torch.cat([coords[:, :dim], torch.full((coords.shape[0], 1), index), coords[:, dim:]], 1)
            return src, inc, None
        if node.target is operator.getitem and is_op(node.args[0], aten.unbind.int, aten.split.Tensor,
                                                     aten.split_with_sizes.default):
            parent, i = node.args
            src = parent.args[0]
            in_shape = shape_of(src)
            if is_op(parent, aten.unbind.int):
                dim = (parent.args[1] if len(parent.args) > 1 else 0) % len(in_shape)
                inc = torch.cat([coords[:, :dim], torch.full((coords.shape[0], 1), i), coords[:, dim:]], 1)
                return src, inc, None
            dim = (parent.args[2] if len(parent.args) > 2 else 0) % len(in_shape)
            sizes = parent.args[1]
            offset = sum(hint(s) for s in sizes[:i]) if isinstance(sizes, (list, tuple)) else i * hint(sizes)
            inc = coords.clone()
            inc[:, dim] += offset
            return src, inc, None
        if is_op(node, aten.gather.default):
            src, dim, index = node.args[:3]
            dim %= len(out_shape)
            inc = coords.clone()
            idx = self.value(index, coords).long()
            size = shape_of(src)[dim]
            inc[:, dim] = torch.where(idx < 0, idx + size, idx)
            return src, inc, None
        if is_op(node, aten.index.Tensor):
            return self._map_index(node, coords)
        if is_op(node, prims.convert_element_type.default):
            src = node.args[0]
            return src, coords, ("convert", val(src).dtype, val(node).dtype)
        if is_op(node, aten.view.dtype):
            src = node.args[0]
            return src, coords, ("view_dtype", val(src).dtype, val(node).dtype)
        return None

    def _map_index(self, node, coords):
        src, indices = node.args
        in_shape = shape_of(src)
        positions = [i for i, t in enumerate(indices) if t is not None]
        for i in positions:
            if val(indices[i]).dtype not in INT_DTYPES:
                raise Unproven(f"{node.name}: boolean or non-integer index")
        idx_shape = list(torch.broadcast_shapes(*[tuple(shape_of(indices[i])) for i in positions]))
        k = len(idx_shape)
        adjacent = positions == list(range(positions[0], positions[-1] + 1))
        first = positions[0] if adjacent else 0
        mid = coords[:, first:first + k]
        rest = torch.cat([coords[:, :first], coords[:, first + k:]], 1)
        inc = torch.empty(coords.shape[0], len(in_shape), dtype=torch.int64)
        r = 0
        for i, size in enumerate(in_shape):
            if i in positions:
                idx = self.value(indices[i], bmap(mid, shape_of(indices[i]))).long()
                inc[:, i] = torch.where(idx < 0, idx + size, idx)
            else:
                inc[:, i] = rest[:, r]
                r += 1
        return src, inc, None

    def locate(self, node: torch.fx.Node, coords: torch.Tensor):
        """Follow elements back through re-indexing to ``(source, coords, transforms)``.

        The source is a cache leaf or the first node that computes values. Converts are followed only when exact
        (same dtype, or fp8 -> fp32); ``view.dtype`` with a wider type checks that the bytes are consecutive.
        """
        transforms: list[tuple] = []
        while node not in self.leaves and node.op == "call_function":
            if is_op(node, prims.convert_element_type.default):
                src_dtype, dst = val(node.args[0]).dtype, val(node).dtype
                if not (src_dtype == dst or (src_dtype in FP8_DTYPES and dst == torch.float32)):
                    break
            if is_op(node, aten.view.dtype):
                src = node.args[0]
                ratio = val(node).dtype.itemsize // val(src).dtype.itemsize
                if val(node).dtype.itemsize < val(src).dtype.itemsize or val(src).dim() == 0:
                    raise Unproven(f"{node.name}: narrowing view.dtype")
                transforms.append(("view_dtype", val(src).dtype, val(node).dtype))
                if ratio == 1:
                    node = src
                    continue
                parts = []
                for i in range(ratio):
                    c = coords.clone()
                    c[:, -1] = coords[:, -1] * ratio + i
                    parts.append(c)
                leaf, leaf_coords, inner = self.locate(src, torch.cat(parts))
                lin = linear(leaf_coords, shape_of(leaf)).view(ratio, -1)
                if not torch.equal(lin - lin[:1], torch.arange(ratio)[:, None].expand_as(lin)):
                    raise Unproven(f"{node.name}: the bytes reinterpreted as {val(node).dtype} are not consecutive")
                return leaf, leaf_coords[: coords.shape[0]], inner + transforms[::-1]
            mapped = self._map(node, coords)
            if mapped is None:
                break
            node, coords, transform = mapped
            if transform is not None and transform[1] != transform[2]:
                transforms.append(transform)
        return node, coords, transforms[::-1]


# ---------------------------------------------------------------------------------------------------------------
# candidates and analysis
# ---------------------------------------------------------------------------------------------------------------


def follow(node: torch.fx.Node, coords: torch.Tensor) -> tuple[torch.fx.Node, torch.Tensor]:
    """Through value-preserving reshapes/permutes/expands (no dtype change)."""
    while is_op(node, *RESHAPES, aten.permute.default, aten.expand.default):
        src = node.args[0]
        if is_op(node, aten.permute.default):
            dims = [d % len(node.args[1]) for d in node.args[1]]
            inc = torch.empty_like(coords)
            for i, d in enumerate(dims):
                inc[:, d] = coords[:, i]
            coords = inc
        elif is_op(node, aten.expand.default):
            coords = bmap(coords, shape_of(src))
        else:
            coords = unravel(linear(coords, shape_of(node)), shape_of(src))
        node = src
    return node, coords


def strip_reindex(node: torch.fx.Node) -> torch.fx.Node:
    while is_op(node, *RESHAPES, aten.permute.default, aten.expand.default):
        node = node.args[0]
    return node


def _numel(node: torch.fx.Node) -> Any:
    return val(node).numel()


def product_tree(node: torch.fx.Node, numel: int | None = None) -> tuple[list[torch.fx.Node], list[Any]]:
    """Tensor factors and scalar factors of a tree of ``mul``s (through re-indexing) at full size: a smaller
    (broadcast) mul is one factor, e.g. the weights computed as ``gates * q_scale * c``."""
    numel = _numel(node) if numel is None else numel
    node = strip_reindex(node)
    if is_op(node, aten.mul.Tensor) and statically_known_true(_numel(node) == numel):
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


def relu_input(node: torch.fx.Node) -> torch.fx.Node | None:
    if is_op(node, aten.relu.default):
        return node.args[0]
    if is_op(node, aten.clamp_min.default) and node.args[1] == 0:
        return node.args[0]
    return None


def is_dot(node: torch.fx.Node) -> bool:
    return is_op(node, aten.bmm.default, aten.mm.default)


def candidates(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.fx.Node | None]]:
    """``(sum, outermost -inf where or None)`` for every head-sum of a product holding a dot (inside relu or not)."""
    found = []
    for node in graph.nodes:
        if not is_op(node, aten.sum.dim_IntList):
            continue
        factors, _ = product_tree(node.args[0])
        inner = []
        for f in factors:
            r = relu_input(f)
            inner += product_tree(r)[0] if r is not None else [f]
        if len(factors) < 2 or not any(is_dot(f) for f in inner):
            continue
        where = None
        cur = node
        while True:
            users = list(cur.users)
            if len(users) != 1:
                break
            (user,) = users
            if is_op(user, *RESHAPES, aten.permute.default):
                cur = user
                continue
            if is_op(user, aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther) and cur in user.args[1:] \
                    and any(is_neg_inf(a) for a in user.args[1:] if a is not cur):
                where = cur = user
                continue
            break
        found.append((node, where))
    return found


@dataclass
class Match:
    family: str  # "decode" | "prefill"
    where: torch.fx.Node
    q: torch.fx.Node  # fp8 q values, linear index ((row * H) + h) * 128 + d
    weights: torch.fx.Node  # fp32, linear index row * H + h
    heads: int
    rows: int
    keys: int
    cache: torch.fx.Node | None = None
    block_table: torch.fx.Node | None = None
    lens: torch.fx.Node | None = None  # context_lens (decode) / cu_seqlens (prefill)


def analyze(sum_node: torch.fx.Node, where: torch.fx.Node | None, layout: KCacheLayout,
            leaves: set[torch.fx.Node]) -> Match:
    """Prove the candidate computes decode or prefill MQA logits; :class:`Unproven` otherwise.

    ``Unproven.family`` (when set) says which pass the near miss belongs to.
    """
    if where is None:
        raise Unproven("the head-sum of relu(q·k) is not masked with -inf by a where/masked_fill")
    out_shape = shape_of(where)
    if len(out_shape) < 2:
        raise Unproven(f"masked logits {where.name} have rank {len(out_shape)}, expected [rows, keys]")
    keys = out_shape[-1]
    rows = math.prod(out_shape[:-1])

    block_tables = [n for n in where.graph.nodes if n.op == "placeholder" and isinstance(val(n), torch.Tensor)
                    and val(n).dtype in INT_DTYPES and val(n).dim() == 2]
    batch = shape_of(block_tables[0])[0] if len(block_tables) == 1 else None
    cache_pages = 1
    for leaf in leaves:
        cache_pages = max(cache_pages, math.prod(shape_of(leaf)) // layout.page_bytes)
    max_seq = shape_of(block_tables[0])[1] * layout.page_size if len(block_tables) == 1 else None
    probes = Probes(batch, cache_pages, keys, torch.Generator().manual_seed(1234), max_seq)
    prober = Prober(probes, leaves)

    # --- samples of output elements: rows/cols at the edges, page boundaries and random ---
    gen = probes.gen
    n_out = rows * keys
    if n_out <= MASK_SAMPLES:
        lin = torch.arange(n_out)
    else:
        edge_cols = torch.tensor([0, 1, keys - 1] + [c for p in (layout.page_size, 16) for c in (p - 1, p, p + 1)
                                                     if c < keys])
        edge_rows = torch.tensor(sorted({0, rows - 1, rows // 2}))
        edges = (edge_rows[:, None] * keys + edge_cols[None, :]).flatten()
        lin = torch.cat([edges, torch.randint(0, n_out, (MASK_SAMPLES,), generator=gen)])
    coords = unravel(lin, out_shape)
    row, col = lin // keys, lin % keys

    # --- peel the -inf wheres down to the head sum ---
    visible = torch.ones(lin.shape[0], dtype=torch.bool)
    cur, cur_coords = where, coords
    while cur is not sum_node:
        if is_op(cur, aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther):
            cond, a, b = cur.args
            keep_self = not is_neg_inf(a)
            cond_val = prober.value(cond, bmap(cur_coords, shape_of(cond))).bool()
            visible &= cond_val if keep_self else ~cond_val
            nxt = a if keep_self else b
            cur, cur_coords = nxt, bmap(cur_coords, shape_of(nxt))
        cur, cur_coords = follow(cur, cur_coords)
        if cur is not sum_node and not is_op(cur, aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther):
            raise Unproven(f"between the mask and the head sum: {cur.name} ({cur.target})")

    # --- the head sum ---
    x = sum_node.args[0]
    dims = sum_node.args[1]
    keepdim = sum_node.args[2] if len(sum_node.args) > 2 else sum_node.kwargs.get("keepdim", False)
    x_shape = shape_of(x)
    if dims is None or len(dims) != 1:
        raise Unproven(f"{sum_node.name} reduces {dims}, expected exactly one (head) axis")
    red = dims[0] % len(x_shape)
    heads = x_shape[red]
    if not isinstance(val(x).shape[red], int):
        raise Unproven("the summed axis has a symbolic size")

    # a subset of the samples for the dot/weights/scale proof, every head
    m = min(DOT_SAMPLES, lin.shape[0])
    pick = torch.cat([torch.arange(min(8, m)), torch.randperm(lin.shape[0], generator=gen)[: m - min(8, m)]])
    s_coords = cur_coords[pick]
    s_row, s_col = row[pick].repeat_interleave(heads), col[pick].repeat_interleave(heads)
    base = s_coords.repeat_interleave(heads, 0)
    hcol = torch.arange(heads).repeat(m)[:, None]
    if keepdim:
        base[:, red] = hcol[:, 0]
        x_coords = base
    else:
        x_coords = torch.cat([base[:, :red], hcol, base[:, red:]], 1)

    # --- the product tree ---
    factors, scalars = product_tree(x)
    if scalars:
        raise Unproven(f"scalar factor(s) {scalars} in the head-sum product")
    relus = [f for f in factors if relu_input(f) is not None]
    if not relus:
        raise Unproven("no relu on the q·k scores")
    if len(relus) > 1:
        raise Unproven("more than one relu factor in the head-sum product")
    inner, inner_scalars = product_tree(relu_input(relus[0]))
    if inner_scalars:
        raise Unproven(f"scalar factor(s) {inner_scalars} inside the relu")
    dots = [f for f in inner if is_dot(f)]
    if len(dots) != 1:
        raise Unproven(f"{len(dots)} bmm/mm factors inside the relu, expected one")
    others = [(f, False) for f in factors if f is not relus[0]] + [(f, True) for f in inner if f is not dots[0]]

    def coords_of(target: torch.fx.Node) -> torch.Tensor:
        """x_coords carried down to ``target`` (a factor) through the mul tree and re-indexing."""
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
            if r_in is not None:
                return walk(r_in, c2)
            return None

        found = walk(x, x_coords)
        if found is None:
            raise Unproven(f"could not trace {target.name} in the product")
        return found

    # --- classify the non-dot factors: scale (read from the cache, or an fp32 [N]) and weights ---
    located = []
    for f, inside in others:
        leaf, lc, tr = prober.locate(f, coords_of(f))
        located.append((f, inside, leaf, lc, tr))
    scale = [e for e in located if e[2] in leaves or e[4] == [("view_dtype", torch.uint8, torch.float32)]]
    weights = [e for e in located if e not in scale]

    # --- the dot ---
    dot = dots[0]
    dot_c = coords_of(dot)
    k_dim = shape_of(dot.args[0])[-1]
    if k_dim != HEAD_DIM:
        raise Unproven(f"the dot contracts {k_dim} elements, expected {HEAD_DIM}")
    n = dot_c.shape[0]
    kk = torch.arange(k_dim).repeat(n)
    dc = dot_c.repeat_interleave(k_dim, 0)
    if is_op(dot, aten.bmm.default):
        a_c = torch.stack([dc[:, 0], dc[:, 1], kk], 1)
        b_c = torch.stack([dc[:, 0], kk, dc[:, 2]], 1)
    else:
        a_c = torch.stack([dc[:, 0], kk], 1)
        b_c = torch.stack([kk, dc[:, 1]], 1)
    operands = [prober.locate(dot.args[0], a_c), prober.locate(dot.args[1], b_c)]

    row_k = s_row.repeat_interleave(k_dim)
    q_info = None
    for qi in (0, 1):
        q_leaf, q_c, q_tr = operands[qi]
        if q_leaf in leaves or q_tr != [("convert", val(q_leaf).dtype, torch.float32)] or \
                val(q_leaf).dtype not in FP8_DTYPES:
            continue
        if math.prod(shape_of(q_leaf)) != rows * heads * HEAD_DIM:
            continue
        q_lin = linear(q_c, shape_of(q_leaf))
        if torch.equal(q_lin // (heads * HEAD_DIM), row_k):
            q_info = (qi, q_leaf, q_lin)
            break
    if q_info is None:
        raise Unproven("no dot operand is an fp8 -> fp32 upcast of q read as q[row, h, d] (row of the logits)")
    qi, q_leaf, q_lin = q_info
    head = ((q_lin // HEAD_DIM) % heads).view(n, k_dim)
    d = (q_lin % HEAD_DIM).view(n, k_dim)
    if not torch.equal(head, head[:, :1].expand_as(head)):
        raise Unproven("the dot mixes q heads along its contraction")
    if not torch.equal(d.sort(1).values, torch.arange(k_dim).expand_as(d)):
        raise Unproven("the dot does not contract every q dim exactly once")
    head = head[:, 0]
    if not torch.equal(head.view(m, heads).sort(1).values, torch.arange(heads).expand(m, heads)):
        raise Unproven(f"{sum_node.name} does not sum over the head axis")
    k_leaf, k_c, k_tr = operands[1 - qi]
    fp8 = val(q_leaf).dtype

    # weights
    if len(weights) != 1:
        raise Unproven(f"{len(weights)} per-head weight factors, expected one")
    w, w_inside, w_leaf, w_c, w_tr = weights[0]
    if w_inside:
        raise Unproven("the head weights are applied inside the relu")
    if w_tr or val(w_leaf).dtype != torch.float32 or math.prod(shape_of(w_leaf)) != rows * heads:
        raise Unproven(f"weights {w_leaf.name} are not an fp32 [rows={rows}, H={heads}] tensor")
    if not torch.equal(linear(w_c, shape_of(w_leaf)), s_row * heads + head):
        raise Unproven("weights are not applied per (row, head)")
    if len(scale) != 1:
        raise Unproven(f"{len(scale)} k_scale factors, expected one")
    _, _, s_leaf, s_c, s_tr = scale[0]

    # --- K and k_scale: decode paged read or prefill gather ---
    P = layout.page_size
    d_flat = d.flatten()
    match = Match("", where, q_leaf, w_leaf, heads, rows, keys)
    reasons = []
    k_cached = k_leaf in leaves and k_tr == [("view_dtype", torch.uint8, fp8), ("convert", fp8, torch.float32)]
    s_cached = s_leaf in leaves and s_tr == [("view_dtype", torch.uint8, torch.float32)]
    k_families: set[str] = set()  # address forms the K read fits; a lone sequence from 0 fits both
    if k_cached and s_cached:
        if k_leaf is not s_leaf:
            raise Unproven("K and k_scale are read from different caches")
        if math.prod(shape_of(k_leaf)) % layout.page_bytes:
            raise Unproven(f"cache {k_leaf.name} {shape_of(k_leaf)} is not a whole number of {layout} pages")
        bt = probes.values.get(probes.block_table)
        if bt is None:
            raise Unproven("the K read does not go through a block table graph input")
        k_addr = linear(k_c, shape_of(k_leaf))
        s_addr = linear(s_c, shape_of(s_leaf))
        bt64 = bt.long()

        def check(slots_s: torch.Tensor) -> bool:
            slots_k = slots_s.repeat_interleave(k_dim)
            want_k = layout.value_offsets(slots_k).gather(1, d_flat[:, None]).squeeze(1)
            want_s = layout.scale_offsets(slots_s)[:, 0]
            return torch.equal(k_addr, want_k) and torch.equal(s_addr, want_s)

        if batch and rows % batch == 0:
            next_n = rows // batch
            b = s_row // next_n
            page_col = (s_col // P).clamp(max=bt64.shape[1] - 1)
            if torch.equal(page_col, s_col // P) and check(bt64[b, page_col] * P + s_col % P):
                k_families.add("decode")
        cu = probes.values.get(probes.cu_seqlens)
        if cu is not None:
            cu64 = cu.long()
            seq = torch.searchsorted(cu64[1:], s_col, right=True).clamp(max=bt64.shape[0] - 1)
            pos = s_col - cu64[seq]
            pc = pos // P
            if bool((pc < bt64.shape[1]).all()) and check(bt64[seq, pc] * P + pos % P):
                k_families.add("prefill")
        if not k_families:
            reasons.append(f"K/k_scale are not read from the cache at the {layout} byte offsets of "
                           "slot block_table[b, s // P] * P + s % P")
        match.cache = k_leaf
        match.block_table = probes.block_table
    else:
        reasons.append(f"K ({k_leaf.name}: {k_tr}) / k_scale ({s_leaf.name}: {s_tr}) are not fp8/fp32 reads of "
                       "the K cache")

    # --- the mask (it decides between the families the K read allows) ---
    allowed = k_families or {"decode", "prefill"}
    family = next(iter(k_families)) if len(k_families) == 1 else None
    if "decode" in allowed and probes.ctx_lens is not None and batch and rows % batch == 0:
        next_n = rows // batch
        ctx = probes.values[probes.ctx_lens].long()
        want = col <= ctx[row // next_n] - next_n + row % next_n
        if not torch.equal(visible, want):
            reasons.append("the mask is not col <= context_lens[b] - next_n + j")
        family = "decode"
        match.lens = probes.ctx_lens
    elif "prefill" in allowed and probes.cu_seqlens is not None:
        cu = probes.values[probes.cu_seqlens].long()
        seq = torch.searchsorted(cu[1:], row, right=True)
        want = (col >= cu[seq]) & (col <= row)
        if not torch.equal(visible, want):
            reasons.append("the mask is not cu_seqlens[seq[t]] <= s <= t")
        family = "prefill"
        match.lens = probes.cu_seqlens
    else:
        reasons.append("the -inf mask does not read the context lengths / cu_seqlens of the block table's batch"
                       if family is None or probes.ctx_lens is None and probes.cu_seqlens is None
                       else f"the -inf mask does not fit the {family} form")
    if reasons:
        err = Unproven("; ".join(reasons))
        err.family = family
        raise err
    match.family = family
    return match


# ---------------------------------------------------------------------------------------------------------------
# rewriting helpers
# ---------------------------------------------------------------------------------------------------------------


def size_arg(graph: torch.fx.Graph, size: Any, sources: list[torch.fx.Node]) -> Any:
    """``size`` as an int, or a ``sym_size`` node of one of ``sources`` (or a SymInt placeholder) holding it."""
    if isinstance(size, int):
        return size
    for node in sources:
        v = val(node)
        if isinstance(v, torch.SymInt) and statically_known_true(v == size):
            return node
        if isinstance(v, torch.Tensor):
            for dim, s in enumerate(v.shape):
                if statically_known_true(s == size):
                    return insert_call(graph, aten.sym_size.int, (node, dim))
    for node in graph.nodes:
        if node.op == "placeholder" and isinstance(val(node), torch.SymInt) and statically_known_true(val(node) == size):
            return node
    raise Unproven(f"cannot express the symbolic size {size} from the graph inputs")


def as_dtype(graph: torch.fx.Graph, node: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    if val(node).dtype == dtype:
        return node
    return insert_call(graph, prims.convert_element_type.default, (node, dtype))


def reshape(graph: torch.fx.Graph, node: torch.fx.Node, shape: list[Any]) -> torch.fx.Node:
    v = val(node)
    if all(isinstance(s, int) and s >= 0 for s in shape) and list(v.shape) == shape:
        return node
    return insert_call(graph, aten.reshape.default, (node, shape))


def replace(graph: torch.fx.Graph, old: torch.fx.Node, new: torch.fx.Node, known: tuple = ()) -> None:
    """Point the users of ``old`` at ``new`` (reshaped to old's shape), then drop what became dead.

    ``known``: ``(size, node-or-int)`` pairs already in the graph, used for symbolic sizes of old's shape."""
    out_shape = list(val(old).shape)
    if list(val(new).shape) != out_shape:
        sizes = [s if isinstance(s, int) else None for s in out_shape]
        if sizes.count(None) > 1:
            sources = [n for n in graph.nodes if n.op == "placeholder"]
            unknown = []
            for i, s in enumerate(sizes):
                if s is None:
                    hit = [n for size, n in known if not isinstance(size, int) and statically_known_true(size == out_shape[i])]
                    if hit:
                        sizes[i] = hit[0]
                        continue
                    try:
                        sizes[i] = size_arg(graph, out_shape[i], sources)
                    except Unproven:
                        unknown.append(i)
            if len(unknown) > 1:
                raise Unproven(f"cannot express the logits shape {out_shape} from the graph inputs")
            for i in unknown:
                sizes[i] = -1
        else:
            sizes = [-1 if s is None else s for s in sizes]
        new = insert_call(graph, aten.reshape.default, (new, sizes))
    old.replace_all_uses_with(new)
    erase_dead(graph, [old])


def run_family(graph: torch.fx.Graph, ctx: PassContext, family: str, rewrite) -> PassResult:
    """Analyze every candidate once; rewrite those of ``family`` ("decode" or "prefill") with ``rewrite(graph, m,
    layout)``. A candidate whose family cannot be told is reported as a near miss by both passes."""
    result = PassResult()
    layout = ctx.decision.layout
    leaves = cache_values(graph)
    for sum_node, where in candidates(graph):
        anchor = where if where is not None else sum_node
        if getattr(anchor, "_erased", False):
            continue
        try:
            m = analyze(sum_node, where, layout, leaves)
            if m.family != family:
                continue
            rewrite(graph, m, layout)
        except Unproven as e:
            if getattr(e, "family", None) in (None, family):
                result.miss(anchor, str(e))
            continue
        result.matched += 1
    return result
