"""The indexer's top-k selection -> one ``nsa.topk_indices`` kernel (see the ``search*`` functions below).

Matches ``torch.topk`` over the last dim of fp32 logits, either the masked idiom (values used only for the
``== -inf`` or ``!= -inf`` test, indices minus an optional per-row offset get -1 there, either cast to int32 or not;
int32 or int64 result) or plain top-k indices (``torch.topk(x, k).indices``, ``x.topk(k)[1]``; -inf entries keep
their columns; an int32 cast of them is the op's own dtype; values used otherwise, e.g. returned as Hugging Face's
newest indexer does, are gathered from the logits at the op's indices: torch's values, in its order), also spelled
as a descending sort cut to its first k columns (``x.argsort(dim=-1, descending=True)[:, :k]``; not
``stable=True``, whose ties come in column order).
Logits of another rank (one row ``[T]``; ``[B, S, T]``, as Hugging Face's DeepSeek-V3.2 indexer scores) are rows
too: the op reads their ``[-1, T]`` view, its indices are viewed back (no offset there: one a row is a 2-D idiom).
Rewrites to one kernel (ATen's radix top-k is ~23 launches on CUDA); when an ``nsa`` logits op wrote the logits, its
mask bounds each row's scan (``lengths``), and where the top-k is the logits' only reader (its values unused), the
logits op leaves the masked columns past each row's last visible key unwritten (``write_masked=False``). Order as
torch: ``sorted=True`` (the default) gives descending values; ``sorted=False``, or ``nsa.topk_order="set"``, the
faster set order.
Never (near misses): ``largest=False``, another dim, logits not fp32, a masked idiom whose ``-inf`` test is
``> -inf`` (false for NaN too), a fill other than -1, an offset that is not one value per row; a sort that is
ascending, stable, cut other than ``[..., :k]`` or whose values are used.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from .base import GraphPass, NearMiss, PassContext
from .fx_utils import VIEW_OPS, arg, as_int, erase_dead, insert_call, is_op, norm_dim, set_arg, size_arg, tensor_val

aten = torch.ops.aten
prims = torch.ops.prims


def search(logits: torch.Tensor, offset: torch.Tensor, k: int) -> torch.Tensor:
    """The eager idiom (decode has no offset; prefill subtracts each token's sequence start)."""
    values, indices = torch.topk(logits, k, dim=-1)
    indices = indices - offset[:, None]
    return indices.masked_fill(values == float("-inf"), -1).to(torch.int32)


def search_plain(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Plain top-k indices: the values are not used."""
    return torch.topk(logits, k).indices


def search_sorted_cut(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The same, as a descending sort cut to its first k columns."""
    return logits.argsort(dim=-1, descending=True)[:, :k]


def replacement(logits: torch.Tensor, offset: torch.Tensor | None, k: int, lengths: torch.Tensor | None, pad: str,
                sorted: bool) -> torch.Tensor:
    """Both idioms: ``pad="neg1"`` for the masked one, ``"column"`` for the plain one (-inf entries keep columns)."""
    return torch.ops.nsa.topk_indices(logits, k, lengths, offset, pad, sorted)


def _outputs(topk: torch.fx.Node) -> tuple[torch.fx.Node | None, torch.fx.Node | None]:
    values = indices = None
    for user in topk.users:
        if user.target is operator.getitem and user.args[1] == 0:
            values = user
        elif user.target is operator.getitem and user.args[1] == 1:
            indices = user
    return values, indices


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is_minus_one(node: Any) -> bool:
    if isinstance(node, (int, float)):
        return node == -1
    if is_op(node, aten.full.default) and list(node.args[0]) == []:
        return node.args[1] == -1
    return is_op(node, aten.scalar_tensor.default) and node.args[0] == -1


def _row_offset(node: Any, rows: Any) -> torch.fx.Node | None:
    """``o`` when ``node`` is ``o[:, None]`` (spelled unsqueeze / view / reshape) of a 1-D integer ``o`` of ``rows``."""
    if not is_op(node, aten.unsqueeze.default, *VIEW_OPS):
        return None
    source, fake, out = node.args[0], tensor_val(node.args[0]), tensor_val(node)
    if fake is None or out is None or fake.dim() != 1 or fake.dtype.is_floating_point or fake.dtype == torch.bool:
        return None
    if out.dim() != 2 or as_int(out.shape[1]) != 1 or fake.shape[0] != rows:
        return None
    return source


def _lengths(graph: torch.fx.Graph, logits: torch.fx.Node) -> torch.fx.Node | None:
    """Per-row count of leading columns that can be finite, when an ``nsa`` logits op wrote ``logits``."""
    if is_op(logits, torch.ops.nsa.mqa_logits.default):
        return logits.args[5]  # ke: row t sees keys ks[t] <= n < ke[t]
    if not is_op(logits, torch.ops.nsa.paged_mqa_logits.default):
        return None
    q_fp8, context_lens = logits.args[0], logits.args[3]
    next_n = as_int(tensor_val(q_fp8).shape[1])
    if next_n is None:
        return None
    if next_n == 1:
        return context_lens
    # row b*next_n + j sees keys s <= ctx[b] - next_n + j
    steps = insert_call(graph, prims.iota.default, (next_n,),
                        {"start": 1 - next_n, "step": 1, "dtype": torch.int32,
                         "device": tensor_val(context_lens).device, "requires_grad": False}, context_lens)
    per_step = insert_call(graph, aten.add.Tensor, (insert_call(graph, aten.unsqueeze.default, (context_lens, 1)),
                                                    steps))
    return insert_call(graph, aten.reshape.default, (per_step, [-1]))


def _logits(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.Tensor]:
    logits = node.args[0]
    fake = tensor_val(logits)
    if fake is None or fake.dim() == 0 or fake.dtype != torch.float32:
        raise NearMiss(f"logits must be fp32 rows, got {None if fake is None else (fake.dtype, list(fake.shape))}")
    if fake.dim() != 2 and as_int(fake.shape[-1]) == 0:
        raise NearMiss(f"logits {list(fake.shape)} have no column: no [-1, T] view of their rows")
    return logits, fake


def _as_int32(node: torch.fx.Node) -> torch.fx.Node | None:
    """The int32 cast that is ``node``'s only user, if it has one."""
    cast = _only_user(node)
    return cast if is_op(cast, prims.convert_element_type.default) and cast.args[1] == torch.int32 else None


def _found_plain(logits, k, indices: torch.fx.Node, sorted_) -> dict[str, Any]:
    """Plain top-k indices ``indices`` (int64; or the op's int32 where that is their only use)."""
    cast = _as_int32(indices)
    return {"logits": logits, "k": k, "offset": None, "replace": cast or indices, "int64": cast is None,
            "pad": "column", "sorted": sorted_}


def _leading_cut(node: Any, rank: int) -> bool:
    """``node`` is ``x[..., :end]`` (any step) of a rank-``rank`` tensor's last dim."""
    return is_op(node, aten.slice.Tensor) and arg(node, 2, "start", 0) == 0 \
        and norm_dim(arg(node, 1, "dim", 0), rank) == rank - 1


def _cut_sort(node: torch.fx.Node) -> bool:
    """A sort whose indices some ``[..., :end]`` of the last dim reads: a top-k candidate (other sorts, e.g. a
    sampler's, are not reported)."""
    if not is_op(node, aten.sort.default, aten.sort.stable) or tensor_val(node.args[0]) is None:
        return False
    indices = _outputs(node)[1]
    rank = tensor_val(node.args[0]).dim()
    return indices is not None and any(is_op(u, aten.alias.default) or _leading_cut(u, rank) for u in indices.users)


def match_sorted_cut(sort: torch.fx.Node) -> dict[str, Any]:
    """``sort(x, -1, descending=True)`` whose values are unused and whose indices are cut to ``[..., :k]``: plain
    top-k indices in torch's order (an unstable sort leaves ties in any order, as topk)."""
    logits, fake = _logits(sort)
    if not arg(sort, 2, "descending", False):
        raise NearMiss("an ascending sort (the smallest values first)")
    rank = fake.dim()
    if norm_dim(arg(sort, 1, "dim", -1), rank) != rank - 1:
        raise NearMiss("a sort over a dim other than the last")
    if is_op(sort, aten.sort.stable) and sort.kwargs.get("stable"):
        raise NearMiss("a stable sort: equal values in column order, which the op does not keep")
    values, indices = _outputs(sort)
    if values is not None and values.users:
        raise NearMiss("the sorted values are used (the op returns indices only)")
    cut = _only_user(indices) if indices is not None else None
    width, end = as_int(fake.shape[-1]), None
    if is_op(cut, aten.alias.default):  # the cut of the whole row
        end = width
    elif _leading_cut(cut, rank) and arg(cut, 4, "step", 1) == 1:
        end = arg(cut, 3, "end")
    if not isinstance(end, int) or end < 0 or width is None:
        raise NearMiss("the sorted indices are not cut once to their first k columns ([..., :k], k static)")
    return _found_plain(logits, min(end, width), cut, True)


def match_topk(topk: torch.fx.Node) -> dict[str, Any]:
    """The pieces of the idiom anchored at ``topk``; :class:`NearMiss` with the reason it is not the idiom."""
    logits, fake = _logits(topk)
    rank = fake.dim()
    if norm_dim(arg(topk, 2, "dim", -1), rank) != rank - 1:
        raise NearMiss("top-k over a dim other than the last")
    if not arg(topk, 3, "largest", True):
        raise NearMiss("largest=False")
    k = topk.args[1]
    width = as_int(fake.shape[-1])
    if isinstance(k, int) and width is not None and k > width:  # (a symbolic k is checked by the op at run time)
        raise NearMiss(f"k={k} is larger than the row's {width} columns")
    sorted_ = arg(topk, 4, "sorted", True)
    values, indices = _outputs(topk)
    if indices is None or len(topk.users) != (1 if values is None else 2):
        raise NearMiss("top-k indices unused, or an output used twice")
    if values is None or not values.users:
        return _found_plain(logits, k, indices, sorted_)
    test = _only_user(values)
    if not (is_op(test, aten.eq.Scalar, aten.ne.Scalar, aten.gt.Scalar) and test.args[0] is values
            and test.args[1] == float("-inf")):  # values used otherwise: gathered from the logits at the indices
        return {**_found_plain(logits, k, indices, sorted_), "values": values}
    if is_op(test, aten.gt.Scalar):
        raise NearMiss("the -inf test is values > -inf, which is false for NaN too: a NaN's index would become -1, "
                       "where the op keeps it (test values == -inf or values != -inf)")
    fill = _only_user(test)
    kept, filled = (1, 2) if is_op(test, aten.ne.Scalar) else (2, 1)  # where(values != -inf, indices, -1)
    if not (is_op(fill, aten.where.self) and fill.args[0] is test and _is_minus_one(fill.args[filled])):
        raise NearMiss("the -inf entries are not replaced by -1 (where(values == -inf, -1, indices) or "
                       "where(values != -inf, indices, -1))")
    chosen, offset, offset_int32 = fill.args[kept], None, False
    narrowed = _as_int32(indices)  # the indices cast to int32 first, if they are
    if chosen is narrowed:
        chosen = indices
    if is_op(chosen, aten.sub.Tensor) and any(chosen.args[0] is x for x in (indices, narrowed)) \
            and len(chosen.users) == 1 and chosen.kwargs.get("alpha", 1) == 1:
        subtrahend = chosen.args[1]
        if is_op(subtrahend, prims.convert_element_type.default) and subtrahend.args[1] == torch.int32 \
                and len(subtrahend.users) == 1:  # an offset cast to int32 (the op subtracts it cast so)
            subtrahend, offset_int32 = subtrahend.args[0], True
        offset = _row_offset(subtrahend, fake.shape[0]) if rank == 2 else None
        if offset is None:
            raise NearMiss(f"indices minus {chosen.args[1]}: not one integer offset per row")
    elif chosen is not indices:
        raise NearMiss(f"the -1 fill applies to {chosen}, not to the top-k indices (minus a row offset)")
    if len(indices.users) != 1:
        raise NearMiss("the top-k indices have other users")
    found = {"logits": logits, "k": k, "offset": offset, "offset_int32": offset_int32, "pad": "neg1",
             "sorted": sorted_}
    cast = _as_int32(fill)
    return {**found, "replace": cast or fill, "int64": cast is None and tensor_val(fill).dtype == torch.int64}


class TopkIndices(GraphPass):
    """``order``: ``"sorted"`` keeps each spelling's ``sorted`` flag (torch's semantics); ``"set"`` drops it."""

    name = "topk_indices"

    def __init__(self, order: str = "sorted"):
        self.order = order

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext | None):
        return [n for n in graph.nodes if is_op(n, aten.topk.default) or _cut_sort(n)]

    def rewrite(self, graph: torch.fx.Graph, topk: torch.fx.Node, ctx: PassContext | None) -> None:
        found = match_topk(topk) if is_op(topk, aten.topk.default) else match_sorted_cut(topk)
        replaced, values = found["replace"], found.get("values")
        logits = found["logits"]
        # (with values, before the top-k: a reader of them may come before the indices' cast)
        with graph.inserting_before(topk if values is not None else replaced):
            lengths = _lengths(graph, logits)
            if lengths is not None and len(logits.users) == 1 and values is None:
                set_arg(logits, "write_masked", False)  # an nsa logits op read only up to the lengths
            sorted_ = bool(found["sorted"]) and self.order == "sorted"
            fake = tensor_val(logits)
            rows = logits if fake.dim() == 2 else insert_call(  # (a symbolic width is never 0: Dynamo specialises 0)
                graph, aten.reshape.default, (logits, [-1, size_arg(graph, fake.shape[-1], [logits])]))
            offset = found["offset"]
            if found.get("offset_int32"):
                offset = insert_call(graph, prims.convert_element_type.default, (offset, torch.int32))
            new = insert_call(graph, torch.ops.nsa.topk_indices.default,
                              (rows, found["k"], lengths, offset, found["pad"], sorted_))
            if fake.dim() != 2:  # the indices in the logits' leading dims
                lead = [size_arg(graph, size, [logits]) for size in fake.shape[:-1]]
                new = insert_call(graph, aten.reshape.default, (new, [*lead, found["k"]]))
            if found["int64"]:
                new = insert_call(graph, prims.convert_element_type.default, (new, torch.int64))
            if values is not None:  # torch's values: the logits at the op's indices, in their order
                index = new if found["int64"] else insert_call(graph, prims.convert_element_type.default,
                                                               (new, torch.int64))
                values.replace_all_uses_with(insert_call(graph, aten.gather.default, (logits, -1, index)))
        replaced.replace_all_uses_with(new)
        erase_dead(graph, [replaced, *topk.users])  # an unused values output goes too
