"""Kernel layer: the ``nsa`` ops (``torch.ops.nsa.*``), one package per op with its registration (``nsa_op``), fake
and argument checks (``__init__``), torch reference, Triton kernel and, where aiter has a kernel, aiter dispatch.
Importing this package registers the ops; Triton and aiter are imported only when a GPU path runs."""

from . import (batched_mqa_logits, gather_k, gather_k_slots, head_gate_gemm, mqa_logits, paged_mqa_logits,
               quant_cache_store, rotate_act_quant, topk_indices, wk_gate_gemm)

__all__ = ["batched_mqa_logits", "gather_k", "gather_k_slots", "head_gate_gemm", "mqa_logits", "paged_mqa_logits",
           "quant_cache_store", "rotate_act_quant", "topk_indices", "wk_gate_gemm"]
