"""The rewrite passes, one per file, and the order the pass manager runs them in."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..options import NsaOptions
    from ..pass_manager import GraphPass


def passes_for(options: NsaOptions) -> list[GraphPass]:
    """Passes in the order they must run.

    RoPE write-backs go first so the K and q producers are plain values for the quant-store and logits matchers;
    the logits passes run before the buffer pass, which needs to see the ``nsa`` logits ops writing the buffer, and
    before ``topk_indices``, which reads their masks to bound its scan;
    ``searchsorted_offset`` (a torch 2.11 lowering fix) runs last so the matchers see the graph as the user wrote it.
    """
    from . import (
        empty_logits_buffer,
        head_gate_gemm,
        paged_mqa_logits,
        quant_cache_store,
        ragged_mqa_logits,
        rope_copy_elision,
        searchsorted_offset,
        topk_indices,
    )

    passes = [rope_copy_elision.PASS, quant_cache_store.PASS]
    if options.head_gate_bf16:
        passes.append(head_gate_gemm.PASS)
    passes += [paged_mqa_logits.PASS, ragged_mqa_logits.PASS, empty_logits_buffer.PASS, topk_indices.PASS,
               searchsorted_offset.PASS]
    return passes
