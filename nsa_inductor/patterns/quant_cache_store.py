"""act_quant followed by the K-cache store -> one ``nsa.quant_cache_store``.

Eager idiom (``Indexer.store_k`` and ``KCacheLayout.store``)::

    k_fp8, k_scale = act_quant(k)                       # amax, 1e-4 floor, / fp8 max, [2^ceil(log2)], clamp, cast
    cache.view(-1)[value_offsets(slot)] = k_fp8 bytes   # or values[page, pos] = ... through views of the page bytes
    cache.view(-1)[scale_offsets(slot)] = k_scale bytes # or scales[page, pos] = k_scale on an fp32 view

Matches the ``index_put`` chain on views of the cache ending in the epilogue ``copy_`` into the cache input, once
probing proves the bytes written are the layout's offsets of each slot, the values are that act_quant's, and
padding is masked (``where(slot >= 0, new - old, 0)``) or wraps like Python indices. The mask may also keep only
the last of tokens sharing a slot (``KCacheLayout.store``): the op does that itself (docs/indices.md).
Rewrites to ``auto_functionalized(nsa.quant_cache_store, ...)`` (reinplaced: no copy of the cache); a quantized
``(y_fp32 * c).to(bf16)`` (or ``/ c``) used only here is folded in (``input_scale=c, input_dtype=bf16``).
The layout is the guard's format with the cache's own page size (its row bytes / 132).
Never: other offsets, another fp8 max or floor, a scale not of the quantized values, a dynamic-shaped cache, a cache
whose page size contradicts the guard's format (preshuffle needs multiples of 16).

No token (an empty batch, decode B=0 or prefill T=0: Dynamo specialises that count too): where every write's
index holds no element, the chain writes no byte, so the store is removed (the cache is copied back onto itself,
which Inductor drops); layout and values need no proof then. A write that indexes anything is a near miss.

Size 1 (decode B=1, prefill T=1): Dynamo specialises the token count, so the graph spells one token's rows as
``[128]`` / ``[]`` / ``[1, 32]``, the slot mapping may be 0-d, and K may be squeezed or expanded. The checks are
made on a canonical form instead of more literal patterns: a statically one-token slot mapping (0-d or ``[1]``)
makes every byte written belong to that token (probed one slot at a time, in the traced shape), the written
values must hold exactly one row's bytes (no broadcast), and ``squeeze``/``unsqueeze``/``expand``/``select``/
``permute`` that keep the bytes in order are looked through.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..capability import LayoutDecision, cache_layout
from ..layout import KCacheLayout, written_slots
from ..quant import fp8_max
from .base import GraphPass, NearMiss, PassContext
from .fx_utils import (VALUE_COPIES, VIEW_OPS, ActQuant, aten, arg, evaluate, fixed_shape, insert_call, is_op,
                       known_ge, match_act_quant, norm_dim, prims, same_shape, slice_params, sym_equal, val, walk_back)

# Ops that re-read the same bytes in row-major order: a destination seen through them is still the cache.
REINTERPRET_OPS = VIEW_OPS + (aten.view.dtype,)


@dataclass
class Write:
    node: torch.fx.Node  # the index_put
    offsets: torch.Tensor | None  # [probe, bytes_per_token] byte offsets written for each probe slot (None: no token)
    masked: bool  # True: writes nothing for negative slots; False: negative slots wrap
    payload: torch.fx.Node  # the new value (before the masked delta)


def _keeps_bytes(node: torch.fx.Node) -> bool:
    """``node`` holds its input's elements in the same row-major order: reshapes, dtype views, value copies, and the
    size-1 spellings (``select`` of a size-1 dim, an ``expand`` that adds no elements, a ``permute`` that moves only
    size-1 dims)."""
    if is_op(node, *REINTERPRET_OPS, *VALUE_COPIES):
        return True
    src = val(node.args[0]) if node.op == "call_function" and node.args else None
    if not isinstance(src, torch.Tensor):
        return False
    if is_op(node, aten.select.int):
        return str(src.shape[node.args[1]]) == "1"
    if is_op(node, aten.expand.default):
        return str(val(node).numel()) == str(src.numel())
    if is_op(node, aten.permute.default):
        kept = [d % src.dim() for d in node.args[1] if str(src.shape[d]) != "1"]
        return kept == sorted(kept)
    return False


def _strip(node: torch.fx.Node) -> torch.fx.Node:
    """The producer behind byte-preserving reinterpretations (:func:`_keeps_bytes`)."""
    return walk_back(node, lambda n: n.args[0] if _keeps_bytes(n) else None)[0]


def _same_storage(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = val(a), val(b)
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and StorageWeakRef(va.untyped_storage()) == StorageWeakRef(vb.untyped_storage()))


def _slice_range(node: torch.fx.Node, first: int) -> tuple:
    dim, start, end, step = slice_params(node, first)
    return norm_dim(dim, val(node.args[0]).dim()), start, end, step


def _contiguous_from_zero(node: torch.fx.Node) -> bool:
    v = val(node)
    return v.storage_offset() == 0 and v.is_contiguous()


def _dest_root(dest: torch.fx.Node, scatters: list[torch.fx.Node]) -> torch.fx.Node:
    """The value a write's destination is a window of; pops the slice_scatter that puts the window back."""
    node = walk_back(dest, lambda n: n.args[0] if is_op(n, *REINTERPRET_OPS) and _same_storage(n, n.args[0])
                     else None)[0]
    if scatters and is_op(node, aten.slice.Tensor) and node.args[0] is scatters[-1].args[0]:
        if _slice_range(node, 1) != _slice_range(scatters[-1], 2):
            raise NearMiss("a window of the cache is written back at another place than it was read from")
        if not _same_storage(node, node.args[0]):
            raise NearMiss("the written window is a copy, not a view of the cache")
        return scatters.pop().args[0]
    if not _contiguous_from_zero(node) or val(dest).numel() * val(dest).element_size() != val(node).numel() * val(
            node).element_size():
        raise NearMiss("a write goes through a partial view of the cache that is not scattered back")
    return node


def _probe_slots(layout: KCacheLayout, num_slots: int) -> torch.Tensor:
    """Distinct slot ids that tell layouts apart: whole first pages, both ends of the cache, and padding values
    (distinct: a store may let only the last of equal slots write, docs/indices.md)."""
    first = torch.arange(min(num_slots, 3 * max(layout.page_size, 16) + 3))
    ends = sorted({num_slots - 1, num_slots - layout.page_size, num_slots // 2 + 5})
    return torch.cat([first, torch.tensor([s for s in ends if first.numel() <= s < num_slots], dtype=torch.long),
                      torch.tensor([-1, -2, -layout.page_size - 1])])


def _slot_input(nodes: list[torch.fx.Node]) -> torch.fx.Node:
    leaves: set[torch.fx.Node] = set()
    stack = list(nodes)
    seen: set[torch.fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            leaves.add(node)
        stack.extend(node.all_input_nodes)
    tensors = [n for n in leaves if isinstance(val(n), torch.Tensor)]
    if len(tensors) != 1 or val(tensors[0]).dim() > 1 or val(tensors[0]).dtype not in (torch.int32, torch.int64):
        found = [f"{n.name} {val(n).dtype} {list(val(n).shape)}" for n in tensors]
        raise NearMiss(f"the write indices must depend on one integer input holding one slot per token (the slot "
                       f"mapping: 1-D, or 0-d for one token), found {found}")
    return tensors[0]


def _one_token(slot: torch.fx.Node) -> bool:
    """The slot mapping statically holds one slot: ``[1]`` (Dynamo's size-1 specialisation) or 0-d."""
    return str(val(slot).numel()) == "1"


def _no_tokens(slot: torch.fx.Node) -> bool:
    """The slot mapping statically holds no slot (an empty batch)."""
    return str(val(slot).numel()) == "0"


def _tokens(slot: torch.fx.Node):
    """Token count of the slot mapping (an int or a SymInt)."""
    return 1 if val(slot).dim() == 0 else val(slot).shape[0]


def _same_tokens(a, b) -> bool:
    """Token counts ``a`` (rows written, rows of K) and ``b`` (the slot mapping's) are equal for every input the graph
    accepts: provably equal, or two symbolic sizes each known to be >= 2 that the store broadcasts together (a size
    >= 2 broadcasts only to itself, so eager raises unless they are equal). Dynamo gives the rows of ``x`` and the
    slot mapping's length two symbols when nothing in the graph compares them elementwise; :func:`_unify_tokens`
    records the equality the graph relies on."""
    symbolic = isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt)
    if sym_equal(a, b) or (symbolic and known_ge(a, 2) and known_ge(b, 2)):
        return True
    # Engines pass the slot mapping as its own input: its size may be another symbol, or a constant. Example values
    # equal and not 1 (a size that is not 1 broadcasts only to itself); :func:`_unify_tokens` records the guard.
    hint_a, hint_b = (x if isinstance(x, int) else x.node.hint for x in (a, b))
    return hint_a is not None and hint_a == hint_b and hint_a != 1


def _unify_tokens(a, b) -> None:
    """Tell the shape environment ``a == b`` (a guard every valid input meets, see :func:`_same_tokens`), so the op's
    fake sees one token count."""
    if not sym_equal(a, b):
        torch._check(a == b, lambda: f"the slot mapping's length {b} and K's rows {a} must be equal")


def _per_slot(compute, slot: torch.fx.Node, probe: torch.Tensor) -> torch.Tensor:
    """``[probe, -1]``: row ``i`` is what ``compute`` gives for probe slot ``i``.

    ``compute`` runs on slot mappings of the traced length, so a cone holding tensors of that size (the eager
    store's ``[T, T]`` duplicate test) evaluates too. One token: each probe slot alone, in the slot mapping's traced
    shape (a squeezed ``[]``/``[1]`` graph need not broadcast over a longer probe), and everything it gives belongs
    to that token. A fixed token count ``T``: the probe in chunks of ``T``, padded with distinct negative slots whose
    rows are dropped. A symbolic one: the whole probe (the symbol takes its length). The leading dim of what
    ``compute`` gives must be the token dim."""
    if _one_token(slot):
        shape = tuple(val(slot).shape)
        return torch.cat([compute(p.reshape(shape)).reshape(1, -1) for p in probe])
    tokens = _tokens(slot)
    if not isinstance(tokens, int):
        return _rows(compute, probe)
    filler = int(probe.min()) - 1 - torch.arange(tokens)
    chunks = [torch.cat([chunk, filler[: tokens - len(chunk)]]) for chunk in probe.split(tokens)]
    return torch.cat([_rows(compute, chunk) for chunk in chunks])[: probe.shape[0]]


def _rows(compute, slots: torch.Tensor) -> torch.Tensor:
    """What ``compute`` gives for ``slots``, one row per slot."""
    out = compute(slots)
    if out.dim() == 0 or out.shape[0] != slots.shape[0]:
        raise NearMiss("the write's index does not have one row per token")
    return out.reshape(slots.shape[0], -1)


def _written_offsets(dest: torch.fx.Node, indices: list, slot: torch.fx.Node, probe: torch.Tensor) -> torch.Tensor:
    """Byte offsets (relative to the cache's storage) each probe slot's write touches, in element order."""
    dval = val(dest)
    for index in indices:
        if index is None:
            raise NearMiss("index_put with a None (sliced) index")
    strides = [int(s) for s in dval.stride()]
    trailing = list(zip(dval.shape[len(indices):], strides[len(indices):]))

    def elements(slots: torch.Tensor) -> torch.Tensor:
        index_vals = []
        for dim, index in enumerate(indices):
            try:
                idx = evaluate(index, {slot: slots}).long()
            except ValueError:
                raise NearMiss(f"index {index} depends on more than the slot mapping") from None
            size = int(dval.shape[dim])
            index_vals.append(torch.where(idx < 0, idx + size, idx))
        index_vals = torch.broadcast_tensors(*index_vals)
        element = int(dval.storage_offset()) + sum(i * s for i, s in zip(index_vals, strides))
        for size, stride in trailing:
            element = element.unsqueeze(-1) + torch.arange(int(size)) * stride
        return element

    element = _per_slot(elements, slot, probe)
    itemsize = dval.element_size()
    return (element.unsqueeze(-1) * itemsize + torch.arange(itemsize)).reshape(probe.shape[0], -1)


def _masked_payload(values: torch.fx.Node, dest: torch.fx.Node, indices: list, slot: torch.fx.Node,
                    probe: torch.Tensor, num_slots: int) -> torch.fx.Node:
    """``where(mask, new - dest[indices], 0)``: returns ``new``. The mask must be ``slot >= 0`` on distinct slots in
    the cache and let the last token (or every token) write a shared slot (:func:`_check_duplicates`)."""
    if not is_op(values, aten.where.self) or not is_op(values.args[1], aten.sub.Tensor):
        raise NearMiss("an accumulating write must add where(slot >= 0, new - old, 0)")
    mask, delta, other = values.args
    new, old = delta.args
    zero = other if not isinstance(other, torch.fx.Node) else evaluate(other, {})
    if float(zero) != 0:
        raise NearMiss(f"the masked-out delta is {zero}, not 0")
    if not is_op(old, aten.index.Tensor) or old.args[0] is not dest or list(old.args[1]) != list(indices):
        raise NearMiss("the accumulated delta does not subtract the bytes already at the written offsets")
    def keep(slots: torch.Tensor) -> torch.Tensor:
        try:
            return evaluate(mask, {slot: slots})
        except ValueError:
            raise NearMiss("the padding mask depends on more than the slot mapping") from None

    rows = _per_slot(keep, slot, probe)
    if not (rows == (probe >= 0)[:, None]).all():
        raise NearMiss("the padding mask is not slot >= 0")
    if not _one_token(slot):
        _check_duplicates(keep, slot, num_slots)
    return new


def _check_duplicates(keep, slot: torch.fx.Node, num_slots: int) -> None:
    """Of tokens sharing a slot the mask lets the last write (``KCacheLayout.store``) or all of them (a store with
    no rule for duplicates, whose eager bytes are then no token's): the op writes the last (docs/indices.md), so it
    can take the mask's place. Any other choice (e.g. the first) is a near miss."""
    tokens = _tokens(slot)
    length = tokens if isinstance(tokens, int) else 6  # a symbolic count takes the length of the probe
    shared = torch.arange(length) % max(1, min((length + 1) // 2, num_slots))  # every slot written twice or more
    rows = _rows(keep, shared)
    if not ((rows == (shared >= 0)[:, None]).all() or (rows == written_slots(shared, num_slots)[:, None]).all()):
        raise NearMiss("of tokens sharing a slot, the padding mask lets another token than the last write it (the "
                       "op writes the last, docs/indices.md)")


def _parse_writes(final: torch.fx.Node, cache: torch.fx.Node, layout: KCacheLayout, num_slots: int
                  ) -> tuple[list[Write], torch.fx.Node]:
    """Walk back from the value copied into the cache to the cache input, collecting every write on the way.

    Between writes only byte-preserving reshapes, dtype views and slice_scatters of a window read from the same
    value are allowed, so each write's fake-tensor strides say exactly which cache bytes it lands on.
    """
    probe = _probe_slots(layout, num_slots)
    writes: list[Write] = []
    scatters: list[torch.fx.Node] = []
    slot = None
    node = final
    if not _contiguous_from_zero(cache):
        raise NearMiss("the cache input is not contiguous")
    while node is not cache or scatters:
        if is_op(node, *REINTERPRET_OPS):
            node = node.args[0]
        elif is_op(node, aten.slice_scatter.default):
            scatters.append(node)
            node = node.args[1]
        elif is_op(node, aten.index_put.default):
            dest, indices, values = node.args[:3]
            accumulate = bool(arg(node, 3, "accumulate", False))
            indices = list(indices)
            slot = slot or _slot_input([i for i in indices if i is not None])
            if _no_tokens(slot):
                if None in indices or str(torch.broadcast_shapes(*(val(i).shape for i in indices)).numel()) != "0":
                    raise NearMiss("the slot mapping holds no token, but a write into the cache indexes some place")
                writes.append(Write(node, None, accumulate, values))
                node = _dest_root(dest, scatters)
                continue
            offsets = _written_offsets(dest, indices, slot, probe)
            payload = _masked_payload(values, dest, indices, slot, probe, num_slots) if accumulate else values
            index_rank = max(val(i).dim() for i in indices)
            rank = index_rank + val(dest).dim() - len(indices)  # of the written region, token dim first
            if not _one_row_per_token(payload, slot, offsets.shape[1], rank):
                pval = val(payload)
                raise NearMiss(f"the written values are not one row of bytes per token (values {pval.dtype} "
                               f"{list(pval.shape)}, {offsets.shape[1]} bytes per token, slot mapping "
                               f"{list(val(slot).shape)})")
            writes.append(Write(node, offsets, accumulate, payload))
            node = _dest_root(dest, scatters)
        else:
            raise NearMiss(f"the value copied into the cache is built by {node.target}, not by writes into the cache")
    if not writes:
        raise NearMiss("no write into the cache was found")
    return writes, slot


def _one_row_per_token(payload: torch.fx.Node, slot: torch.fx.Node, bytes_per_token: int, rank: int) -> bool:
    """The written values hold one row of ``bytes_per_token`` bytes per token, none broadcast: ``[T, ...]`` of the
    written region's ``rank`` for many tokens; for one token any shape holding exactly that many bytes (``[128]``,
    ``[1, 32]``, a 0-d scale)."""
    pval = val(payload)
    if _one_token(slot):
        return str(pval.numel() * pval.element_size()) == str(bytes_per_token)
    shape = pval.shape
    if len(shape) != rank or not _same_tokens(shape[0], val(slot).shape[0]):
        return False
    row_bytes = pval.element_size()
    for size in shape[1:]:
        if not isinstance(size, int):
            return False
        row_bytes *= size
    return row_bytes == bytes_per_token


def _match_cached_act_quant(values: torch.fx.Node) -> ActQuant:
    """The act_quant the cache holds: the fp8 type's own max, 128-value blocks of a ``[..., 128]`` k (one token's row
    may arrive squeezed: ``[128]``)."""
    quant = match_act_quant(values)
    fmax = fp8_max(quant.fp8_dtype)
    if quant.fp8_max != fmax:
        raise NearMiss(f"values clamped to [{-quant.fp8_max}, {quant.fp8_max}], but {quant.fp8_dtype}'s max is {fmax}")
    if quant.block != 128:
        raise NearMiss(f"quant block is {quant.block} wide, the cache holds 128-value blocks")
    kval = val(quant.x)
    if kval.dim() < 1 or str(kval.shape[-1]) != "128" or kval.dtype not in (torch.bfloat16, torch.float16,
                                                                           torch.float32):
        raise NearMiss(f"the quantized tensor is {kval.dtype} {list(kval.shape)}, expected [T, 128]")
    return quant


def _expected(layout: KCacheLayout, probe: torch.Tensor, masked: bool, num_slots: int, scale: bool) -> torch.Tensor:
    slots = probe if masked else torch.where(probe < 0, probe + num_slots, probe)
    offsets = layout.scale_offsets(slots.clamp(min=0)) if scale else layout.value_offsets(slots.clamp(min=0))
    return offsets


def _check_offsets(writes: list[Write], layout: KCacheLayout, num_slots: int) -> tuple[Write, Write]:
    probe = _probe_slots(layout, num_slots)
    value_writes = [w for w in writes if w.offsets.shape[1] == 128]
    scale_writes = [w for w in writes if w.offsets.shape[1] == 4]
    if len(value_writes) != 1 or len(scale_writes) != 1 or len(writes) != 2:
        raise NearMiss(f"expected one 128-byte value write and one 4-byte scale write per token, found "
                      f"{[w.offsets.shape[1] for w in writes]} bytes")
    for write, is_scale in ((value_writes[0], False), (scale_writes[0], True)):
        rows = probe >= 0 if write.masked else torch.ones_like(probe, dtype=torch.bool)
        want = _expected(layout, probe, write.masked, num_slots, is_scale)
        if not torch.equal(write.offsets[rows], want[rows]):
            what = "scale" if is_scale else "value"
            raise NearMiss(f"the {what} bytes are written at offsets that are not the {layout} layout's")
    if value_writes[0].masked != scale_writes[0].masked:
        raise NearMiss("values and scale treat padding slots differently")
    return value_writes[0], scale_writes[0]


def describe_cache(cache: torch.fx.Node) -> str:
    """How reports name a cache input: its graph name, dtype and shape (e.g. ``arg7_1 uint8[64, 2112]``)."""
    cval = val(cache)
    shape = list(cval.shape) if isinstance(cval, torch.Tensor) else "?"
    return f"{cache.name} {str(getattr(cval, 'dtype', '?')).replace('torch.', '')}{shape}"


class QuantCacheStore(GraphPass):
    name = "quant_cache_store"

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext):
        """Every uint8 graph input written back by an epilogue ``copy_``: the pass either rewrites its store or says,
        as a near miss naming the cache, why Inductor's own store (and its copies of the cache) stays."""
        for anchor in list(graph.nodes):
            if is_op(anchor, aten.copy_.default) and anchor.args[0].op == "placeholder":
                cval = val(anchor.args[0])
                if isinstance(cval, torch.Tensor) and cval.dtype == torch.uint8:
                    yield anchor

    def rewrite(self, graph: torch.fx.Graph, anchor: torch.fx.Node, ctx: PassContext) -> torch.fx.Node:
        cache = anchor.args[0]
        try:
            if val(cache).dim() != 2:
                raise NearMiss(f"the cache is {val(cache).dim()}-D; the store is matched on a 2-D [pages, page bytes] "
                               f"cache")
            return self._rewrite(graph, cache, anchor.args[1], ctx.decision)
        except NearMiss as miss:
            raise NearMiss(f"cache {describe_cache(cache)}: {miss} (Inductor keeps its own store: see "
                           f"cache_copies)", miss.family) from None

    def finish(self, graph: torch.fx.Graph, stores: list[torch.fx.Node]) -> None:
        graph.eliminate_dead_code()
        for stored in stores:
            if stored is not None:  # (None: an empty batch's store, removed)
                _take_input_epilogue(stored)
        graph.eliminate_dead_code()

    def _rewrite(self, graph: torch.fx.Graph, cache: torch.fx.Node, final: torch.fx.Node, decision: LayoutDecision
                 ) -> torch.fx.Node:
        shape = fixed_shape(cache)
        try:
            layout = cache_layout(decision, shape)
        except ValueError as e:
            raise NearMiss(str(e)) from None
        num_slots = shape[0] * layout.page_size
        writes, slot = _parse_writes(final, cache, layout, num_slots)
        if _no_tokens(slot):
            return _drop_empty_store(cache, final)
        value_write, scale_write = _check_offsets(writes, layout, num_slots)
        quant = _match_cached_act_quant(_strip(value_write.payload))
        if _strip(scale_write.payload) is not _strip(quant.scale):
            raise NearMiss("the scale written is not the scale of the quantized values")
        kval = val(quant.x)
        k_rows = kval.shape[0] if kval.dim() == 2 else kval.numel() // 128
        if not _same_tokens(k_rows, _tokens(slot)):
            raise NearMiss(f"the slot mapping has {_tokens(slot)} tokens, the quantized tensor {k_rows} rows")
        _unify_tokens(k_rows, _tokens(slot))

        with graph.inserting_before(final):
            k = quant.x
            if kval.dim() != 2:  # a squeezed [128] or [B, next_n, 128]: the op takes [T, 128] rows in the same order
                k = insert_call(graph, aten.reshape.default, (k, [_tokens(slot), 128]))
            slots = slot
            if val(slot).dim() == 0:
                slots = insert_call(graph, aten.reshape.default, (slot, [1]))
            if not value_write.masked:
                wrapped = insert_call(graph, aten.add.Tensor, (slots, num_slots))
                negative = insert_call(graph, aten.lt.Scalar, (slots, 0))
                slots = insert_call(graph, aten.where.self, (negative, wrapped, slots))
            stored = insert_call(
                graph, torch.ops.higher_order.auto_functionalized, (torch.ops.nsa.quant_cache_store.default,),
                {"k": k, "cache": cache, "slot_mapping": slots, "page_size": layout.page_size,
                 "preshuffle": layout.preshuffle, "scale_fmt": quant.scale_fmt, "fp8_dtype": quant.fp8_dtype},
            )
            replacement = insert_call(graph, operator.getitem, (stored, 1))
            if not same_shape(replacement, final):
                replacement = insert_call(graph, aten.reshape.default, (replacement, list(val(final).shape)))
        # Handing the op's own output to the epilogue copy_ lets Inductor drop that copy once it reinplaces the op.
        final.replace_all_uses_with(replacement)
        return stored


def _drop_empty_store(cache: torch.fx.Node, final: torch.fx.Node) -> None:
    """An empty batch's store writes no byte (:func:`_parse_writes` checked every write's index): what it copies
    back into the cache is the cache as it was."""
    if val(final).dtype != val(cache).dtype or not same_shape(final, cache):
        raise NearMiss(f"the slot mapping holds no token, but the value copied back is {val(final).dtype} "
                       f"{list(val(final).shape)}, not the cache's bytes")
    final.replace_all_uses_with(cache)


def _take_input_epilogue(stored: torch.fx.Node) -> None:
    """``k = convert(y_fp32 * c, bf16/fp16)`` (or ``y / c``) read only by the store: the op computes it from ``y``."""
    k = stored.kwargs["k"]
    rows = None
    if is_op(k, aten.reshape.default) and len(k.users) == 1:  # the [T, 128] reshape of a one-token K
        rows, k = k, k.args[0]
    if not is_op(k, prims.convert_element_type.default) or k.args[1] not in (torch.bfloat16, torch.float16):
        return
    product = k.args[0]
    if len(k.users) != 1 or not is_op(product, aten.mul.Tensor, aten.div.Tensor) or len(product.users) != 1:
        return
    y, factor = product.args
    if not isinstance(factor, (int, float)) or val(y).dtype != torch.float32 or factor == 0:
        return
    if rows is not None:
        with stored.graph.inserting_before(stored):
            y = insert_call(stored.graph, aten.reshape.default, (y, rows.args[1]))
    stored.kwargs = {**stored.kwargs, "k": y, "input_scale": float(factor), "input_dtype": k.args[1],
                     "input_divide": is_op(product, aten.div.Tensor)}
