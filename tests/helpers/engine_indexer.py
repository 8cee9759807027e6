"""A third lightning indexer, fed the way serving engines (SGLang, vLLM) feed theirs: a batch builder precomputes the
metadata once per batch and the model takes it as inputs, deriving none of it in the graph.

- decode: ``row_lens [B*next_n]`` keys visible to each query row (``ctx - next_n + j + 1``), the block table;
- prefill: per token ``seq_ids`` (token -> sequence map), ``positions`` (position in its sequence), ``ks``/``ke``
  (the keys row t sees are ``ks[t] <= n < ke[t]``, SGLang's ``cu_seqlen_ks/ke``), and the slot mapping;
- padding tokens write to a reserved dummy slot (slot 0 of page 0, never handed to a sequence) and see no key.

The prefill gathers K back from the cache pages itself (a plain ``[N, 128]`` fp8 K and ``[N]`` scale, as the engines'
torch fallbacks do) before the logits. Row-major pages only (flat is P=1). Other spellings than the reference's:
quantisation through ``exp2``, RoPE by ``cat`` (no write-back), the head gates by ``matmul``, k_scale inside the relu,
``torch.where`` masks, top-k through ``torch.where(values == -inf, -1, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from nsa_inductor.indexer import IndexerConfig, apply_rope, hadamard_matrix, rope_cos_sin
from nsa_inductor.layout import KCacheLayout
from nsa_inductor.quant import act_quant

DUMMY_SLOT = 0  # engines reserve a slot for padding tokens; the builder never gives page 0 to a sequence


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    fmax = torch.finfo(fp8_dtype).max
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4) / fmax
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return (x / scale).clamp(-fmax, fmax).to(fp8_dtype), scale


class EngineIndexer(nn.Module):
    def __init__(self, config: IndexerConfig, page_size: int):
        super().__init__()
        self.cfg, self.page_size = config, page_size
        c = config
        self.wq_b = nn.Linear(c.q_lora_rank, c.n_heads * c.head_dim, bias=False, dtype=torch.bfloat16)
        self.wk = nn.Linear(c.hidden_size, c.head_dim, bias=False, dtype=torch.bfloat16)
        self.k_norm = nn.LayerNorm(c.head_dim, eps=c.norm_eps)
        self.weights_proj = nn.Linear(c.hidden_size, c.n_heads, bias=False)
        self.register_buffer("hadamard", hadamard_matrix(c.head_dim), persistent=False)
        self.register_buffer("cos_sin", rope_cos_sin(c.rope_dim, c.max_model_len, c.rope_theta), persistent=False)
        self.requires_grad_(False)

    def load_from(self, reference: nn.Module) -> EngineIndexer:
        for name in ("wq_b", "wk", "k_norm", "weights_proj"):
            getattr(self, name).load_state_dict(getattr(reference, name).state_dict())
        return self

    # cache pages: the values of a page's P tokens, then their P fp32 scales
    def _pages(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.page_size
        return kv_cache[:, : p * 128].unflatten(1, (p, 128)), kv_cache[:, p * 128:].view(torch.float32)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        cos, sin = self.cos_sin[positions, 0], self.cos_sin[positions, 1]
        if x.dim() == 3:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rotated = apply_rope(x[..., : c.rope_dim], cos, sin, c.rope_interleaved)
        return torch.cat([rotated, x[..., c.rope_dim:]], dim=-1)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.matmul(x.float(), self.hadamard) * self.cfg.head_dim**-0.5).to(x.dtype)

    def _forward_common(self, x, q_lora, positions, slot_mapping, kv_cache):
        """Store the new tokens' K at ``slot_mapping``; return ``(q_fp8 [T, H, 128], head gates [T, H])``."""
        c = self.cfg
        ue8m0 = c.scale_fmt == "ue8m0"
        k = self.k_norm(self.wk(x).float()).to(x.dtype)
        k_fp8, k_scale = quantize(self._rotate(self._rope(k, positions)), c.fp8_dtype, ue8m0)
        values, scales = self._pages(kv_cache)
        page, pos = slot_mapping // self.page_size, slot_mapping % self.page_size
        values[page, pos] = k_fp8.view(torch.uint8)
        scales[page, pos] = k_scale.squeeze(-1)

        q = self.wq_b(q_lora).view(-1, c.n_heads, c.head_dim)
        q_fp8, q_scale = quantize(self._rotate(self._rope(q, positions)), c.fp8_dtype, ue8m0)
        gates = torch.matmul(x.float(), self.weights_proj.weight.t())
        gates = gates * (c.n_heads**-0.5 * c.head_dim**-0.5) * q_scale.squeeze(-1)
        return q_fp8, gates

    def _topk(self, logits: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
        values, indices = torch.topk(logits, min(self.cfg.topk, logits.shape[-1]), dim=-1)
        if offset is not None:
            indices = indices - offset.unsqueeze(1)
        return torch.where(values == float("-inf"), -1, indices).to(torch.int32)

    def decode(self, x, q_lora, positions, slot_mapping, kv_cache, block_table, row_lens):
        """``next_n = T // B`` tokens per sequence; query row r sees keys ``s < row_lens[r]``."""
        c = self.cfg
        q_fp8, gates = self._forward_common(x, q_lora, positions, slot_mapping, kv_cache)
        batch, max_pages = block_table.shape
        next_n, max_len = x.shape[0] // max(batch, 1), max_pages * self.page_size
        values, scales = self._pages(kv_cache)
        col = torch.arange(max_len, device=x.device)
        page = block_table[:, col // self.page_size].long()
        keys = values[page, col % self.page_size].view(c.fp8_dtype)             # [B, max_len, 128]
        key_scale = scales[page, col % self.page_size]                           # [B, max_len]
        q = q_fp8.view(batch, next_n, c.n_heads, c.head_dim)
        dots = torch.einsum("bjhd,bsd->bjhs", q.float(), keys.float())
        scores = (torch.relu(dots * key_scale[:, None, None, :]) * gates.view(batch, next_n, c.n_heads, 1)).sum(2)
        scores = scores.reshape(batch * next_n, max_len)
        logits = torch.where(col[None, :] < row_lens[:, None], scores, float("-inf"))
        return logits, self._topk(logits, None)

    def _batch_keys(self, kv_cache, positions, slot_mapping, block_table, seq_ids):
        """The engine's own gather of the batch's keys ``[T, 128]`` fp8 and ``[T]`` scales, by sequence and
        position through the block table (subclasses read them otherwise)."""
        values, scales = self._pages(kv_cache)
        page, pos = block_table[seq_ids, positions // self.page_size].long(), positions % self.page_size
        return values[page, pos].view(self.cfg.fp8_dtype), scales[page, pos]

    def prefill(self, x, q_lora, positions, slot_mapping, kv_cache, block_table, seq_ids, ks, ke):
        """Token t (of sequence ``seq_ids[t]`` at ``positions[t]``) sees the batch's keys ``ks[t] <= n < ke[t]``."""
        q_fp8, gates = self._forward_common(x, q_lora, positions, slot_mapping, kv_cache)
        k_fp8, k_scale = self._batch_keys(kv_cache, positions, slot_mapping, block_table, seq_ids)
        dots = torch.einsum("thd,nd->thn", q_fp8.float(), k_fp8.float())
        scores = (torch.relu(dots * k_scale) * gates.unsqueeze(-1)).sum(1)
        col = torch.arange(x.shape[0], device=x.device)
        visible = (col[None, :] >= ks[:, None]) & (col[None, :] < ke[:, None])
        logits = torch.where(visible, scores, float("-inf"))
        return logits, self._topk(logits, ks)


# ---------------------------------------------------------------------------------------------------------------
# the batch builder: metadata computed once per batch, on the host, as engines do
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class EngineBatch:
    x: torch.Tensor
    q_lora: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    meta: tuple[torch.Tensor, ...]  # decode: (row_lens,); prefill: (seq_ids, ks, ke)

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.x, self.q_lora, self.positions, self.slot_mapping, self.kv_cache, self.block_table, *self.meta)

    def _map(self, fn) -> EngineBatch:
        parts = {f.name: getattr(self, f.name) for f in fields(self)}
        return EngineBatch(**{k: tuple(map(fn, v)) if isinstance(v, tuple) else fn(v) for k, v in parts.items()})

    def clone(self) -> EngineBatch:
        return self._map(torch.Tensor.clone)

    def to(self, device) -> EngineBatch:
        return self._map(lambda t: t.to(device))


def _pages_for(lens: list[int], page: int, max_pages: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct shuffled pages per sequence, page 0 kept for the dummy slot; unused entries point at page 0."""
    need = [-(-n // page) for n in lens]
    pages = torch.randperm(sum(need), generator=gen) + 1
    table = torch.zeros(len(lens), max_pages, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = pages[start:start + n]
        start += n
    return table


def _slot(table: torch.Tensor, b: int, pos: int, page: int) -> int:
    return int(table[b, pos // page]) * page + pos % page


def _activations(config: IndexerConfig, tokens: int, gen: torch.Generator):
    return (torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16),
            torch.randn(tokens, config.q_lora_rank, generator=gen).to(torch.bfloat16))


def _cache(layout: KCacheLayout, table: torch.Tensor, cache_slots: int | None) -> torch.Tensor:
    return layout.allocate(cache_slots or (int(table.max()) + 1) * layout.page_size)


def engine_decode_batch(config: IndexerConfig, page: int, context_lens: list[int], next_n: int, max_len: int,
                        cache_slots: int | None, seed: int) -> EngineBatch:
    """``next_n`` new tokens per sequence after ``ctx - next_n`` cached ones; a sequence with ``ctx < next_n`` is
    padding (dummy slot, sees nothing). ``cache_slots=None``: the smallest cache the batch fits in."""
    gen = torch.Generator().manual_seed(seed)
    layout = KCacheLayout(page)
    table = _pages_for(context_lens, page, -(-max_len // page), gen)
    cache = _cache(layout, table, cache_slots)
    positions, slots, row_lens = [], [], []
    for b, ctx in enumerate(context_lens):
        prior = torch.arange(max(ctx - next_n, 0))
        if len(prior):
            k_fp8, k_scale = act_quant(torch.randn(len(prior), config.head_dim, generator=gen), config.quant_block,
                                       config.scale_fmt, config.fp8_dtype)
            layout.store(cache, table[b, prior // page].long() * page + prior % page, k_fp8, k_scale.squeeze(-1))
        for j in range(next_n):
            pos = ctx - next_n + j
            positions.append(max(pos, 0))
            slots.append(_slot(table, b, pos, page) if pos >= 0 else DUMMY_SLOT)
            row_lens.append(max(pos + 1, 0))
    x, q_lora = _activations(config, len(positions), gen)
    return EngineBatch(x, q_lora, torch.tensor(positions, dtype=torch.long), torch.tensor(slots, dtype=torch.long),
                       cache, table, (torch.tensor(row_lens, dtype=torch.int32),))


def engine_prefill_batch(config: IndexerConfig, page: int, seq_lens: list[int], padding_tokens: int,
                         cache_slots: int | None, seed: int) -> EngineBatch:
    """Whole sequences back to back, then padding tokens (dummy slot, ``ks = ke = 0``: they see nothing)."""
    gen = torch.Generator().manual_seed(seed)
    layout = KCacheLayout(page)
    table = _pages_for(seq_lens + [1], page, -(-max(seq_lens + [1]) // page), gen)
    table[-1] = 0  # the padding tokens' sequence: the dummy page
    cache = _cache(layout, table, cache_slots)
    positions, slots, seq_ids, ks, ke = [], [], [], [], []
    start = 0
    for b, n in enumerate(seq_lens):
        for p in range(n):
            positions.append(p)
            slots.append(_slot(table, b, p, page))
            seq_ids.append(b)
            ks.append(start)
            ke.append(start + p + 1)
        start += n
    for _ in range(padding_tokens):
        positions.append(0)
        slots.append(DUMMY_SLOT)
        seq_ids.append(len(seq_lens))
        ks.append(0)
        ke.append(0)
    x, q_lora = _activations(config, len(positions), gen)
    meta = (torch.tensor(seq_ids, dtype=torch.int32), torch.tensor(ks, dtype=torch.int32),
            torch.tensor(ke, dtype=torch.int32))
    return EngineBatch(x, q_lora, torch.tensor(positions, dtype=torch.long), torch.tensor(slots, dtype=torch.long),
                       cache, table, meta)
