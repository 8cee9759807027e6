"""Element-wise probing of FX nodes, whatever their spelling.

A :class:`Prober` evaluates single elements of a tensor node (``value``) or follows an element back through pure
re-indexing ops (reshape/permute/expand/slice/select/index/gather, dtype reinterpretation, exact fp8->fp32 upcasts)
to the tensor it was read from (``locate``). Small tensors (index metadata) are evaluated densely with their real
aten ops; large ones (K gathered from the cache, the score tensor, masks) element by element, so a 64K-column decode
costs the same as a 48-column one. The graph inputs the probed sub-graphs read (block table, context lengths /
cu_seqlens) get probe values (:class:`Probes`); symbolic sizes use their hints and are never guarded on.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from ...quant import FP8_DTYPES
from ..base import NearMiss
from ..fx_utils import VALUE_COPIES, VIEW_OPS, arg, is_op, val

aten = torch.ops.aten
prims = torch.ops.prims

DENSE_LIMIT = 1 << 18  # largest tensor (elements) evaluated densely while probing

RESHAPES = VIEW_OPS + VALUE_COPIES
INT_DTYPES = (torch.int32, torch.int64)
def hint(x: Any) -> int:
    """The example value of a size (``SymNode.hint`` exists on torch 2.11 and 2.13 alike)."""
    if isinstance(x, int):
        return x
    if x.node.hint is None:
        raise NearMiss(f"size {x} has no example value (data-dependent)")
    return int(x.node.hint)


def shape_of(node: torch.fx.Node) -> list[int]:
    v = val(node)
    if not isinstance(v, torch.Tensor):
        raise NearMiss(f"{node.name} has no tensor metadata")
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
            # distinct pages (more than the cache holds if need be: addresses are only compared, never read); half
            # of those in [1, num_pages) negative, p - num_pages, which indexing reads as page p: a table changed
            # before the read (a clamp at 0, an abs) reads another page there
            pages = torch.randperm(max(self.num_pages, n), generator=self.gen)[:n]
            alias = (pages >= 1) & (pages < self.num_pages) & (torch.rand(n, generator=self.gen) < 0.5)
            value = torch.where(alias, pages - self.num_pages, pages).view(rows, cols).to(v.dtype)
            self.block_table = node
        elif isinstance(v, torch.Tensor) and v.dtype in INT_DTYPES and v.dim() == 1:
            (size,) = shape_of(node)
            if size == self.batch and self.ctx_lens in (None, node):
                value = torch.randint(0, self.keys + 3, (size,), generator=self.gen)
                value[: min(size, 2)] = torch.tensor([0, self.keys])[: min(size, 2)]
                self.ctx_lens = node
            elif self.batch is not None and size == self.batch + 1 and self.cu_seqlens in (None, node):
                cap = self.max_seq or self.keys
                for _ in range(32):  # random cuts with every length within the block table's reach
                    cuts = torch.randint(0, self.keys + 1, (size - 2,), generator=self.gen).sort().values
                    value = torch.cat([torch.tensor([0]), cuts, torch.tensor([self.keys])])
                    if bool((value.diff() <= cap).all()):
                        break
                else:
                    value = self._greedy_cu(size, cap)
                self.cu_seqlens = node
            else:  # metadata given as data (per-row bounds or lengths, a token map): any values, edges included
                value = torch.randint(0, self.keys + 2, (size,), generator=self.gen)
                value[: min(size, 2)] = torch.tensor([0, self.keys])[: min(size, 2)]
            value = value.to(v.dtype)
        else:
            desc = f"{v.dtype} {list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise NearMiss(f"index sub-graph reads graph input {node.name} ({desc}) that cannot be probed")
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
    """Element-wise evaluation of FX nodes on probe inputs."""

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
            raise NearMiss(f"probing {node.name} ({node.target}) failed: {e}") from e

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
            raise NearMiss(f"the index/mask sub-graph reads {node.name}, which is not index metadata")
        if is_op(node, aten.view.dtype):
            src = node.args[0]
            if val(src).dtype.itemsize != val(node).dtype.itemsize:
                raise NearMiss(f"{node.name}: index metadata reinterpreted with another element size")
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
                raise NearMiss(f"{node.name}: boundaries are not small 1-D metadata")
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
                raise NearMiss(f"probing {node.name} ({target}) failed: {e}") from e
        raise NearMiss(f"cannot probe {node.name} ({target}) element-wise")

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
            dim, start, step = arg(node, 1, "dim", 0), hint(arg(node, 2, "start", 0)), arg(node, 4, "step", 1)
            in_shape = shape_of(src)
            dim %= len(in_shape)
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
                dim = arg(parent, 1, "dim", 0) % len(in_shape)
                inc = torch.cat([coords[:, :dim], torch.full((coords.shape[0], 1), i), coords[:, dim:]], 1)
                return src, inc, None
            dim = arg(parent, 2, "dim", 0) % len(in_shape)
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
                raise NearMiss(f"{node.name}: boolean or non-integer index")
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

    def locate(self, node: torch.fx.Node, coords: torch.Tensor, stop=None):
        """Follow elements back through re-indexing to ``(source, coords, transforms)``.

        The source is a cache leaf, the first node that computes values, or the first node ``stop(node)`` accepts.
        Converts are followed only when exact (same dtype, or fp8 -> fp32); ``view.dtype`` with a wider type checks
        that the bytes are consecutive.
        """
        transforms: list[tuple] = []
        while node not in self.leaves and node.op == "call_function" and not (stop is not None and stop(node)):
            if is_op(node, prims.convert_element_type.default):
                src_dtype, dst = val(node.args[0]).dtype, val(node).dtype
                if not (src_dtype == dst or (src_dtype in FP8_DTYPES and dst == torch.float32)):
                    break
            if is_op(node, aten.view.dtype):
                src = node.args[0]
                ratio = val(node).dtype.itemsize // val(src).dtype.itemsize
                if val(node).dtype.itemsize < val(src).dtype.itemsize or val(src).dim() == 0:
                    raise NearMiss(f"{node.name}: narrowing view.dtype")
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
                    raise NearMiss(f"{node.name}: the bytes reinterpreted as {val(node).dtype} are not consecutive")
                return leaf, leaf_coords[: coords.shape[0]], inner + transforms[::-1]
            mapped = self._map(node, coords)
            if mapped is None:
                break
            node, coords, transform = mapped
            if transform is not None and transform[1] != transform[2]:
                transforms.append(transform)
        return node, coords, transforms[::-1]


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

