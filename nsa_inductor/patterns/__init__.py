"""The rewrite passes, one per file, and the order the pass manager runs them in."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..capability import Capability
    from ..options import NsaOptions
    from ..pass_manager import GraphPass


def passes_for(cap: Capability, options: NsaOptions) -> list[GraphPass]:
    """Passes in the order they must run for this machine."""
    return []
