"""``nsa.*`` compile options: parsed, validated, and kept apart from the options forwarded to Inductor."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from . import capability

PREFIX = "nsa."


@dataclass(frozen=True)
class NsaOptions:
    """Options of the nsa pass manager; each appears as ``nsa.<field>`` in ``torch.compile(options=...)``.

    - ``dump_dir``: write before/after graphs of every pass and ``report.json`` there (default: ``NSA_INDUCTOR_DUMP_DIR``).
    - ``layout`` / ``page_size``: K-cache layout override (``flat``, ``paged``, ``preshuffle``).
    - ``disable_passes``: names of passes not to run.
    - ``head_gate_mode``: the head-gate rewrite (fp32 ``weights_proj`` GEMM on bf16 inputs): ``"split"`` (W32 as
      bf16 hi + lo, the default), ``"round"`` (bf16(W), over DESIGN's 1e-3 logits contract) or ``"off"``.
    - ``topk_order``: ``"sorted"`` (top-k indices in torch's order: descending values where the spelling sorts, the
      default) or ``"set"`` (any order: the faster kernel, for engines that use the indices as a set).
    - ``strict``: a pass that raises fails the compile (default: it is skipped with a warning, graph unchanged).
    - ``checks``: device-side asserts on the index arguments of every ``nsa`` op (default: out-of-range ids are
      masked, docs/indices.md), naming the argument; no host synchronisation.
    - ``verify``: check the compiled graph against the unrewritten graph on its first call (``True``) or first
      ``n`` calls, raising :class:`~nsa_inductor.verify.VerifyError` on a mismatch (:mod:`nsa_inductor.verify`;
      the ``nsa_rocm`` backend only).
    - ``side_stream``: in a captured CUDA graph, run the decode step's K side (``nsa.wk_gate_gemm`` and the cache
      store) on a second stream beside the q side (the ``side_stream`` pass, default on; ``False``: one stream;
      docs/passes/side_stream.md).
    - ``eager_layer_norm``: keep ``native_layer_norm`` as the ATen kernel eager runs instead of Inductor's own
      reduction, so the K that reaches act_quant, and so the cache bytes, match eager bit for bit.
    """

    dump_dir: str | None = None
    layout: str | None = None
    page_size: int | None = None
    disable_passes: tuple[str, ...] = ()
    head_gate_mode: str = "split"
    topk_order: str = "sorted"
    eager_layer_norm: bool = True
    side_stream: bool = True
    strict: bool = False
    checks: bool = False
    verify: bool | int = False

    def layout_decision(self) -> capability.LayoutDecision:
        return capability.select_layout(self.layout, self.page_size)

    def resolved_dump_dir(self) -> str | None:
        return self.dump_dir or capability.dump_dir_from_env()


HEAD_GATE_MODES = ("split", "round", "off")
TOPK_ORDERS = ("sorted", "set")
# Keys that were renamed: the old key raises an error naming the new one.
_RENAMED = {"head_gate_bf16": 'nsa.head_gate_mode ("split" | "round" | "off"; False was "off")'}

_TYPES: dict[str, tuple[type, ...]] = {
    "dump_dir": (str, type(None)),
    "layout": (str, type(None)),
    "page_size": (int, type(None)),
    "disable_passes": (tuple, list, str),
    "head_gate_mode": (str,),
    "topk_order": (str,),
    "eager_layer_norm": (bool,),
    "side_stream": (bool,),
    "strict": (bool,),
    "checks": (bool,),
    "verify": (bool, int),
}


def parse_options(options: dict[str, Any] | None) -> tuple[NsaOptions, dict[str, Any]]:
    """Split ``options`` into ``NsaOptions`` and the rest (for Inductor). Unknown ``nsa.*`` keys raise ``ValueError``."""
    known = {f.name for f in fields(NsaOptions)}
    nsa: dict[str, Any] = {}
    inductor: dict[str, Any] = {}
    for key, value in (options or {}).items():
        if not key.startswith(PREFIX):
            inductor[key] = value
            continue
        name = key[len(PREFIX):]
        if name in _RENAMED:
            raise ValueError(f"option {key!r} was renamed: use {_RENAMED[name]}")
        if name not in known:
            raise ValueError(f"unknown option {key!r}; nsa options are: {', '.join(PREFIX + k for k in sorted(known))}")
        if not isinstance(value, _TYPES[name]) or (name == "page_size" and isinstance(value, bool)):
            expected = " or ".join(t.__name__ for t in _TYPES[name])
            raise ValueError(f"option {key!r} must be {expected}, got {type(value).__name__} {value!r}")
        allowed = {"head_gate_mode": HEAD_GATE_MODES, "topk_order": TOPK_ORDERS}.get(name)
        if allowed and value not in allowed:
            raise ValueError(f"option {key!r} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        if name == "verify" and value < 0:
            raise ValueError(f"option {key!r} must be True/False or a number of calls >= 0, got {value!r}")
        if name == "disable_passes":
            value = (value,) if isinstance(value, str) else tuple(value)
        nsa[name] = value
    parsed = NsaOptions(**nsa)
    parsed.layout_decision()
    return parsed, inductor
