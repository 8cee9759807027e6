"""Synthetic serving batches (decode and prefill metadata, a filled K cache) for the example, tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .indexer import IndexerConfig
from .layout import KCacheLayout
from .quant import act_quant


@dataclass
class Batch:
    """Inputs of :meth:`Indexer.decode` / :meth:`Indexer.prefill` in argument order (``args``)."""

    x: torch.Tensor
    q_lora: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    lens: torch.Tensor  # context_lens [B] for decode, cu_seqlens [B+1] for prefill

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.x, self.q_lora, self.positions, self.slot_mapping, self.kv_cache, self.block_table, self.lens)

    def clone(self) -> Batch:
        return Batch(*(t.clone() for t in self.args))


def _block_table(layout: KCacheLayout, seq_lens: list[int], max_pages: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct, shuffled pages per sequence; unused entries point at page 0."""
    num_pages = sum(layout.num_pages(n) for n in seq_lens)
    pages = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
    start = 0
    for b, n in enumerate(seq_lens):
        used = layout.num_pages(n)
        table[b, :used] = pages[start : start + used]
        start += used
    return table


def _cache(layout: KCacheLayout, table: torch.Tensor, cache_pages: int | None) -> torch.Tensor:
    needed = int(table.max()) + 1 if table.numel() else 1
    if cache_pages is not None and cache_pages < needed:
        raise ValueError(f"cache_pages={cache_pages} is too small: the batch uses {needed} pages")
    return layout.allocate((cache_pages or needed) * layout.page_size)


def _activations(config: IndexerConfig, num_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(num_tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(num_tokens, config.q_lora_rank, generator=gen).to(torch.bfloat16)
    return x, q_lora


def decode_batch(
    config: IndexerConfig,
    layout: KCacheLayout,
    context_lens: list[int],
    next_n: int = 1,
    max_len: int | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    cache_pages: int | None = None,
) -> Batch:
    """``next_n`` new tokens for each sequence; its earlier ``ctx - next_n`` tokens already sit in the cache.

    A sequence with ``ctx < next_n`` is a padding row: its tokens have slot -1 and see nothing; no sequence at all is
    an empty batch (as an idle data-parallel rank runs). ``cache_pages`` fixes the cache size (as a serving engine's
    is), so batches of different shapes share one cache shape.
    """
    gen = torch.Generator().manual_seed(seed)
    page = layout.page_size
    max_len = max_len or max([*context_lens, 1])
    max_pages = layout.num_pages(max_len)
    table = _block_table(layout, context_lens, max_pages, gen)
    cache = _cache(layout, table, cache_pages)
    positions, slots = [], []
    for b, ctx in enumerate(context_lens):
        prior = torch.arange(max(ctx - next_n, 0))
        old_slots = table[b, prior // page].long() * page + prior % page
        old_k = torch.randn(len(prior), config.head_dim, generator=gen)
        k_fp8, k_scale = act_quant(old_k, config.quant_block, config.scale_fmt, config.fp8_dtype)
        layout.store(cache, old_slots, k_fp8, k_scale.squeeze(-1))
        for j in range(next_n):
            pos = ctx - next_n + j
            positions.append(max(pos, 0))
            slots.append(int(table[b, pos // page]) * page + pos % page if pos >= 0 else -1)
    x, q_lora = _activations(config, len(context_lens) * next_n, gen)
    batch = Batch(x, q_lora, torch.tensor(positions, dtype=torch.long), torch.tensor(slots, dtype=torch.long), cache,
                  table, torch.tensor(context_lens, dtype=torch.int32))
    return Batch(*(t.to(device) for t in batch.args))


def prefill_batch(
    config: IndexerConfig,
    layout: KCacheLayout,
    seq_lens: list[int],
    padding_tokens: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    cache_pages: int | None = None,
) -> Batch:
    """Whole sequences packed back to back, then ``padding_tokens`` with slot -1 (as CUDA-graph padding does).

    The padding tokens form one more sequence whose K is never written; their rows are computed but meaningless.
    """
    gen = torch.Generator().manual_seed(seed)
    page = layout.page_size
    all_lens = seq_lens + ([padding_tokens] if padding_tokens else [])
    table = _block_table(layout, all_lens, layout.num_pages(max([*all_lens, 1])), gen)
    cache = _cache(layout, table, cache_pages)
    positions = [p for n in all_lens for p in range(n)]
    slots = [int(table[b, p // page]) * page + p % page for b, n in enumerate(seq_lens) for p in range(n)]
    slots += [-1] * padding_tokens
    cu = torch.tensor([0] + all_lens).cumsum(0).to(torch.int32)
    x, q_lora = _activations(config, len(positions), gen)
    batch = Batch(x, q_lora, torch.tensor(positions, dtype=torch.long), torch.tensor(slots, dtype=torch.long), cache,
                  table, cu)
    return Batch(*(t.to(device) for t in batch.args))

