"""nsa_inductor: a torch.compile backend (``nsa_rocm``) for the DeepSeek Sparse Attention lightning indexer.

Importing the package registers every ``torch.ops.nsa.*`` op (the passes insert them by name); the names below
load their module on first use, and nothing imports triton or aiter until a GPU kernel runs.
"""

from __future__ import annotations

import importlib

from . import lowering  # noqa: F401  registers torch.ops.nsa.*

__version__ = "0.1.0"

_EXPORTS = {
    "nsa_rocm": "backend",
    "install": "backend",
    "KCacheLayout": "layout",
    "act_quant": "quant",
    "select_layout": "capability",
    "describe": "capability",
    "Indexer": "indexer",
    "IndexerConfig": "indexer",
    "NsaOptions": "options",
    "last_reports": "pass_manager",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
