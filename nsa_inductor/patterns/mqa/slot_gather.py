"""K the model gathered from the cache through maps given as inputs -> ``nsa.gather_k_slots``.

Matches the K operands of ``nsa.mqa_logits`` (the ragged pass's rewrite over the model's own K) where the model read
them from the K cache through per-token maps an engine passed in (graph inputs), e.g.::

    values = cache[:, :P * 128].unflatten(1, (P, 128)); scales = cache[:, P * 128:].view(fp32)   # the layout's views
    page = block_table[seq_ids, positions // P]
    k8, k_scale = values[page, positions % P].view(fp8), scales[page, positions % P]
    # or by slot:  k8, k_scale = the bytes at the layout's offsets of slot_mapping[n]  (any spelling)

Rewrites to ``k8, k_scale = nsa.gather_k_slots(cache, positions, P, preshuffle, fp8, block_table, seq_ids)`` (by
slot: ``nsa.gather_k_slots(cache, slot_mapping, P, preshuffle, fp8)``) as the logits' K; the model's gather is
dropped where nothing else reads it.

Proven by probing: with random map values (every id eager indexing accepts, negative ones included, edges of pages
and tables), every sampled byte of K and of k_scale is read at the layout's offsets (DESIGN §3) of the slot the op
computes from those values. Taken as given, and recorded in the report: the values themselves (data no compile-time
proof can know: which slots this step's store wrote, the sequences' lengths, the logits' bounds), and what the op
does with ids eager rejects (zero rows, docs/indices.md). Never: a read whose offsets follow another layout or page
size, or that reads anything else than the maps (reported as a near miss).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...index_contract import python_index
from ...layout import HEAD_DIM, KCacheLayout
from ...quant import FP8_DTYPES
from ..base import GraphPass, NearMiss, PassContext
from ..fx_utils import erase_dead, insert_call, is_op, reshape, val
from . import graph_cache_layout
from .probe import INT_DTYPES, Prober, Probes, linear, shape_of
from .proofs import cache_values

SAMPLED_KEYS = 64
ROUNDS = 3


@dataclass
class SlotGather:
    """The proven read: key ``n`` is at slot ``positions[n]``, or at position ``positions[n]`` of sequence
    ``seq_ids[n]`` through ``block_table``."""

    cache: torch.fx.Node | None  # the K cache value read (set by the proof)
    positions: torch.fx.Node
    block_table: torch.fx.Node | None = None
    seq_ids: torch.fx.Node | None = None


class GatherKSlots(GraphPass):
    name = "gather_k_slots"

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext) -> Iterator[tuple]:
        leaves = cache_values(graph)
        for node in list(graph.nodes):
            if is_op(node, torch.ops.nsa.mqa_logits.default) and _reads_cache(node.args[1], leaves) \
                    and _reads_cache(node.args[2], leaves):
                yield node, leaves

    def anchor(self, candidate: tuple) -> torch.fx.Node:
        return candidate[0]

    def rewrite(self, graph: torch.fx.Graph, candidate: tuple, ctx: PassContext) -> list[str]:
        node, leaves = candidate
        layout = graph_cache_layout(leaves, ctx.decision)
        k8, k_scale = node.args[1], node.args[2]
        read = prove_slot_gather(k8, k_scale, leaves, layout)
        with graph.inserting_before(node):
            cache = read.cache
            if val(cache).dim() != 2 or val(cache).shape[-1] != layout.page_bytes:
                cache = reshape(graph, cache, [-1, layout.page_bytes])
            extra = () if read.block_table is None else (read.block_table, read.seq_ids)
            gathered = insert_call(graph, torch.ops.nsa.gather_k_slots.default,
                                   (cache, read.positions, layout.page_size, layout.preshuffle, val(k8).dtype, *extra))
            node.update_arg(1, insert_call(graph, operator.getitem, (gathered, 0)))
            node.update_arg(2, insert_call(graph, operator.getitem, (gathered, 1)))
        erase_dead(graph, [k8, k_scale])
        return taken_as_given(read, layout)

    def taken_as_given(self, rewritten: list[str]) -> list[str]:
        return rewritten


def _reads_cache(node: torch.fx.Node, leaves: set[torch.fx.Node], limit: int = 256) -> bool:
    """Whether ``node`` is computed from a K-cache value (not through an ``nsa`` op, e.g. ``nsa.gather_k``)."""
    stack, seen = [node], set()
    while stack and len(seen) < limit:
        n = stack.pop()
        if n in leaves:
            return True
        if n in seen or n.op != "call_function" or str(getattr(n.target, "namespace", "")) == "nsa":
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _index_inputs(nodes: list[torch.fx.Node], leaves: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """The integer graph inputs the reads of ``nodes`` depend on (not through the cache itself), in graph order."""
    stack, seen, found = list(nodes), set(), set()
    while stack:
        n = stack.pop()
        if n in seen or n in leaves:
            continue
        seen.add(n)
        if n.op == "placeholder":
            v = val(n)
            if isinstance(v, torch.Tensor) and v.dtype in INT_DTYPES:
                found.add(n)
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _with_edges(values: torch.Tensor, edges: list[int], round_: int) -> torch.Tensor:
    """``values`` with this round's share of ``edges`` written over its first elements."""
    n = values.shape[0]
    share = edges[round_ * n:(round_ + 1) * n] if n else []
    values[: len(share)] = torch.tensor(share, dtype=values.dtype)
    return values


def prove_slot_gather(k8: torch.fx.Node, k_scale: torch.fx.Node, leaves: set[torch.fx.Node], layout: KCacheLayout
                      ) -> SlotGather:
    """The first form (by slot, then by sequence and position over each ordered pair of maps) under which every
    sampled byte of ``k8`` (fp8 ``[N, 128]``) and ``k_scale`` (fp32 ``[N]``) is read at the layout's offsets of the
    op's slot, for random map values; :class:`NearMiss` with the reasons otherwise."""
    fp8 = val(k8).dtype
    if fp8 not in FP8_DTYPES or val(k8).dim() != 2 or val(k_scale).dtype != torch.float32:
        raise NearMiss(f"the logits' K is {val(k8).dtype} {list(val(k8).shape)}, not fp8 [N, 128]")
    keys = val(k8).shape[0]
    inputs = _index_inputs([k8, k_scale], leaves)
    tables = [n for n in inputs if val(n).dim() == 2]
    maps = [n for n in inputs if val(n).dim() == 1 and statically_known_true(val(n).shape[0] == keys)]
    if not maps:
        names = ", ".join(n.name for n in inputs) or "none"
        raise NearMiss(f"K is read from the K cache, but through no 1-D integer graph input of one id per key "
                       f"(integer inputs it reads: {names})")
    forms = [SlotGather(None, m) for m in maps] + [
        SlotGather(None, pos, table, seq) for table in tables for seq in maps for pos in maps if seq is not pos]
    reasons = []
    for form in forms:
        why = _disproof(form, k8, k_scale, leaves, layout)
        if why is None:
            return form
        reasons.append((why.startswith("probing"), f"{_describe(form)}: {why}"))
    # a form whose probe ids the graph could not even index with is no candidate: name the others where any
    reasons = [r for failed, r in reasons if not failed] or [r for _, r in reasons]
    raise NearMiss(f"K / k_scale are not read at the {layout} byte offsets of the slot of any form over the maps "
                   f"given as inputs ({'; '.join(reasons)})")


def _describe(form: SlotGather) -> str:
    if form.block_table is None:
        return f"slot {form.positions.name}[n]"
    return f"{form.block_table.name}[{form.seq_ids.name}[n], {form.positions.name}[n] // P]"


def _disproof(form: SlotGather, k8: torch.fx.Node, k_scale: torch.fx.Node, leaves: set[torch.fx.Node],
              layout: KCacheLayout) -> str | None:
    """``None`` when every probe round reads K at the form's slots, else why not (sets ``form.cache``)."""
    gen = torch.Generator().manual_seed(4321)
    keys = shape_of(k8)[0]
    cache_pages = max([1] + [math.prod(shape_of(leaf)) // layout.page_bytes for leaf in leaves])
    P = layout.page_size
    for round_ in range(ROUNDS):
        probes = Probes(None, cache_pages, keys, gen)
        slots = _bind(form, probes, cache_pages, P, keys, gen, round_)
        rows = torch.arange(keys) if keys <= SAMPLED_KEYS else \
            torch.cat([torch.arange(8), torch.randint(0, keys, (SAMPLED_KEYS,), generator=gen)])
        d = torch.arange(HEAD_DIM)
        prober = Prober(probes, leaves)
        try:
            k_leaf, k_coords, k_tr = prober.locate(k8, torch.stack([rows.repeat_interleave(HEAD_DIM),
                                                                   d.repeat(rows.shape[0])], 1))
            s_leaf, s_coords, s_tr = prober.locate(k_scale, rows[:, None])
        except NearMiss as miss:
            return str(miss)
        fp8 = val(k8).dtype
        if k_leaf not in leaves or k_tr != [("view_dtype", torch.uint8, fp8)] or s_leaf is not k_leaf \
                or s_tr != [("view_dtype", torch.uint8, torch.float32)]:
            return (f"K ({k_leaf.name}: {k_tr}) and k_scale ({s_leaf.name}: {s_tr}) are not byte views of one K "
                    "cache")
        if math.prod(shape_of(k_leaf)) != cache_pages * layout.page_bytes:
            return f"cache {k_leaf.name} {shape_of(k_leaf)} is not {cache_pages} {layout} pages"
        want_k = layout.value_offsets(slots[rows]).flatten()
        if not torch.equal(linear(k_coords, shape_of(k_leaf)), want_k):
            return f"K's bytes are not at the {layout} offsets of the slot"
        if not torch.equal(linear(s_coords, shape_of(s_leaf)), layout.scale_offsets(slots[rows])[:, 0]):
            return f"k_scale's bytes are not at the {layout} offsets of the slot"
        form.cache = k_leaf
    return None


def _bind(form: SlotGather, probes: Probes, num_pages: int, P: int, keys: int, gen: torch.Generator, round_: int
          ) -> torch.Tensor:
    """Bind probe values to the form's maps (ids eager accepts, negative ones and edges included); the slots the
    op reads for them."""

    def ids(node, size, edges):
        v = _with_edges(torch.randint(-size, size, (keys,), generator=gen), edges, round_)
        probes.values[node] = v.to(val(node).dtype)
        return v

    if form.block_table is None:
        num_slots = num_pages * P
        slots = ids(form.positions, num_slots, [0, num_slots - 1, -1, -num_slots, P - 1, min(P, num_slots - 1)])
        return python_index(slots, num_slots)[0]
    batch, width = shape_of(form.block_table)
    pages = (torch.randperm(2 * num_pages, generator=gen) - num_pages).repeat(-(-batch * width // (2 * num_pages)))
    table = pages[: batch * width].view(batch, width)
    probes.values[form.block_table] = table.to(val(form.block_table).dtype)
    span = width * P
    seq = python_index(ids(form.seq_ids, batch, [batch - 1, -1, -batch, 0]), batch)[0]
    pos = python_index(ids(form.positions, span, [P - 1, min(P, span - 1), span - 1, -1, -span, 0]), span)[0]
    page = python_index(table[seq, pos // P], num_pages)[0]
    return page * P + pos % P


def taken_as_given(read: SlotGather, layout: KCacheLayout) -> list[str]:
    """What the rewrite did not prove, for the pass report."""
    if read.block_table is None:
        form = f"key n is read at slot {read.positions.name}[n]"
    else:
        form = (f"key n is read at position {read.positions.name}[n] of sequence {read.seq_ids.name}[n] through "
                f"{read.block_table.name}")
    return [
        f"{form} (proven as a function of the maps' values, {layout} byte offsets)",
        "the maps' values are data: not proven to address the keys the logits' bounds describe, nor slots this "
        "step's store wrote, nor to be in range",
        "ids eager indexing rejects read a zero row and scale, where eager raises (docs/indices.md; nsa.checks: "
        "an error)",
    ]
