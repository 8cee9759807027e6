"""The post-grad pass manager: runs the nsa passes in order, reports their matches, dumps graphs, owns cache identity."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import pathlib
import time
import warnings
from collections import deque
from typing import Any, Callable

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import capability
from .cache_copies import cache_copy_report
from .debug import GraphDumper
from .options import NsaOptions
from .patterns import GraphPass, PassContext, passes_for

log = logging.getLogger("nsa_inductor")

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
REPORTS: deque[dict[str, Any]] = deque(maxlen=64)


@functools.cache
def _source_hash() -> bytes:
    """Every source file of the package: pass code, kernel code and the layout logic all change the output."""
    return get_hash_for_files(tuple(sorted(str(p) for p in PACKAGE_DIR.rglob("*.py"))))


class NsaPassManager(CustomGraphPass):
    """Inductor ``post_grad_custom_post_pass`` running the nsa passes, then any pass that was installed before it."""

    def __init__(self, options: NsaOptions, inner: Callable[[torch.fx.Graph], None] | None = None):
        self.options = options
        self.decision = options.layout_decision()
        self.capability = capability.capability()
        self.inner = inner.inner if isinstance(inner, NsaPassManager) else inner
        self.passes: list[GraphPass] = passes_for(options)

    def __call__(self, graph: torch.fx.Graph) -> None:
        ctx = PassContext(self.options, self.decision, self.capability)
        dumper = GraphDumper(self.options.resolved_dump_dir())
        report: dict[str, Any] = {
            "graph": dumper.name,
            "layout": str(self.decision.layout),
            "layout_reason": self.decision.reason,
            "capability": capability.describe(self.decision),
            "passes": [],
        }
        dumper.graph("00_input", graph)
        for index, graph_pass in enumerate(self.passes, start=1):
            stem = f"{index:02d}_{graph_pass.name}"
            dumper.graph(f"{stem}.before", graph)
            start = time.perf_counter()
            entry = self._run_contained(graph_pass, graph, ctx)
            entry["time_ms"] = round((time.perf_counter() - start) * 1e3, 3)
            dumper.graph(f"{stem}.after", graph)
            report["passes"].append(entry)
            log.info("nsa_inductor: %s %s: %d match(es), %d near miss(es)", dumper.name, graph_pass.name,
                     entry["matched"], len(entry["near_misses"]))
            for miss in entry["near_misses"]:
                log.info("nsa_inductor:   near miss at %s: %s", miss["anchor"], miss["reason"])
            for given in entry.get("taken_as_given", []):
                log.info("nsa_inductor:   taken as given at %s: %s", given["anchor"], "; ".join(given["facts"]))
        if self.inner is not None:
            self.inner(graph)
        report.update(cache_copy_report(graph))  # copies of a mutated uint8 input left in the final graph
        dumper.graph("99_output", graph)
        dumper.report(report)
        REPORTS.append(report)

    def _run_contained(self, graph_pass: GraphPass, graph: torch.fx.Graph, ctx: PassContext) -> dict[str, Any]:
        """Run one pass; if it raises, put the graph back as it was, warn and record the error (``nsa.strict``:
        raise instead)."""
        saved = _snapshot(graph)
        try:
            result = graph_pass(graph, ctx)
            graph.lint()
        except Exception as e:  # noqa: BLE001 - any failure of a pass is contained unless strict
            error = f"{type(e).__name__}: {e}"
            if self.options.strict:
                raise RuntimeError(f"nsa_inductor pass {graph_pass.name!r} failed (nsa.strict): {error}") from e
            _restore(graph, *saved)
            warnings.warn(f"nsa_inductor: pass {graph_pass.name!r} failed and was skipped, graph left as it was: "
                          f"{error}", stacklevel=2)
            return {"name": graph_pass.name, "matched": 0, "near_misses": [], "error": error}
        entry = {"name": graph_pass.name, "matched": result.matched, "near_misses": result.near_misses}
        if result.taken_as_given:
            entry["taken_as_given"] = result.taken_as_given
        return entry

    def uuid(self) -> str | None:
        inner_uuid = None
        if self.inner is not None:
            inner_uuid = getattr(self.inner, "uuid", lambda: None)()
            if inner_uuid is None:
                return None
        h = hashlib.sha256(_source_hash())
        # The dump directory changes no output: a compile that only dumps elsewhere is still served from the cache
        # (with the entry's report, see cached_reports).
        options = dataclasses.replace(self.options, dump_dir=None)
        for part in (self.decision.layout, options, self.capability, torch.__version__, inner_uuid,
                     [(p.name, sorted(vars(p).items())) for p in self.passes]):
            h.update(repr(part).encode())
        return h.hexdigest()


def _snapshot(graph: torch.fx.Graph) -> tuple[torch.fx.Graph, dict[torch.fx.Node, torch.fx.Node]]:
    """A copy of ``graph`` and, for each of the copy's placeholders, the original one."""
    copy, env = torch.fx.Graph(), {}
    copy.output(copy.graph_copy(graph, env))
    return copy, {new: old for old, new in env.items() if old.op == "placeholder"}


def _restore(graph: torch.fx.Graph, copy: torch.fx.Graph, placeholders: dict[torch.fx.Node, torch.fx.Node]) -> None:
    """Make ``graph`` the snapshot ``copy`` again, in place (Inductor holds the graph object); placeholders stay."""
    for node in reversed(list(graph.nodes)):
        if node.op != "placeholder":
            graph.erase_node(node)
    for node in [n for n in graph.nodes if n not in placeholders.values()]:
        graph.erase_node(node)  # a placeholder the pass added
    env = dict(placeholders)
    for node in copy.nodes:
        if node.op == "output":
            graph.output(torch.fx.map_arg(node.args[0], env.__getitem__))
        elif node.op != "placeholder":
            env[node] = graph.node_copy(node, env.__getitem__)


def last_reports() -> list[dict[str, Any]]:
    """The match reports of the graphs compiled in this process, oldest first (at most 64)."""
    return list(REPORTS)
