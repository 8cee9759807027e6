"""FX helpers shared by the passes: op tests, argument reads, the view-op set and the one view-chain walker, node
insertion with fake metadata, reshape/replace, symbolic-size proofs, evaluating an index sub-graph on probe
inputs (to check what an expression computes, whatever its spelling), and the act_quant matcher."""

from __future__ import annotations

import contextlib
import operator
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch._inductor.pattern_matcher import get_arg_value
from torch.fx.experimental.symbolic_shapes import guard_int, statically_known_true
from torch.utils._pytree import tree_flatten, tree_map

from ..quant import AMAX_FLOOR, FP8_DTYPES, fp8_max
from .base import NearMiss

aten = torch.ops.aten
prims = torch.ops.prims

# The view ops: the same elements in the same row-major order, on the same storage (no copy of values).
VIEW_OPS = (
    aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.alias.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default, aten.flatten.using_ints,
)
# Copies that hold the same elements in the same row-major order (in a fresh buffer).
VALUE_COPIES = (aten.clone.default, aten.contiguous.default)


def is_op(node: Any, *targets: Any) -> bool:
    """``node`` calls one of ``targets`` (an OpOverload, or an OpOverloadPacket matching all its overloads)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    for target in targets:
        if node.target is target or getattr(node.target, "overloadpacket", None) is target:
            return True
    return False


def arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` of a call, or its keyword ``name``, or ``default`` when neither is given (or it is None)."""
    value = get_arg_value(node, index, name)
    return default if value is None else value


def walk_back(node: Any, step: Callable[[torch.fx.Node], Any]) -> tuple[Any, list[torch.fx.Node]]:
    """Follow ``step`` (a node -> the node it re-reads, or ``None``) back from ``node``: ``(root, chain)``, the chain
    ordered from the root outwards (without the root)."""
    chain = []
    while isinstance(node, torch.fx.Node):
        nxt = step(node)
        if not isinstance(nxt, torch.fx.Node):
            break
        chain.append(node)
        node = nxt
    return node, chain[::-1]


def view_chain(node: Any, ops: tuple = VIEW_OPS) -> tuple[Any, list[torch.fx.Node]]:
    """``walk_back`` through ``ops`` (each re-reads its first argument)."""
    return walk_back(node, lambda n: n.args[0] if is_op(n, *ops) else None)


def value_step(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input ``node`` holds the same elements as (in row-major order), or ``None`` if ``node`` computes: views,
    value copies, same-dtype converts, and ``copy(dst, s)`` with ``dst`` and ``s`` of one shape and dtype."""
    if is_op(node, *VIEW_OPS, *VALUE_COPIES):
        return node.args[0]
    if is_op(node, prims.convert_element_type.default):
        src = node.args[0]
        ts, tn = tensor_val(src), tensor_val(node)
        return src if ts is not None and tn is not None and ts.dtype == tn.dtype else None
    if is_op(node, aten.copy.default):
        dst, src = node.args[0], node.args[1]
        td, ts = tensor_val(dst), tensor_val(src)
        if td is not None and ts is not None and td.dtype == ts.dtype and same_shape(dst, src):
            return src
    return None


def value_root(node: Any) -> Any:
    """Follow :func:`value_step` back as far as it goes."""
    return walk_back(node, value_step)[0]


def is_store(node: Any) -> bool:
    """An ``nsa.quant_cache_store`` an earlier pass inserted (``auto_functionalized``: its arguments are kwargs)."""
    return (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target is torch.ops.higher_order.auto_functionalized
            and node.args[0] is torch.ops.nsa.quant_cache_store.default)


def live_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Users that are read or have effects (a dead node left by an earlier rewrite does not count)."""
    return [u for u in node.users if u.users or u.op == "output" or u.is_impure()]


def set_arg(node: torch.fx.Node, name: str, value: Any) -> None:
    """Argument ``name`` of the op call ``node`` set to ``value`` where it is: positional (an earlier pass may have
    spelled every argument out) or keyword."""
    index = [a.name for a in node.target._schema.arguments].index(name)
    if index < len(node.args):
        node.args = (*node.args[:index], value, *node.args[index + 1:])
    else:
        node.kwargs = {**node.kwargs, name: value}


def tensor_val(node: Any) -> torch.Tensor | None:
    """``val(node)`` when it is a tensor, else ``None``."""
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def val(node: Any) -> Any:
    """The fake value Inductor recorded for ``node`` (``None`` for non-nodes or missing metadata)."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def insert_call(graph: torch.fx.Graph, target: Callable, args: tuple, kwargs: dict | None = None,
                like: torch.fx.Node | None = None) -> torch.fx.Node:
    """Add ``target(*args, **kwargs)`` at the graph's insertion point, with ``meta["val"]`` computed on fakes.

    ``like``: a node whose fake value supplies the fake mode when no argument is a tensor (``iota``)."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    fake_args, fake_kwargs = tree_map(sym_value, (args, kwargs))
    tensors = [v for v in tree_flatten((fake_args, fake_kwargs))[0] if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode(tensors or ([val(like)] if like is not None else []))
    with mode or contextlib.nullcontext():
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
    """Bind symbolic-size placeholders (dynamic shapes) to the sizes of the probe values given for tensors, or to
    the value a guard fixed them to (e.g. the K cache's sizes: :func:`fixed_shape`)."""
    sizes: dict[str, int] = {}
    for node, value in bindings.items():
        fake = val(node)
        if isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor):
            for symbolic, real in zip(fake.shape, value.shape):
                sizes.setdefault(str(symbolic), int(real))
    graph = next(iter(bindings)).graph
    bound = {}
    for node in graph.find_nodes(op="placeholder"):
        if isinstance(val(node), torch.SymInt):
            size = sizes.get(str(val(node)), as_int(node))
            if size is not None:
                bound[node] = size
    return bound


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


def sym_value(x: Any) -> Any:
    """The fake value of a node (a SymInt, a fake tensor), anything else as it is."""
    return val(x) if isinstance(x, torch.fx.Node) else x


def _provable(a: Any, b: Any, relation: Callable[[Any, Any], Any]) -> bool:
    """``relation(a, b)`` holds for ints, SymInts or FX nodes holding SymInts, proven without adding guards."""
    a, b = sym_value(a), sym_value(b)
    if a is None or b is None:
        return False
    try:
        return bool(statically_known_true(relation(a, b)))
    except Exception:  # noqa: BLE001 - anything unprovable counts as "not known"
        return False


def sym_equal(a: Any, b: Any) -> bool:
    """``a == b`` proven without adding guards (two missing values count as equal)."""
    if a is b or sym_value(a) is None and sym_value(b) is None:
        return True
    return _provable(a, b, operator.eq)


def known_ge(a: Any, b: Any) -> bool:
    """``a >= b`` proven without adding guards."""
    return _provable(a, b, operator.ge)


def as_int(x: Any) -> int | None:
    """A plain int for an int, a constant SymInt or a node holding one; ``None`` when symbolic."""
    x = sym_value(x)
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        try:
            return int(x.node.expr) if x.node.expr.is_number else None
        except Exception:  # noqa: BLE001
            return None
    return None


def fixed_shape(node: torch.fx.Node) -> tuple[int, ...]:
    """The shape of graph input ``node`` (a K cache) as ints: sizes that Dynamo made symbolic (``dynamic=True``
    makes every size so) are fixed to this compile's example, with a guard, so that another cache shape recompiles
    instead of running a layout the passes proved for this one. A size the user marked dynamic
    (``torch._dynamo.mark_dynamic``: fixing it would fail the compile) is a near miss."""
    shape = val(node).shape
    marked = _marked_dynamic(shape)
    if marked is not None:
        raise NearMiss(f"the cache's size {marked} is marked dynamic (torch._dynamo.mark_dynamic): the passes need "
                       "the cache's shape fixed at compile time")
    return tuple(guard_int(size) for size in shape)


def _marked_dynamic(sizes: Iterable[Any]) -> str | None:
    """The first of ``sizes`` that Dynamo was told to keep symbolic (a dimension constraint on the input it comes
    from that is not only a warning, as automatic-dynamic sizes' are), as ``symbol (source)``; None outside a Dynamo
    compile."""
    from torch._dynamo.source import TensorProperty, TensorPropertySource
    from torch._guards import TracingContext

    tracing = TracingContext.try_get()
    symbolic = [size for size in sizes if isinstance(size, torch.SymInt) and not size.node.expr.is_number]
    if tracing is None or not symbolic:
        return None
    constrained = {TensorPropertySource(ctx.tensor_source, TensorProperty.SIZE, dim)
                   for ctx in getattr(tracing, "tensor_to_context", {}).values()
                   if getattr(ctx, "tensor_source", None) is not None
                   for dim, constraint in enumerate(getattr(ctx, "constraint_sizes", None) or ())
                   if constraint is not None and not getattr(constraint, "warn_only", False)}
    for size in symbolic:
        for source in size.node.shape_env.var_to_sources.get(size.node.expr, ()):
            if source in constrained:
                return f"{size} ({source.name() if callable(source.name) else source.name})"
    return None


def same_shape(a: Any, b: Any) -> bool:
    """Fake values of ``a`` and ``b`` have provably equal shapes (symbolic sizes compared without guards)."""
    ta, tb = val(a), val(b)
    if not isinstance(ta, torch.Tensor) or not isinstance(tb, torch.Tensor) or ta.dim() != tb.dim():
        return False
    return all(sym_equal(x, y) for x, y in zip(ta.shape, tb.shape))


def norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else dim


def slice_params(node: torch.fx.Node, first: int) -> tuple:
    """``(dim, start, end, step)`` of a slice (``first`` = 1) or slice_scatter (``first`` = 2), defaults filled."""

    return (arg(node, first, "dim", 0), arg(node, first + 1, "start", 0), arg(node, first + 2, "end", sys.maxsize),
            arg(node, first + 3, "step", 1))


def describe(node: Any) -> str:
    """``name (op)`` for messages."""
    if not isinstance(node, torch.fx.Node):
        return repr(node)
    target = getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else node.op
    return f"{node.name} ({target})"


def copy_destination_only(node: torch.fx.Node) -> bool:
    """Every user of ``node`` is a ``copy`` into it (its elements are never read); true when it has no users."""
    return all(is_op(u, aten.copy.default) and u.args[0] is node and node not in u.args[1:] for u in node.users)


def erase_dead(graph: torch.fx.Graph, nodes: Iterable[torch.fx.Node]) -> None:
    """Erase ``nodes`` and, transitively, their inputs once they have no users (pure call_function nodes only)."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if getattr(node, "_erased", False) or node.graph is not graph or node.op != "call_function" \
                or node.users or node.is_impure():
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        stack.extend(inputs)


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
    raise NearMiss(f"cannot express the symbolic size {size} from the graph inputs")


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
                    except NearMiss:
                        unknown.append(i)
            if len(unknown) > 1:
                raise NearMiss(f"cannot express the logits shape {out_shape} from the graph inputs")
            for i in unknown:
                sizes[i] = -1
        else:
            sizes = [-1 if s is None else s for s in sizes]
        new = insert_call(graph, aten.reshape.default, (new, sizes))
    old.replace_all_uses_with(new)
    erase_dead(graph, [old])


# -----------------------------------------------------------------------------------------------------------------
# act_quant
# -----------------------------------------------------------------------------------------------------------------


@dataclass
class ActQuant:
    """``quant.act_quant`` found in a graph: ``x`` (before its fp32 cast and the reshape into blocks), the fp8
    ``values`` and the ``scale`` nodes (both block-shaped), and its constants."""

    x: torch.fx.Node
    values: torch.fx.Node  # the fp8 convert
    scale: torch.fx.Node
    scale_fmt: str
    fp8_dtype: torch.dtype
    fp8_max: float  # the clamp bound: the type's max or less (SGLang's 224 for fnuz q)
    block: int


def _scalar(node_or_value) -> float:
    if isinstance(node_or_value, torch.fx.Node):
        raise NearMiss(f"{node_or_value.name} is not a constant")
    return float(node_or_value)


def _fp32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def _match_clamp(node: torch.fx.Node) -> tuple[torch.fx.Node, float, float]:
    if is_op(node, aten.clamp.default):
        return node.args[0], _scalar(node.args[1]), _scalar(node.args[2])
    if is_op(node, aten.clamp_max.default) and is_op(node.args[0], aten.clamp_min.default):
        return node.args[0].args[0], _scalar(node.args[0].args[1]), _scalar(node.args[1])
    if is_op(node, aten.clamp_min.default) and is_op(node.args[0], aten.clamp_max.default):
        return node.args[0].args[0], _scalar(node.args[1]), _scalar(node.args[0].args[1])
    raise NearMiss("the quantized values are not clamped to [-fp8 max, fp8 max]")


def _match_scale(scale: torch.fx.Node, blocks: torch.fx.Node, fmax: float) -> str:
    """Returns the scale format after checking ``amax(|x|).clamp(1e-4) / fmax`` [``-> 2^ceil(log2(.))``]."""
    raw, fmt = scale, "fp32"
    if is_op(scale, aten.exp2.default) or is_op(scale, aten.pow.Scalar) and _scalar(scale.args[0]) == 2.0:
        exponent = scale.args[0] if is_op(scale, aten.exp2.default) else scale.args[1]
        if not is_op(exponent, aten.ceil.default) or not is_op(exponent.args[0], aten.log2.default):
            raise NearMiss("a power-of-two scale must be 2^ceil(log2(amax / fp8 max))")
        raw, fmt = exponent.args[0].args[0], "ue8m0"
    # The factor is applied in fp32, so amax / d is the op's amax / fmax only where fp32(d) == fmax. A multiply by
    # fp32(1 / fmax) is one rounding away: an fp32 scale keeps that rounding, 2^ceil(log2(.)) loses it (the rounding
    # never crosses a power of two: every fp32 amax checked for fmax 224, 240, 448 and 57344).
    if is_op(raw, aten.div.Tensor):
        divisor = _scalar(raw.args[1])
        if _fp32(divisor) != fmax:
            raise NearMiss(f"the scale divides by {divisor}, but the fp8 type's max is {fmax}")
    elif is_op(raw, aten.mul.Tensor):
        factor = _scalar(raw.args[1])
        if _fp32(factor) != _fp32(1.0 / fmax):
            raise NearMiss(f"the scale multiplies by {factor}, not by 1 / the fp8 type's max {fmax}")
        if fmt == "fp32":
            raise NearMiss(f"the fp32 scale multiplies by 1 / {fmax}, one rounding from the op's division by it")
    else:
        raise NearMiss("the scale is not amax / fp8 max")
    floor = raw.args[0]
    if not is_op(floor, aten.clamp_min.default) or abs(_scalar(floor.args[1]) - AMAX_FLOOR) > 1e-12:
        raise NearMiss(f"amax is not floored at {AMAX_FLOOR}")
    amax = floor.args[0]
    if not is_op(amax, aten.amax.default) or not is_op(amax.args[0], aten.abs.default):
        raise NearMiss("the scale is not built from amax(|x|)")
    dims = [int(d) % val(blocks).dim() for d in amax.args[1]]
    keepdim = arg(amax, 2, "keepdim", False)
    if amax.args[0].args[0] is not blocks or dims != [val(blocks).dim() - 1] or not keepdim:
        raise NearMiss("amax is not taken over the last dimension of the quantized blocks (with keepdim), so the "
                      "scale is not one per block")
    return fmt


def match_act_quant(values: torch.fx.Node) -> ActQuant:
    """Prove ``values`` is the fp8 output of ``quant.act_quant`` (DESIGN §2 step 4), however it is spelled after
    decomposition: ``clamp(x / scale, +-fmax)`` cast to fp8, ``scale = amax(|x|).clamp(1e-4) / fmax``
    [``-> 2^ceil(log2(.))``] over the last dimension of the blocks."""
    if not is_op(values, prims.convert_element_type.default) or values.args[1] not in FP8_DTYPES:
        raise NearMiss(f"the quantized values are not an fp8 cast ({values.target})")
    fp8_dtype = values.args[1]
    quotient, low, high = _match_clamp(values.args[0])
    if low != -high or not 0 < high <= fp8_max(fp8_dtype):
        raise NearMiss(f"values clamped to [{low}, {high}], but {fp8_dtype}'s max is {fp8_max(fp8_dtype)}")
    if not is_op(quotient, aten.div.Tensor) or not isinstance(quotient.args[1], torch.fx.Node):
        raise NearMiss("the values are not x / scale")
    blocks, scale = quotient.args
    scale_fmt = _match_scale(scale, blocks, high)
    x = _squeezed_root(blocks)
    if is_op(x, prims.convert_element_type.default) and val(x).dtype == torch.float32:
        x = x.args[0]
    return ActQuant(x, values, scale, scale_fmt, fp8_dtype, high, int(val(blocks).shape[-1]))


def _squeezed_root(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor behind views (a ``select`` of a size-1 dim counts as a squeeze): the same values, reshaped."""
    return walk_back(node, lambda n: n.args[0] if is_op(n, *VIEW_OPS) or (
        is_op(n, aten.select.int) and int(val(n.args[0]).shape[n.args[1]]) == 1) else None)[0]
