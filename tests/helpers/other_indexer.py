"""A second lightning indexer, written independently of ``nsa_inductor.indexer`` in another plain-torch style.

The passes must fire on it too. Differences from the reference: the K cache is written and read through views of
the page bytes (values ``[pages, P, 128]``, scales ``[pages, P]`` as fp32) instead of flat byte offsets; padding
tokens point at a reserved dummy slot (SGLang's convention) instead of -1; RoPE is split/cat with a ``narrow``
write-back; act_quant uses ``pow(2, ·)`` and a reciprocal; the Hadamard product is ``F.linear``; head gates use
``.to(torch.float32) @ W.t()``; logits use ``matmul`` and ``torch.where``. Row-major pages only (flat is P=1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nsa_inductor.indexer import IndexerConfig, hadamard_matrix, rope_cos_sin


def quantize_fp8(x: torch.Tensor, fp8_dtype: torch.dtype, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    fmax = torch.finfo(fp8_dtype).max
    x = x.to(torch.float32)
    amax = torch.amax(torch.abs(x), dim=-1, keepdim=True).clamp(min=1e-4)
    scale = amax / fmax
    if ue8m0:
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
    return torch.clamp(x / scale, min=-fmax, max=fmax).to(fp8_dtype), scale


class OtherIndexer(nn.Module):
    def __init__(self, config: IndexerConfig, page_size: int):
        super().__init__()
        self.cfg, self.page_size = config, page_size
        c = config
        self.wq_b = nn.Linear(c.q_lora_rank, c.n_heads * c.head_dim, bias=False, dtype=torch.bfloat16)
        self.wk = nn.Linear(c.hidden_size, c.head_dim, bias=False, dtype=torch.bfloat16)
        self.k_norm = nn.LayerNorm(c.head_dim, eps=c.norm_eps)
        self.weights_proj = nn.Linear(c.hidden_size, c.n_heads, bias=False)
        self.register_buffer("hadamard_t", hadamard_matrix(c.head_dim).t().contiguous(), persistent=False)
        self.register_buffer("rope", rope_cos_sin(c.rope_dim, c.max_model_len, c.rope_theta), persistent=False)
        self.requires_grad_(False)

    def load_from(self, reference: nn.Module) -> OtherIndexer:
        """Same weights as a reference ``Indexer``, so both can be compared."""
        for name in ("wq_b", "wk", "k_norm", "weights_proj"):
            getattr(self, name).load_state_dict(getattr(reference, name).state_dict())
        return self

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope[positions, 0], self.rope[positions, 1]
        while cos.dim() < x.dim():
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        xf = x.to(torch.float32)
        if self.cfg.rope_interleaved:
            pairs = xf.unflatten(-1, (-1, 2))
            real, imag = pairs[..., 0], pairs[..., 1]
            out = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(-2)
        else:
            real, imag = torch.split(xf, xf.shape[-1] // 2, dim=-1)
            out = torch.cat((real * cos - imag * sin, imag * cos + real * sin), dim=-1)
        return out.to(x.dtype)

    def _hadamard(self, x: torch.Tensor) -> torch.Tensor:
        return (F.linear(x.to(torch.float32), self.hadamard_t) / math.sqrt(self.cfg.head_dim)).to(x.dtype)

    def _cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.page_size
        pages = kv_cache.view(-1, p * 132)
        return pages[:, : p * 128].unflatten(1, (p, 128)), pages[:, p * 128 :].view(torch.float32)

    def _queries(self, x, q_lora, positions):
        c = self.cfg
        q = self.wq_b(q_lora).unflatten(-1, (c.n_heads, c.head_dim))
        q_rope, q_rest = torch.split(q, [c.rope_dim, c.head_dim - c.rope_dim], dim=-1)
        q = self._hadamard(torch.cat([self._rotate(q_rope, positions), q_rest], dim=-1))
        q_fp8, q_scale = quantize_fp8(q, c.fp8_dtype, c.scale_fmt == "ue8m0")
        gates = x.to(torch.float32) @ self.weights_proj.weight.t()
        gates = gates * q_scale.squeeze(-1) * (c.n_heads**-0.5 * c.head_dim**-0.5)
        return q_fp8, gates

    def _write_k(self, x, positions, slot_mapping, kv_cache):
        c = self.cfg
        k = self.k_norm(self.wk(x).to(torch.float32)).to(x.dtype)
        rotated = self._rotate(k[:, : c.rope_dim], positions)
        k_rope = k.narrow(-1, 0, c.rope_dim)
        k_rope.copy_(rotated)
        k.narrow(-1, 0, c.rope_dim).copy_(k_rope)
        k_fp8, k_scale = quantize_fp8(self._hadamard(k), c.fp8_dtype, c.scale_fmt == "ue8m0")
        values, scales = self._cache_views(kv_cache)
        page, pos = slot_mapping // self.page_size, slot_mapping % self.page_size
        values[page, pos] = k_fp8.view(torch.uint8)
        scales[page, pos] = k_scale.squeeze(-1)

    def decode(self, x, q_lora, positions, slot_mapping, kv_cache, block_table, context_lens):
        c = self.cfg
        self._write_k(x, positions, slot_mapping, kv_cache)
        q_fp8, gates = self._queries(x, q_lora, positions)
        batch, max_pages = block_table.shape
        next_n, max_len = x.shape[0] // max(batch, 1), max_pages * self.page_size
        values, scales = self._cache_views(kv_cache)
        keys = values[block_table.long()].view(c.fp8_dtype).to(torch.float32).reshape(batch, max_len, c.head_dim)
        key_scale = scales[block_table.long()].reshape(batch, 1, max_len)
        q = q_fp8.to(torch.float32).reshape(batch, next_n * c.n_heads, c.head_dim)
        dots = torch.matmul(q, keys.transpose(1, 2)).view(batch, next_n, c.n_heads, max_len)
        scores = (torch.relu(dots) * key_scale.unsqueeze(1) * gates.view(batch, next_n, c.n_heads, 1)).sum(2)
        limit = context_lens.unsqueeze(1) - next_n + torch.arange(next_n, device=x.device).unsqueeze(0)
        columns = torch.arange(max_len, device=x.device).view(1, 1, max_len)
        scores = torch.where(columns <= limit.unsqueeze(-1), scores, float("-inf")).flatten(0, 1)
        logits = torch.full((batch * next_n, c.max_model_len), float("-inf"), device=x.device)
        logits.narrow(1, 0, max_len).copy_(scores)
        return logits, logits.topk(min(c.topk, c.max_model_len), dim=-1).indices

    def prefill(self, x, q_lora, positions, slot_mapping, kv_cache, block_table, cu_seqlens):
        c = self.cfg
        self._write_k(x, positions, slot_mapping, kv_cache)
        q_fp8, gates = self._queries(x, q_lora, positions)
        n = x.shape[0]
        values, scales = self._cache_views(kv_cache)
        idx = torch.arange(n, device=x.device)
        seq = torch.bucketize(idx, cu_seqlens[1:].long(), right=True)
        start = cu_seqlens.long()[seq]
        offset = idx - start
        page = block_table.long()[seq, offset // self.page_size]
        keys = values[page, offset % self.page_size].view(c.fp8_dtype).to(torch.float32)
        key_scale = scales[page, offset % self.page_size]
        dots = torch.matmul(q_fp8.to(torch.float32).transpose(0, 1), keys.t()).transpose(0, 1)
        scores = (dots.relu() * key_scale * gates.unsqueeze(-1)).sum(dim=1)
        causal = (idx.unsqueeze(0) >= start.unsqueeze(1)) & (idx.unsqueeze(0) <= idx.unsqueeze(1))
        logits = scores.masked_fill(~causal, float("-inf"))
        return logits, logits.topk(min(c.topk, n), dim=-1).indices
