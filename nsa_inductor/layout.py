"""Byte layouts of the index-K cache (DESIGN §3), in plain torch.

One cache per layer is a ``uint8`` tensor of shape ``[num_pages, page_size * 132]``: each page holds the fp8
values of its tokens first, then their fp32 scales. ``page_size == 1`` is the flat layout (one 132-byte row per
slot). The preshuffle layout permutes a page's value bytes in 16x16-byte tiles; scales are never shuffled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEAD_DIM = 128
SCALE_BYTES = 4
TOKEN_BYTES = HEAD_DIM + SCALE_BYTES
SHUFFLE_TILE = 16


def written_slots(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Which tokens of a store write their slot (docs/indices.md): those whose slot is in ``[0, num_slots)`` and no
    later token of the store has. Plain broadcasting (a ``[T, T]`` comparison, no sort, no host synchronisation);
    the ``quant_cache_store`` pass drops it with the rest of the store, as the kernel applies the rule itself."""
    slots = slots.long()
    overwritten = (slots[:, None] == slots[None, :]).triu(1).any(1)
    return ~overwritten & (slots >= 0) & (slots < num_slots)


@dataclass(frozen=True)
class KCacheLayout:
    """Where a slot's 128 fp8 values and fp32 scale live inside the uint8 cache."""

    page_size: int = 64
    preshuffle: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"KCacheLayout.page_size must be a positive int, got {self.page_size!r}")
        if self.preshuffle and self.page_size % SHUFFLE_TILE:
            raise ValueError(
                f"the preshuffle K-cache layout needs page_size to be a multiple of {SHUFFLE_TILE}, "
                f"got page_size={self.page_size}"
            )

    @property
    def name(self) -> str:
        if self.page_size == 1:
            return "flat"
        return "preshuffle" if self.preshuffle else "paged"

    @property
    def page_bytes(self) -> int:
        return self.page_size * TOKEN_BYTES

    def __str__(self) -> str:
        return f"{self.name}(page_size={self.page_size})"

    def num_pages(self, num_slots: int) -> int:
        return -(-num_slots // self.page_size)

    def allocate(self, num_slots: int, device: torch.device | str | None = None) -> torch.Tensor:
        """A zeroed cache with room for at least ``num_slots`` tokens."""
        return torch.zeros(self.num_pages(num_slots), self.page_bytes, dtype=torch.uint8, device=device)

    def check_cache(self, cache: torch.Tensor) -> None:
        if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != self.page_bytes:
            raise ValueError(
                f"K cache must be uint8 [num_pages, {self.page_bytes}] for layout {self}, "
                f"got {cache.dtype} {list(cache.shape)}"
            )

    def value_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """Byte offsets ``[N, 128]`` (int64) of each slot's fp8 values in the flattened cache."""
        slots = slots.long()
        page, pos = slots // self.page_size, slots % self.page_size
        d = torch.arange(HEAD_DIM, device=slots.device)
        if self.preshuffle:
            inner = (
                (pos // SHUFFLE_TILE)[:, None] * (SHUFFLE_TILE * HEAD_DIM)
                + (d // SHUFFLE_TILE) * (SHUFFLE_TILE * SHUFFLE_TILE)
                + (pos % SHUFFLE_TILE)[:, None] * SHUFFLE_TILE
                + d % SHUFFLE_TILE
            )
        else:
            inner = pos[:, None] * HEAD_DIM + d
        return page[:, None] * self.page_bytes + inner

    def scale_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """Byte offsets ``[N, 4]`` (int64) of each slot's fp32 scale in the flattened cache."""
        slots = slots.long()
        page, pos = slots // self.page_size, slots % self.page_size
        j = torch.arange(SCALE_BYTES, device=slots.device)
        return page[:, None] * self.page_bytes + self.page_size * HEAD_DIM + pos[:, None] * SCALE_BYTES + j

    def slots_of_bytes(self, offsets: torch.Tensor) -> torch.Tensor:
        """The slot whose value or scale each byte offset of the flattened cache holds (the inverse of
        ``value_offsets`` and ``scale_offsets``)."""
        offsets = offsets.long()
        page, inner = offsets // self.page_bytes, offsets % self.page_bytes
        values = self.page_size * HEAD_DIM
        if self.preshuffle:  # a tile row of 16 tokens, then the token's row within its 16x16 tiles
            tile = SHUFFLE_TILE * SHUFFLE_TILE
            pos = inner // (SHUFFLE_TILE * HEAD_DIM) * SHUFFLE_TILE + inner % tile // SHUFFLE_TILE
        else:
            pos = inner // HEAD_DIM
        return page * self.page_size + torch.where(inner < values, pos, (inner - values) // SCALE_BYTES)

    def store(self, cache: torch.Tensor, slots: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor) -> None:
        """Write ``k_fp8 [N,128]`` and ``k_scale [N]`` into ``cache`` at ``slots``; a slot outside
        ``[0, num_slots)`` (negative: padding) writes nothing, and of tokens sharing a slot the last one writes it
        (:func:`written_slots`, docs/indices.md).

        The cache is written as 32-bit words (a token's values are 32 aligned words, its scale one), and rows that
        write nothing are folded into the same scatter as zero increments (integer arithmetic wraps), so the store
        stays shape-static, deterministic when such a row and a written row share a clamped offset, and compilable
        by Inductor on GPUs (atomic adds exist for int32, not for uint8).
        """
        num_slots = cache.shape[0] * self.page_size
        valid = written_slots(slots, num_slots)[:, None]
        safe = slots.clamp(0, num_slots - 1)
        words = cache.view(torch.int32).view(-1)
        for offsets, new in (
            (self.value_offsets(safe)[:, ::SCALE_BYTES] // SCALE_BYTES, k_fp8.contiguous().view(torch.int32)),
            (self.scale_offsets(safe)[:, :1] // SCALE_BYTES, k_scale.float().contiguous().view(torch.int32)[:, None]),
        ):
            delta = torch.where(valid, new - words[offsets], 0)
            words.index_put_((offsets,), delta, accumulate=True)

    def load(self, cache: torch.Tensor, slots: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Read ``(k_fp8 [N,128], k_scale [N] fp32)`` of ``slots``; a slot in ``[-num_slots, 0)`` wraps like a Python
        index (page ``p + num_pages``), any other slot outside ``[0, num_slots)`` raises like one."""
        flat = cache.view(-1)
        values = flat[self.value_offsets(slots)].view(fp8_dtype)
        scale = flat[self.scale_offsets(slots)].contiguous().view(torch.float32).squeeze(-1)
        return values, scale

    def pack(self, k_fp8: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
        """A new cache whose slot ``i`` holds row ``i`` of ``k_fp8`` / ``k_scale``."""
        cache = self.allocate(k_fp8.shape[0], device=k_fp8.device)
        self.store(cache, torch.arange(k_fp8.shape[0], device=k_fp8.device), k_fp8, k_scale)
        return cache

    def unpack(self, cache: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot of ``cache`` as row-major ``(k_fp8 [num_slots,128], k_scale [num_slots])``."""
        self.check_cache(cache)
        slots = torch.arange(cache.shape[0] * self.page_size, device=cache.device)
        return self.load(cache, slots, fp8_dtype)

