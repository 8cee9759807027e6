"""Graph dumps: a readable file per pass (before/after), ``report.json``, and the same graphs as tlparse artifacts."""

from __future__ import annotations

import itertools
import json
import logging
import os
import warnings
from typing import Any

import torch.fx
from torch._logging import trace_structured

log = logging.getLogger("nsa_inductor")

_graph_ids = itertools.count()


def graph_source(graph: torch.fx.Graph) -> str:
    return graph.python_code(root_module="self").src


class GraphDumper:
    """Writes ``<dump_dir>/<graph name>/NN_<pass>.{before,after}.py`` and emits the same text to tlparse.

    Graph names hold the process id, so processes sharing a dump directory never overwrite each other's graphs. A
    dump that cannot be written warns once per graph and the compile goes on without it."""

    def __init__(self, dump_dir: str | None):
        self.name = f"graph_{os.getpid()}_{next(_graph_ids):03d}"
        self.directory = os.path.join(dump_dir, self.name) if dump_dir else None
        self._write(lambda: os.makedirs(self.directory, exist_ok=True))

    def _write(self, write) -> None:
        if not self.directory:
            return
        try:
            write()
        except OSError as e:
            warnings.warn(f"nsa_inductor: cannot write the graph dump to {self.directory} ({e}); compiling without "
                          "it", stacklevel=2)
            self.directory = None

    def _write_file(self, filename: str, text: str) -> None:
        def write():
            with open(os.path.join(self.directory, filename), "w") as f:
                f.write(text)

        self._write(write)

    def graph(self, stem: str, graph: torch.fx.Graph) -> None:
        """Renders the graph only for a consumer: tlparse tracing (the payload is built on demand) or a dump dir."""
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"nsa_{self.name}_{stem}", "encoding": "string"},
            payload_fn=lambda: graph_source(graph),
        )
        if self.directory:
            self._write_file(f"{stem}.py", graph_source(graph))

    def report(self, report: dict[str, Any]) -> None:
        text = json.dumps(report, indent=2, default=str)
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"nsa_{self.name}_report", "encoding": "json"},
            payload_fn=lambda: text,
        )
        self._write_file("report.json", text)
        if self.directory:
            log.info("nsa_inductor: wrote graphs and report.json to %s", self.directory)
