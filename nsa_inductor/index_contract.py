"""The index contract's checks (docs/indices.md), defined once for the two places they run: the ``index_checks``
pass inserts them into a compiled graph (``nsa.checks``), and the ops run them on every call when
``NSA_INDUCTOR_CHECKS`` is set (``capability().index_checks``), for engines that call ``torch.ops.nsa`` directly.
Plain aten, so the passes may import it (they never import the kernel layer).

Each check is built from aten calls through ``call(op, args, kwargs=None)``: eagerly that runs them, in the pass it
inserts graph nodes. Each ends in ``torch._assert_async`` (a device-side assert on a GPU, no host synchronisation;
a ``RuntimeError`` on the CPU) whose message names the argument. They change no result.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

aten = torch.ops.aten
Call = Callable[..., Any]


def eager_call(op, args: tuple, kwargs: dict | None = None) -> Any:
    return op(*args, **(kwargs or {}))


def python_index(ids: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` as Python indexes a dimension of ``size`` (docs/indices.md): ids in ``[-size, 0)`` wrap to
    ``id + size``; ``(wrapped ids, readable)``, unreadable ids (outside ``[-size, size)``) set to 0 (safe to load)."""
    wrapped, outside = _wrapped_ids(eager_call, ids.long(), size)
    return torch.where(outside, 0, wrapped), ~outside


def _assert_none(call: Call, bad, message: str) -> None:
    """Assert no element of ``bad`` is set (``not any``: Inductor lowers ``any``, not ``all``)."""
    none = call(aten.logical_not.default, (call(aten.any.default, (bad,)),))
    call(aten._assert_async.msg, (none, f"nsa.checks: {message}"))


def check_slots(call: Call, slots, num_pages: int, page_size: int) -> None:
    num_slots = num_pages * page_size
    _assert_none(call, call(aten.ge.Scalar, (slots, num_slots)),
                 f"slot_mapping holds a slot >= {num_slots}, past the K cache ({num_pages} pages of {page_size}); "
                 f"negative slots are padding")


def check_pages(call: Call, table, lens, num_pages: int, width, page_size: int, lens_name: str, device) -> None:
    """Every page a sequence's tokens sit on is readable (``[-num_pages, num_pages)``), and within the table
    (``width`` columns)."""
    below = call(aten.lt.Scalar, (table, -num_pages))
    above = call(aten.ge.Scalar, (table, num_pages))
    unreadable = call(aten.logical_or.default, (below, above))
    pages = call(aten.div.Tensor_mode, (call(aten.add.Tensor, (lens, page_size - 1)), page_size),
                 {"rounding_mode": "floor"})
    column = call(torch.ops.prims.iota.default, (width,),
                  dict(start=0, step=1, dtype=torch.int64, device=device, requires_grad=False))
    used = call(aten.lt.Tensor, (call(aten.unsqueeze.default, (column, 0)), call(aten.unsqueeze.default, (pages, 1))))
    _assert_none(call, call(aten.logical_and.default, (unreadable, used)),
                 f"block_table holds a page id outside [-{num_pages}, {num_pages}) (the K cache's pages) where a "
                 f"sequence's tokens are ({lens_name})")
    _assert_none(call, call(aten.gt.Scalar, (pages, width)),
                 f"{lens_name} gives a sequence more tokens than its block_table row holds (pages of {page_size} "
                 f"tokens)")


def check_cu_seqlens(call: Call, cu):
    """``cu_seqlens`` starts at 0 and never decreases; returns each sequence's length."""
    first = call(aten.slice.Tensor, (cu, 0, 0, 1))
    _assert_none(call, call(aten.ne.Scalar, (first, 0)), "cu_seqlens[0] is not 0")
    ends = call(aten.slice.Tensor, (cu, 0, 1))
    starts = call(aten.slice.Tensor, (cu, 0, 0, -1))
    _assert_none(call, call(aten.lt.Tensor, (ends, starts)), "cu_seqlens decreases")
    return call(aten.sub.Tensor, (ends, starts))


def _wrapped_ids(call: Call, ids, size):
    """``(ids wrapped as Python wraps an index of a dimension of size, outside [-size, size))``; ``size`` an int
    or a size node."""
    wrapped = call(aten.where.self, (call(aten.lt.Scalar, (ids, 0)), call(aten.add.Tensor, (ids, size)), ids))
    outside = call(aten.logical_or.default, (call(aten.lt.Scalar, (wrapped, 0)), call(aten.ge.Scalar, (wrapped, size))))
    return wrapped, outside


def check_gather_ids(call: Call, positions, num_pages: int, page_size: int, table=None, seq_ids=None, batch=None,
                     width=None) -> None:
    """Every id of ``nsa.gather_k_slots`` is one eager indexing reads: a slot in ``[-num_slots, num_slots)``; or,
    through ``table`` (``batch`` rows, ``width`` columns: ints or size nodes), a sequence id in ``[-batch, batch)``,
    a position whose page column is in ``[-width, width)`` and a page id there in ``[-num_pages, num_pages)``."""
    if table is None:
        num_slots = num_pages * page_size
        _, outside = _wrapped_ids(call, positions, num_slots)
        _assert_none(call, outside, f"positions holds a slot outside [-{num_slots}, {num_slots}) (the K cache's "
                                    f"{num_pages} pages of {page_size} slots)")
        return
    seq, bad_seq = _wrapped_ids(call, seq_ids, batch)
    _assert_none(call, bad_seq, "seq_ids holds a sequence id outside [-B, B) (B: block_table's rows)")
    column = call(aten.div.Tensor_mode, (positions, page_size), {"rounding_mode": "floor"})
    column, bad_column = _wrapped_ids(call, column, width)
    _assert_none(call, bad_column, f"positions holds a position outside [-max_pages * {page_size}, max_pages * "
                                   f"{page_size}) (max_pages: block_table's columns)")
    bad = call(aten.logical_or.default, (bad_seq, bad_column))
    pages = call(aten.index.Tensor, (table, [call(aten.where.ScalarSelf, (bad, 0, seq)),
                                             call(aten.where.ScalarSelf, (bad, 0, column))]))
    _, unreadable = _wrapped_ids(call, pages, num_pages)
    _assert_none(call, call(aten.logical_and.default, (unreadable, call(aten.logical_not.default, (bad,)))),
                 f"block_table holds a page id outside [-{num_pages}, {num_pages}) (the K cache's pages) where "
                 f"seq_ids and positions read")
