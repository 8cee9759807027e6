"""Pass reports kept beside Inductor's caches, so a graph served from the FX graph cache (or the AOTAutograd cache,
which sits in front of it) still reports what its passes did.

A cache hit runs no post-grad pass, so the pass manager never sees the graph. The ``nsa_rocm`` backend does: it
keys each graph by its code, its inputs' metadata and the pass manager's ``uuid()`` (the same things the cache keys
hold), saves the reports the passes made under ``<inductor cache dir>/nsa_reports/<key>.json`` after a compile, and
when a compile hits Inductor's caches (their hit counters moved and no pass ran) it re-issues the saved reports: in
``last_reports()`` and the dump directory, marked ``"served_from_cache": true``. Two keys, as the two caches have:
the Dynamo graph's (the AOTAutograd cache's level) and each ATen graph Inductor's inner compile gets (the FX graph
cache's level: Dynamo graphs of other code, ``torch.sin(x)`` or ``x.sin()``, can trace to one ATen graph and share
its entry; the reports such a hit re-issues are saved under the new Dynamo graph's key too, which AOTAutograd's cache
serves from then on). A hit on an entry this process cannot find a saved report for (the cache was filled by
``install()`` or another program) gets a report saying so, with ``"passes": null``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Any, Callable, Iterator

import torch

from .debug import GraphDumper
from .pass_manager import REPORTS, NsaPassManager

_FX_HIT = ("inductor", "fxgraph_cache_hit")
_HIT_COUNTERS = (_FX_HIT, ("aot_autograd", "autograd_cache_hit"))


def _hits(counters: tuple = _HIT_COUNTERS) -> int:
    from torch._dynamo.utils import counters as torch_counters

    return sum(torch_counters[group][name] for group, name in counters)


def _key(gm: torch.fx.GraphModule, example_inputs, manager: NsaPassManager) -> str | None:
    uuid = manager.uuid()
    if uuid is None:  # Inductor bypasses its cache for this pass too
        return None
    h = hashlib.sha256(uuid.encode())
    h.update(gm.code.encode())
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            h.update(repr((x.dtype, x.device.type, tuple(x.shape), tuple(x.stride()))).encode())
        else:
            h.update(repr(x).encode())
    return h.hexdigest()


def _path(key: str) -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "nsa_reports", f"{key}.json")


@contextlib.contextmanager
def reports_kept_with_cache(gm: torch.fx.GraphModule, example_inputs,
                            manager: NsaPassManager) -> Iterator[tuple[list[dict[str, Any]], Callable]]:
    """Around one ``compile_fx`` call of the backend: save the reports it makes, or re-issue them on a cache hit.
    Yields a list that holds, after the block, the reports of this compile (made or re-issued), and the inner compile
    to give ``compile_fx``, which does the same for each ATen graph."""
    from torch._inductor.compile_fx import compile_fx_inner

    def inner_compile(aten_gm: torch.fx.GraphModule, aten_inputs, **kwargs):
        aten_key = _key(aten_gm, aten_inputs, manager)
        before, hits = list(REPORTS), _hits((_FX_HIT,))
        compiled = compile_fx_inner(aten_gm, aten_inputs, **kwargs)
        made = _new_reports(before)
        if aten_key is None:
            return compiled
        if made:
            _save(aten_key, made)
        elif _hits((_FX_HIT,)) > hits:
            _reissue(aten_key, manager, saved_only=True)  # (none saved: the Dynamo graph's key is tried next)
        return compiled

    key = _key(gm, example_inputs, manager)
    before, hits = list(REPORTS), _hits()  # the list keeps these alive: their ids cannot be reused meanwhile
    this_compile: list[dict[str, Any]] = []
    yield this_compile, inner_compile
    this_compile += _new_reports(before)
    if key is None:
        return
    if this_compile:  # made, or re-issued by an ATen graph's FX graph cache hit: AOTAutograd's cache now keeps this
        _save(key, [_as_saved(r) for r in this_compile])  # Dynamo graph, and a hit on it must find them here
    elif _hits() > hits:
        this_compile += _reissue(key, manager)


def _as_saved(report: dict[str, Any]) -> dict[str, Any]:
    """A report as it was saved: a re-issued one without what ``_reissue`` added."""
    if not report.get("served_from_cache"):
        return report
    saved = {k: v for k, v in report.items() if k not in ("served_from_cache", "compiled_as")}
    return {**saved, "graph": report["compiled_as"]}


def _new_reports(before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in REPORTS if not any(r is b for b in before)]


def _save(key: str, reports: list[dict[str, Any]]) -> None:
    path = _path(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.{os.getpid()}", "w") as f:
            json.dump(reports, f, default=str)
        os.replace(f"{path}.{os.getpid()}", path)  # atomic: processes sharing the cache never read half a file
    except OSError:
        pass  # the cache dir is Inductor's: if it cannot be written, Inductor's own entry is not there either


def _reissue(key: str, manager: NsaPassManager, saved_only: bool = False) -> list[dict[str, Any]]:
    """The reports saved under ``key``, re-issued; none saved: a report saying so, or nothing (``saved_only``)."""
    try:
        with open(_path(key)) as f:
            saved: list[dict[str, Any]] = json.load(f)
    except (OSError, ValueError):
        if saved_only:
            return []
        saved = [{"passes": None, "note": "served from Inductor's cache, filled without the nsa_rocm backend "
                                          "(install() or another program): no report was kept"}]
    reissued = []
    for report in saved:
        dumper = GraphDumper(manager.options.resolved_dump_dir())
        report = {**report, "graph": dumper.name, "compiled_as": report.get("graph"), "served_from_cache": True}
        dumper.report(report)
        REPORTS.append(report)
        reissued.append(report)
    return reissued
