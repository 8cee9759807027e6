"""The rewrite passes, one per file, and the order the pass manager runs them in."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import GraphPass, NearMiss, PassContext, PassResult

if TYPE_CHECKING:
    from ..options import NsaOptions

__all__ = ["GraphPass", "NearMiss", "PassContext", "PassResult", "passes_for"]


def passes_for(options: NsaOptions) -> list[GraphPass]:
    """Fresh pass objects for one compile, configured by ``options``, in the order they must run.

    ``unpad_gemm`` goes first, so that every matcher sees the GEMMs as the model wrote them, not as Inductor's
    ``pad_mm`` padded them; RoPE write-backs next, so the K and q producers are plain values for the quant-store and
    logits matchers;
    ``rotate_act_quant`` runs after ``quant_cache_store`` (it gives the store its rotation, and fuses the q side's),
    ``rope_prologue`` after both (it moves the RoPE into the ops they made), both before ``head_gate_gemm``, whose gate
    chain then reads the fused op's scale; the logits passes run before the buffer pass, which needs to see the ``nsa``
    logits ops writing the buffer, and before ``topk_indices``, which reads their masks to bound its scan;
    ``gather_k_slots`` reads K operands of the ``nsa.mqa_logits`` the ragged pass inserts; ``batched_mqa_logits``
    (Hugging Face's bf16 scores) after the fp8 ones, whose idiom it leaves to them; ``wk_gate_gemm`` anchors on
    the op ``head_gate_gemm`` inserts; ``store_input_rounding``, ``layer_norm_prologue`` and ``split_k_prologue`` run
    in that order once the store's k is final (each strips a layer of what k is made of, outermost first);
    ``searchsorted_offset`` (a torch 2.11 lowering fix) runs after them so the matchers see the graph as the user wrote
    it; ``index_checks`` (``nsa.checks`` only) after them, to see every ``nsa`` op; ``side_stream``
    (unless ``nsa.side_stream=False``) last, over the final ops and every reader of what they touch.
    """
    from .batched_mqa_logits import BatchedMqaLogits
    from .empty_logits_buffer import EmptyLogitsBuffer
    from .head_gate_gemm import HeadGateGemm
    from .layer_norm_prologue import LayerNormPrologue
    from .index_checks import IndexChecks
    from .mqa.paged import PagedMqaLogits
    from .mqa.ragged import RaggedMqaLogits
    from .mqa.slot_gather import GatherKSlots
    from .quant_cache_store import QuantCacheStore
    from .rope_copy_elision import RopeCopyElision
    from .rope_prologue import RopePrologue
    from .rotate_act_quant import RotateActQuant
    from .searchsorted_offset import SearchsortedOffset
    from .side_stream import SideStream
    from .split_k_prologue import SplitKPrologue
    from .store_input_rounding import StoreInputRounding
    from .topk_indices import TopkIndices
    from .unpad_gemm import UnpadGemm
    from .wk_gate_gemm import WkGateGemm

    head_gate = HeadGateGemm(mode=options.head_gate_mode if options.head_gate_mode != "off" else "split")
    wk_gate = WkGateGemm()
    passes: list[GraphPass] = [UnpadGemm(), RopeCopyElision(), QuantCacheStore(), RotateActQuant(), RopePrologue(),
                               head_gate, wk_gate, StoreInputRounding(), LayerNormPrologue(), SplitKPrologue(),
                               PagedMqaLogits(), RaggedMqaLogits(), GatherKSlots(), BatchedMqaLogits(),
                               EmptyLogitsBuffer(), TopkIndices(options.topk_order), SearchsortedOffset(), IndexChecks(),
                               SideStream()]
    names = [p.name for p in passes]
    unknown = [name for name in options.disable_passes if name not in names]
    if unknown:
        raise ValueError(f"nsa.disable_passes names unknown pass(es) {unknown}; the passes are: {', '.join(names)}")
    off = set(options.disable_passes)
    if options.head_gate_mode == "off":
        off |= {head_gate.name, wk_gate.name}
    if not options.checks:
        off.add(IndexChecks.name)
    if not options.side_stream:
        off.add(SideStream.name)
    return [p for p in passes if p.name not in off]
