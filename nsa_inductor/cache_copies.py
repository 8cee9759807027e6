"""The report's ``cache_copies``: how many copies of a mutated uint8 graph input (a K cache) the compiled step makes.

Definition (counted per graph, summed over its caches):

- A *cache* is a ``uint8`` graph input the graph writes back to, i.e. the destination of an epilogue
  ``copy_(input, value)`` (how a functional post-grad graph spells "this input is mutated").
- The graph counted is the *final post-grad graph*: the graph as the nsa passes (and any pass installed after them)
  leave it, then Inductor's own ``reinplace_inplaceable_ops`` run on a copy of it, as Inductor runs it next. (Inductor's
  later post-grad passes are distributed/device passes that do not touch copies.)
- A node *aliases* the cache when it is the cache input, a view or in-place result of something aliasing it, or the
  output of a reinplaced ``auto_functionalized`` op for an argument aliasing it. It *holds cache bytes* when it
  aliases the cache or is one of the counted copies below.
- Counted, one each:
  1. a functional copying op (``clone``, ``copy``, ``_to_copy``, ``slice_scatter``, ``select_scatter``,
     ``index_put``, ``scatter``, ...) whose input (``self``) holds cache bytes: a new buffer with (part of) the cache
     in it, e.g. the ``index_put`` + ``slice_scatter`` chain Inductor lowers an unmatched store to;
  2. an ``auto_functionalized`` argument holding cache bytes that Inductor could not reinplace (it clones it);
  3. the epilogue ``copy_(cache, value)`` when ``value`` does not alias the cache (a real copy into the input).
  Not counted: the single write-back of a reinplaced op (``copy_(cache, cache)``, which Inductor drops), in-place
  ops on the cache (``index_put_``, a reinplaced ``nsa.quant_cache_store``), and reads (``index``, ``slice``).

When ``nsa.quant_cache_store`` fires and Inductor reinplaces it the figure is 0; when the store is left to Inductor it
is the number of cache-sized (or window-sized) buffers each step fills, and ``quant_cache_store`` reports a near miss
naming the cache.
"""

from __future__ import annotations

import inspect
import logging
import operator
from typing import Any

import torch
import torch.fx

log = logging.getLogger("nsa_inductor")

aten = torch.ops.aten

# Functional ops whose result is a new buffer holding their first argument's elements (some of them replaced).
COPYING_OPS = {
    aten.clone.default, aten.copy.default, aten._to_copy.default, aten.contiguous.default,
    aten.slice_scatter.default, aten.select_scatter.default, aten.diagonal_scatter.default,
    aten.as_strided_scatter.default, aten.index_put.default, aten.index_copy.default, aten.masked_scatter.default,
    aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce, aten.scatter_add.default,
    aten.scatter_reduce.two, aten.index_add.default, aten.index_fill.int_Scalar, aten.index_fill.int_Tensor,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor,
}


def _aliases_first_arg(node: torch.fx.Node) -> bool:
    """A view or an in-place op: its result aliases its first argument (read from the op's schema)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or not schema.arguments:
        return False
    returned, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return returned is not None and first is not None and bool(set(returned.before_set) & set(first.before_set))


def count_cache_copies(graph: torch.fx.Graph) -> tuple[int, list[str]]:
    """``(copies, sites)`` in ``graph`` as it is (see the module docstring; run on the reinplaced graph)."""
    caches = {n.args[0] for n in graph.nodes if n.op == "call_function" and n.target is aten.copy_.default
              and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "placeholder"
              and getattr(n.args[0].meta.get("val"), "dtype", None) == torch.uint8}
    aliases: dict[torch.fx.Node, torch.fx.Node] = {c: c for c in caches}  # node -> the cache it aliases
    holds: dict[torch.fx.Node, torch.fx.Node] = dict(aliases)  # node -> the cache whose bytes it holds
    sites: list[str] = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        first = node.args[0] if node.args else None
        if node.target is aten.copy_.default and node.args[0] in caches:
            dst, src = node.args[0], node.args[1]
            if aliases.get(src) is not dst:
                sites.append(f"{dst.name}: write-back {node.name} = copy_({dst.name}, {getattr(src, 'name', src)})")
            continue
        if node.target is torch.ops.higher_order.auto_functionalized:
            cloned = node.meta.get("only_clone_these_tensors")
            mutable = [name for name, value in node.kwargs.items() if value in holds]
            for name in mutable:
                cache = holds[node.kwargs[name]]
                if cloned is None or name in cloned:
                    sites.append(f"{cache.name}: {node.name} clones {name} ({node.args[0]})")
            for user in node.users:
                if user.target is operator.getitem and isinstance(user.args[1], int) and user.args[1] >= 1:
                    _mark_af_output(node, user, mutable, cloned, aliases, holds)
            continue
        if first in holds:
            if _aliases_first_arg(node):
                holds[node] = holds[first]
                if first in aliases:
                    aliases[node] = aliases[first]
            elif node.target in COPYING_OPS:
                holds[node] = holds[first]
                sites.append(f"{holds[first].name}: {node.name} = {node.target}({first.name}, ...)")
    return len(sites), sites


def _mark_af_output(node, user, mutable, cloned, aliases, holds) -> None:
    """``getitem(auto_functionalized(...), i)`` for ``i >= 1`` is the i-th mutable argument's new value."""
    from torch._higher_order_ops.auto_functionalize import get_mutable_args

    names, _ = get_mutable_args(node.args[0])
    index = user.args[1] - 1
    if index >= len(names) or names[index] not in mutable:
        return
    name = names[index]
    source = node.kwargs[name]
    holds[user] = holds[source]
    if cloned is not None and name not in cloned and source in aliases:
        aliases[user] = aliases[source]


def _reinplaced_copy(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` after Inductor's own reinplacing pass, as Inductor will run it on ``graph``."""
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops
    from torch._inductor.fx_utils import FakeTensorUpdater

    copy = torch.fx.Graph()
    output = copy.graph_copy(graph, {})
    copy.output(output)
    owner = graph.owning_module if graph.owning_module is not None else torch.nn.Module()
    module = torch.fx.GraphModule(owner, copy)
    takes = list(inspect.signature(FakeTensorUpdater.__init__).parameters)[1]  # torch 2.13: gm; older: graph
    updater = FakeTensorUpdater(module if takes == "gm" else module.graph)
    reinplace_inplaceable_ops(updater, module.graph)
    return module.graph


def cache_copy_report(graph: torch.fx.Graph) -> dict[str, Any]:
    """The report fields: ``cache_copies`` (int, or ``None`` when it could not be computed) and ``cache_copy_sites``
    (one line per copy, naming the cache). Never raises: a failure is logged and reported as ``None``."""
    try:
        copies, sites = count_cache_copies(_reinplaced_copy(graph))
    except Exception as error:  # noqa: BLE001 - a report figure must never break a compile
        log.warning("nsa_inductor: could not count cache copies: %s: %s", type(error).__name__, error)
        return {"cache_copies": None, "cache_copy_sites": [f"not computed: {type(error).__name__}: {error}"]}
    for site in sites:
        log.info("nsa_inductor:   cache copy: %s", site)
    return {"cache_copies": copies, "cache_copy_sites": sites}
