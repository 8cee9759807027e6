"""Small FX helpers shared by the passes: op tests, view-chain walking, node insertion with fake metadata, and
evaluating an index subgraph on probe inputs (to check what an expression computes, whatever its spelling)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
prims = torch.ops.prims

# Ops that only re-index the same elements (no copy of values in a functional graph).
VIEW_OPS = (
    aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.alias.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default,
)


def is_op(node: Any, *targets: Any) -> bool:
    """``node`` calls one of ``targets`` (an OpOverload, or an OpOverloadPacket matching all its overloads)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    for target in targets:
        if node.target is target or getattr(node.target, "overloadpacket", None) is target:
            return True
    return False


def val(node: Any) -> Any:
    """The fake value Inductor recorded for ``node`` (``None`` for non-nodes or missing metadata)."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def strip_views(node: torch.fx.Node) -> torch.fx.Node:
    """Follow reshape/view/squeeze/unsqueeze producers back to the first node that is not such a view."""
    while is_op(node, *VIEW_OPS):
        node = node.args[0]
    return node


def same_shape(a: Any, b: Any) -> bool:
    va, vb = val(a), val(b)
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and tuple(va.shape) == tuple(vb.shape)


def insert_call(graph: torch.fx.Graph, target: Callable, args: tuple, kwargs: dict | None = None) -> torch.fx.Node:
    """Add ``target(*args, **kwargs)`` at the graph's insertion point, with ``meta["val"]`` computed on fakes."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    fake_args, fake_kwargs = tree_map(lambda a: val(a) if isinstance(a, torch.fx.Node) else a, (args, kwargs))
    mode = detect_fake_mode([v for v in tree_flatten((fake_args, fake_kwargs))[0] if isinstance(v, torch.Tensor)])
    with mode:
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def cone(output: torch.fx.Node, inputs: Iterable[torch.fx.Node]) -> list[torch.fx.Node] | None:
    """Nodes computing ``output`` from ``inputs`` and constants, in graph order; ``None`` if it reads anything else
    (another placeholder, a parameter, a mutable op)."""
    stop = set(inputs)
    seen: set[torch.fx.Node] = set()
    stack = [output]
    while stack:
        node = stack.pop()
        if node in seen or node in stop:
            continue
        if node.op != "call_function" or getattr(node.target, "_schema", None) is not None and node.target._schema.is_mutable:
            return None
        seen.add(node)
        stack.extend(n for n in node.all_input_nodes)
    order = {n: i for i, n in enumerate(output.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _bind_sizes(bindings: dict[torch.fx.Node, Any]) -> dict[torch.fx.Node, Any]:
    """Bind symbolic-size placeholders (dynamic shapes) to the sizes of the probe values given for tensors."""
    sizes: dict[str, int] = {}
    for node, value in bindings.items():
        fake = val(node)
        if isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor):
            for symbolic, real in zip(fake.shape, value.shape):
                sizes.setdefault(str(symbolic), int(real))
    graph = next(iter(bindings)).graph
    return {node: sizes[str(val(node))] for node in graph.find_nodes(op="placeholder")
            if isinstance(val(node), torch.SymInt) and str(val(node)) in sizes}


def evaluate(output: torch.fx.Node, bindings: dict[torch.fx.Node, Any]) -> Any:
    """Run the cone of ``output`` on real values for its inputs (e.g. probe slot ids), on the CPU.

    A dynamic size the cone reads (a ``Sym(s0)`` placeholder) takes the size of the probe bound to the tensor with
    that symbolic size.
    """
    if bindings:
        bindings = {**_bind_sizes(bindings), **bindings}
    nodes = cone(output, bindings)
    if nodes is None:
        raise ValueError(f"{output} depends on values other than {list(bindings)}")
    env = dict(bindings)

    def load(arg: Any) -> Any:
        return env[arg] if isinstance(arg, torch.fx.Node) else arg

    for node in nodes:
        args, kwargs = tree_map(load, (node.args, dict(node.kwargs)))
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        env[node] = node.target(*args, **kwargs)
    return env[output]
