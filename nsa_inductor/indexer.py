"""The DeepSeek Sparse Attention lightning indexer as plain eager PyTorch (DESIGN §2).

This is the program a model author writes and the ``nsa_rocm`` passes rewrite: every slow idiom the passes target
(act_quant followed by the K-cache store, fp32 head-gate GEMM with casts, RoPE written back into the head slice,
a ``full(-inf)`` logits buffer, plain-torch paged/ragged MQA logits, ``topk``) is spelled here the way eager
serving code spells it. It is also the numerical reference the compiled program must reproduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .layout import KCacheLayout
from .quant import act_quant, check_scale_fmt, fp8_max


@dataclass(frozen=True)
class IndexerConfig:
    hidden_size: int = 7168
    q_lora_rank: int = 1536
    n_heads: int = 64
    head_dim: int = 128
    rope_dim: int = 64
    topk: int = 2048
    quant_block: int = 128
    rope_interleaved: bool = False
    rope_theta: float = 10000.0
    max_model_len: int = 65536
    norm_eps: float = 1e-6
    scale_fmt: str = "ue8m0"
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    q_fp8_max: float | None = None

    def __post_init__(self) -> None:
        check_scale_fmt(self.scale_fmt)
        fp8_max(self.fp8_dtype)
        if self.head_dim != self.quant_block:
            raise ValueError(
                f"head_dim ({self.head_dim}) must equal quant_block ({self.quant_block}): the K cache holds one "
                "scale per token"
            )
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even and in (0, head_dim], got {self.rope_dim}")

    @classmethod
    def deepseek_v32(cls, **overrides) -> IndexerConfig:
        return replace(cls(), **overrides)

    @classmethod
    def glm5(cls, **overrides) -> IndexerConfig:
        return replace(cls(hidden_size=6144, q_lora_rank=2048, n_heads=32, rope_interleaved=True), **overrides)

    def small(self) -> IndexerConfig:
        """The same architecture at sizes a CPU compiles and runs in seconds (head_dim stays 128)."""
        return replace(self, hidden_size=256, q_lora_rank=64, n_heads=self.n_heads // 4, topk=32, max_model_len=1024)


def hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester's ±1 Hadamard matrix in natural order."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rope_cos_sin(rope_dim: int, max_model_len: int, theta: float) -> torch.Tensor:
    """``[max_model_len, 2, rope_dim // 2]`` fp32: cos then sin for every position."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = torch.arange(max_model_len, dtype=torch.float64)[:, None] * inv_freq
    return torch.stack([angles.cos(), angles.sin()], dim=1).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate ``x [..., rope_dim]``; neox pairs (i, i + rope_dim/2), interleaved pairs (2i, 2i+1). fp32 math."""
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2).to(x.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def paged_slots(block_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slot of token ``positions[..., i]`` of each sequence (row of ``block_table``). A negative page id
    wraps like a Python index when the slot is read (docs/indices.md)."""
    pages = torch.gather(block_table.long(), 1, positions // page_size)
    return pages * page_size + positions % page_size


class Indexer(nn.Module):
    """Lightning indexer of one layer. Inference only: parameters do not require grad.

    Entry points: :meth:`decode` (``next_n`` new tokens per sequence, K read from the paged cache) and
    :meth:`prefill` (whole sequences, causal). Both store the new tokens' K into ``kv_cache`` (uint8, layout
    ``self.layout``) and return ``(logits fp32, topk indices int32, -1 where fewer keys are visible)``.
    """

    def __init__(self, config: IndexerConfig, layout: KCacheLayout, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config = config
        self.layout = layout
        c = config
        self.wq_b = nn.Linear(c.q_lora_rank, c.n_heads * c.head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(c.hidden_size, c.head_dim, bias=False, dtype=dtype)
        self.k_norm = nn.LayerNorm(c.head_dim, eps=c.norm_eps, dtype=torch.float32)
        self.weights_proj = nn.Linear(c.hidden_size, c.n_heads, bias=False, dtype=torch.float32)
        self.register_buffer("hadamard", hadamard_matrix(c.head_dim), persistent=False)
        self.register_buffer("cos_sin", rope_cos_sin(c.rope_dim, c.max_model_len, c.rope_theta), persistent=False)
        self.requires_grad_(False)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Random weights with the scales of a trained model (activations of order 1)."""
        c = self.config
        for linear, fan_in in ((self.wq_b, c.q_lora_rank), (self.wk, c.hidden_size), (self.weights_proj, c.hidden_size)):
            w = torch.randn(linear.weight.shape, generator=generator) / math.sqrt(fan_in)
            linear.weight.copy_(w.to(linear.weight.device))
        self.k_norm.weight.copy_(1 + 0.1 * torch.randn(c.head_dim, generator=generator))
        self.k_norm.bias.copy_(0.1 * torch.randn(c.head_dim, generator=generator))

    def rotate_activation(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ self.hadamard * self.config.head_dim**-0.5).to(x.dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin[positions].unbind(1)
        if x.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        return apply_rope(x, cos, sin, self.config.rope_interleaved)

    def project_q(self, q_lora: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q in fp8 ``[T, H, 128]`` and its per-head scale ``[T, H]``."""
        c = self.config
        q = self.wq_b(q_lora).view(-1, c.n_heads, c.head_dim)
        q_pe = q[..., : c.rope_dim]
        q_pe.copy_(self._rope(q_pe, positions))
        q[..., : c.rope_dim] = q_pe
        q = self.rotate_activation(q)
        q_fp8, q_scale = act_quant(q, c.quant_block, c.scale_fmt, c.fp8_dtype, c.q_fp8_max)
        return q_fp8, q_scale.squeeze(-1)

    def store_k(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """LayerNorm(wk(x)), RoPE, Hadamard, act_quant, then write values and scale into the cache."""
        c = self.config
        k = self.k_norm(self.wk(x).float()).to(x.dtype)
        k_pe = k[..., : c.rope_dim]
        k_pe.copy_(self._rope(k_pe, positions))
        k = self.rotate_activation(k)
        k_fp8, k_scale = act_quant(k, c.quant_block, c.scale_fmt, c.fp8_dtype)
        self.layout.store(kv_cache, slot_mapping, k_fp8, k_scale.squeeze(-1))

    def head_gates(self, x: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
        """``w[t,h] = weights_proj(x)[t,h] * H^-0.5 * q_scale[t,h] * D^-0.5`` in fp32."""
        c = self.config
        weights = F.linear(x.float(), self.weights_proj.weight) * c.n_heads**-0.5
        return weights * q_scale * c.head_dim**-0.5

    def index_new_tokens(self, x, q_lora, positions, slot_mapping, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """What decode and prefill share: store the new tokens' K, then ``(q_fp8 [T,H,128], head gates [T,H])``."""
        self.store_k(x, positions, slot_mapping, kv_cache)
        q_fp8, q_scale = self.project_q(q_lora, positions)
        return q_fp8, self.head_gates(x, q_scale)

    def _topk(self, logits: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
        values, indices = torch.topk(logits, min(self.config.topk, logits.shape[-1]), dim=-1)
        if offset is not None:
            indices = indices - offset[:, None]
        return indices.masked_fill(values == float("-inf"), -1).to(torch.int32)

    def decode(
        self,
        x: torch.Tensor,
        q_lora: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``next_n = T // B`` new tokens per sequence (none in an empty batch, ``B = 0``); ``context_lens`` counts
        them.

        Like serving engines, the logits buffer spans ``max_model_len`` columns; keys are gathered only up to the
        block table's width (``max_pages * P``) and the rest of each row stays -inf.
        """
        c = self.config
        batch, max_pages = block_table.shape
        next_n = x.shape[0] // max(batch, 1)
        max_len = max_pages * self.layout.page_size
        q_fp8, weights = self.index_new_tokens(x, q_lora, positions, slot_mapping, kv_cache)

        key_pos = torch.arange(max_len, device=x.device)
        slots = paged_slots(block_table, key_pos.expand(batch, max_len), self.layout.page_size)
        k_fp8, k_scale = self.layout.load(kv_cache, slots.flatten(), c.fp8_dtype)
        k = k_fp8.float().view(batch, max_len, c.head_dim)
        scores = torch.einsum("bnhd,bsd->bnhs", q_fp8.view(batch, next_n, c.n_heads, c.head_dim).float(), k)
        scores = scores.relu() * k_scale.view(batch, 1, 1, max_len)
        scores = (scores * weights.view(batch, next_n, c.n_heads, 1)).sum(dim=2)
        last_visible = context_lens.view(batch, 1) - next_n + torch.arange(next_n, device=x.device)
        visible = key_pos <= last_visible.unsqueeze(-1)

        logits = torch.full((batch * next_n, c.max_model_len), float("-inf"), device=x.device)
        logits[:, :max_len] = scores.masked_fill(~visible, float("-inf")).view(batch * next_n, max_len)
        return logits, self._topk(logits)

    def prefill(
        self,
        x: torch.Tensor,
        q_lora: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        cu_seqlens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole sequences packed back to back (``cu_seqlens [B+1]``), causal. Logits ``[T, T]``; top-k indices
        are positions within each token's own sequence."""
        c = self.config
        num_tokens = x.shape[0]
        q_fp8, weights = self.index_new_tokens(x, q_lora, positions, slot_mapping, kv_cache)

        token = torch.arange(num_tokens, device=x.device)
        seq = torch.searchsorted(cu_seqlens[1:], token, right=True)
        ks = cu_seqlens[seq].long()
        pos_in_seq = token - ks
        slots = paged_slots(block_table[seq], pos_in_seq[:, None], self.layout.page_size).squeeze(1)
        k_fp8, k_scale = self.layout.load(kv_cache, slots, c.fp8_dtype)
        scores = torch.einsum("thd,sd->ths", q_fp8.float(), k_fp8.float())
        scores = (scores.relu() * k_scale * weights.unsqueeze(-1)).sum(dim=1)
        visible = (token >= ks[:, None]) & (token <= token[:, None])

        logits = torch.full((num_tokens, num_tokens), float("-inf"), device=x.device)
        logits[:, :num_tokens] = torch.where(visible, scores, float("-inf"))
        return logits, self._topk(logits, ks)
