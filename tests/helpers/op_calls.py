"""One call of each nsa op per signature the host plans must stand for (decode and prefill sizes, every top-k path,
the optional inputs): each entry makes fresh arguments of its signature, CPU tensors, values left unset (the index
tensors valid)."""

import torch

import nsa_inductor  # noqa: F401 (registers the ops)

nsa = torch.ops.nsa
FP8 = torch.float8_e4m3fn


def cache(pages: int, page_size: int = 64) -> torch.Tensor:
    return torch.empty(pages, page_size * 132, dtype=torch.uint8)


def fp8(*shape) -> torch.Tensor:
    return torch.empty(*shape, dtype=FP8)


def lengths(rows: int, low: int, high: int) -> torch.Tensor:
    return torch.randint(low, high, (rows,), dtype=torch.int32)


# Each case makes fresh arguments of one signature: decode and prefill sizes, every top-k path, the optional inputs.
CASES = {
    "store": lambda: (nsa.quant_cache_store, (torch.empty(64, 128, dtype=torch.bfloat16), cache(300),
                                              torch.randperm(300 * 64)[:64], 64, False, "ue8m0")),
    "store, rotation and RoPE, preshuffled": lambda: (nsa.quant_cache_store, (
        torch.empty(7, 128, dtype=torch.bfloat16), cache(40), torch.arange(7) * 3, 64, True, "ue8m0", FP8,
        128**-0.5, torch.bfloat16, False, torch.empty(128, 128), torch.empty(4096, 32), torch.empty(4096, 32),
        torch.arange(7))),
    "paged logits": lambda: (nsa.paged_mqa_logits, (
        fp8(64, 1, 64, 128), cache(8192), torch.empty(64, 64), lengths(64, 1, 8192),
        torch.arange(8192, dtype=torch.int32).view(64, 128), 8192, 64, False)),
    "paged logits, split weights, factor, next_n 2": lambda: (nsa.paged_mqa_logits, (
        fp8(3, 2, 64, 128), cache(100), torch.empty(4, 6, 64), lengths(3, 2, 3000),
        torch.randint(0, 100, (3, 47), dtype=torch.int32), 3000, 64, False, torch.empty(6, 64), 0.125, False,
        False)),
    "top-k 64 x 8192 set": lambda: (nsa.topk_indices, (torch.empty(64, 8192), 2048, lengths(64, 1, 8192))),
    "top-k 64 x 8192 sorted": lambda: (nsa.topk_indices, (torch.empty(64, 8192), 2048, lengths(64, 1, 8192),
                                                          None, "neg1", True)),
    "top-k 8 x 8192 sorted, columns": lambda: (nsa.topk_indices, (torch.empty(8, 8192), 2048, None, None,
                                                                  "column", True)),
    "top-k 64 x 65536, engine lengths": lambda: (nsa.topk_indices, (torch.empty(64, 65536), 2048,
                                                                    lengths(64, 7680, 8704))),
    "top-k 1 x 32768 sorted": lambda: (nsa.topk_indices, (torch.empty(1, 32768), 2048, None, None, "neg1", True)),
    "top-k 512 x 8192, offsets (prefill)": lambda: (nsa.topk_indices, (
        torch.empty(512, 8192), 2048, lengths(512, 1, 8192), lengths(512, 0, 100), "neg1", True)),
    "head gate": lambda: (nsa.head_gate_gemm, (torch.empty(64, 7168, dtype=torch.bfloat16), torch.empty(64, 7168),
                                               4, False)),
    "wk and gate": lambda: (nsa.wk_gate_gemm, (torch.empty(8, 7168, dtype=torch.bfloat16), torch.empty(64, 7168),
                                               torch.empty(128, 7168, dtype=torch.bfloat16), 4, 2, False)),
    "gather": lambda: (nsa.gather_k, (cache(64), torch.arange(64, dtype=torch.int32).view(1, 64),
                                      torch.tensor([0, 256], dtype=torch.int32), 64, False, 256)),
    "gather by slots": lambda: (nsa.gather_k_slots, (cache(64), torch.arange(300) * 7, 64, True)),
    "ragged logits": lambda: (nsa.mqa_logits, (fp8(256, 64, 128), fp8(256, 128), torch.empty(256),
                                               torch.empty(256, 64), torch.zeros(256, dtype=torch.int32),
                                               torch.arange(1, 257, dtype=torch.int32))),
    "batched logits (Hugging Face), decode": lambda: (nsa.batched_mqa_logits, (
        torch.empty(64, 1, 64, 128, dtype=torch.bfloat16), torch.empty(64, 8192, 128, dtype=torch.bfloat16),
        torch.empty(64, 1, 64), 128**-0.5)),
    "batched logits (Hugging Face), masked decode": lambda: (nsa.batched_mqa_logits, (
        torch.empty(8, 1, 64, 128, dtype=torch.bfloat16), torch.empty(8, 8192, 128, dtype=torch.bfloat16),
        torch.empty(8, 1, 64), 128**-0.5, None, torch.arange(8192) < torch.arange(8192, 192, -1000).view(8, 1, 1),
        -1e30)),  # (contexts of 8192 to 1192 keys, a finite fill)
    "batched logits (Hugging Face), prefill": lambda: (nsa.batched_mqa_logits, (
        torch.empty(1, 300, 64, 128, dtype=torch.bfloat16), torch.empty(1, 300, 128, dtype=torch.bfloat16),
        torch.empty(1, 300, 64), 128**-0.5)),
    "rotation + act_quant": lambda: (nsa.rotate_act_quant, (torch.empty(64, 64, 128, dtype=torch.bfloat16),
                                                            torch.empty(128, 128), 128**-0.5, False, 128, "ue8m0",
                                                            FP8, 448.0)),
    "rotation + act_quant, split once (prefill)": lambda: (nsa.rotate_act_quant, (
        torch.empty(32768, 128, dtype=torch.bfloat16), torch.empty(128, 128), 128**-0.5, False, 128, "ue8m0", FP8,
        448.0)),
}
