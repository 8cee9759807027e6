"""Graph dumps: a readable file per pass (before/after), ``report.json``, and the same graphs as tlparse artifacts."""

from __future__ import annotations

import itertools
import json
import logging
import os
from typing import Any

import torch.fx
from torch._logging import trace_structured

log = logging.getLogger("nsa_inductor")

_graph_ids = itertools.count()


def graph_source(graph: torch.fx.Graph) -> str:
    return graph.python_code(root_module="self").src


class GraphDumper:
    """Writes ``<dump_dir>/<graph name>/NN_<pass>.{before,after}.py`` and emits the same text to tlparse."""

    def __init__(self, dump_dir: str | None):
        self.name = f"graph_{next(_graph_ids):03d}"
        self.directory = os.path.join(dump_dir, self.name) if dump_dir else None
        if self.directory:
            os.makedirs(self.directory, exist_ok=True)

    def graph(self, stem: str, graph: torch.fx.Graph) -> None:
        """Renders the graph only for a consumer: tlparse tracing (the payload is built on demand) or a dump dir."""
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"nsa_{self.name}_{stem}", "encoding": "string"},
            payload_fn=lambda: graph_source(graph),
        )
        if self.directory:
            with open(os.path.join(self.directory, f"{stem}.py"), "w") as f:
                f.write(graph_source(graph))

    def report(self, report: dict[str, Any]) -> None:
        text = json.dumps(report, indent=2, default=str)
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"nsa_{self.name}_report", "encoding": "json"},
            payload_fn=lambda: text,
        )
        if self.directory:
            with open(os.path.join(self.directory, "report.json"), "w") as f:
                f.write(text)
            log.info("nsa_inductor: wrote graphs and report.json to %s", self.directory)
