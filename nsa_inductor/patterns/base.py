"""What every pass shares: the context it runs in, the result it reports, the one near-miss exception, and the
candidates -> prove -> rewrite loop. The pass manager imports passes; nothing here imports the manager."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.fx

if TYPE_CHECKING:
    from ..capability import Capability, LayoutDecision
    from ..options import NsaOptions


class NearMiss(Exception):
    """A candidate was found but a check failed; the message is the reason the report shows.

    ``family``: where several passes share one matcher (decode and prefill MQA logits), the pass the near miss
    belongs to; ``None`` when it belongs to every pass that shares the matcher.
    """

    def __init__(self, reason: str, family: str | None = None):
        super().__init__(reason)
        self.family = family


@dataclass
class PassResult:
    """What one pass did to one graph: rewrites made, and near misses (anchor found, check that failed)."""

    matched: int = 0
    near_misses: list[dict[str, Any]] = field(default_factory=list)
    taken_as_given: list[dict[str, Any]] = field(default_factory=list)  # per rewrite: facts it did not prove

    def miss(self, anchor: torch.fx.Node, reason: str) -> None:
        self.near_misses.append({"anchor": anchor.format_node(), "reason": reason})

    def assume(self, anchor: torch.fx.Node, facts: list[str]) -> None:
        self.taken_as_given.append({"anchor": anchor.format_node(), "facts": facts})


@dataclass(frozen=True)
class PassContext:
    options: NsaOptions
    decision: LayoutDecision
    capability: Capability


class GraphPass:
    """A pass in one shape: ``candidates`` (cheap structural filter) -> ``rewrite`` (proves, then rewrites; raises
    :class:`NearMiss` with the failed check). Attributes set in ``__init__`` are configuration and enter the pass
    manager's cache key; a pass never stores per-graph state on itself."""

    name: str = ""
    # The rewrite's kernels add in another order than eager, so K-cache bytes may differ from eager's within the
    # pass's documented bound (docs/numerics.md); nsa.verify then allows them.
    may_change_cache_bytes: bool = False

    def candidates(self, graph: torch.fx.Graph, ctx: PassContext | None) -> Iterable[Any]:
        raise NotImplementedError

    def rewrite(self, graph: torch.fx.Graph, candidate: Any, ctx: PassContext | None) -> Any:
        """Prove ``candidate`` is the idiom and rewrite it (the return value goes to :meth:`finish`)."""
        raise NotImplementedError

    def anchor(self, candidate: Any) -> torch.fx.Node:
        """The node a near miss is reported at."""
        return candidate

    def reported(self, candidate: Any, miss: NearMiss) -> bool:
        """Whether ``miss`` belongs in this pass's report (a look-alike that is plainly another idiom does not)."""
        return True

    def taken_as_given(self, rewritten: Any) -> list[str]:
        """The facts one rewrite (``rewritten``: what ``rewrite`` returned) took as given rather than proved, e.g.
        the values of maps given as inputs; the report lists them."""
        return []

    def finish(self, graph: torch.fx.Graph, rewritten: list[Any]) -> None:
        """Runs once after every candidate, with what each successful ``rewrite`` returned."""

    def __call__(self, graph: torch.fx.Graph, ctx: PassContext | None = None) -> PassResult:
        result = PassResult()
        rewritten = []
        for candidate in self.candidates(graph, ctx):
            anchor = self.anchor(candidate)
            if getattr(anchor, "_erased", False) or anchor.graph is not graph:
                continue  # removed by an earlier rewrite in this pass
            try:
                rewritten.append(self.rewrite(graph, candidate, ctx))
            except NearMiss as miss:
                if self.reported(candidate, miss):
                    result.miss(anchor, str(miss))
                continue
            result.matched += 1
            facts = self.taken_as_given(rewritten[-1])
            if facts:
                result.assume(anchor, facts)
        if rewritten:
            self.finish(graph, rewritten)
        return result
