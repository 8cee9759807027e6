import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nsa_inductor.layout import KCacheLayout
from helpers.reference64 import scale_byte, value_byte

LAYOUTS = st.sampled_from([(1, False), (16, False), (64, False), (5, False), (16, True), (32, True), (64, True)])


def expected_cache(layout: KCacheLayout, num_pages: int, slots, k_bytes, scales, base: torch.Tensor) -> torch.Tensor:
    flat = base.clone().reshape(-1)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        for d in range(128):
            flat[value_byte(slot, d, layout.page_size, layout.preshuffle)] = k_bytes[t, d]
        start = scale_byte(slot, layout.page_size)
        flat[start:start + 4] = scales[t : t + 1].view(torch.uint8)
    return flat.view(num_pages, -1)


@given(layout=LAYOUTS, num_tokens=st.integers(1, 40), padding=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_store_matches_byte_formula_and_skips_padding(layout, num_tokens, padding, seed):
    layout = KCacheLayout(*layout)
    gen = torch.Generator().manual_seed(seed)
    num_slots = num_tokens + 7
    cache = layout.allocate(num_slots)
    cache.random_(0, 256, generator=gen)
    slots = torch.randperm(layout.num_pages(num_slots) * layout.page_size, generator=gen)[:num_tokens]
    slots = torch.cat([slots, torch.full((padding,), -1)])[torch.randperm(num_tokens + padding, generator=gen)]
    k = torch.randn(len(slots), 128, generator=gen).to(torch.float8_e4m3fn)
    scales = torch.rand(len(slots), generator=gen)
    expected = expected_cache(layout, cache.shape[0], slots.tolist(), k.view(torch.uint8), scales, cache)
    layout.store(cache, slots, k, scales)
    assert torch.equal(cache, expected)

    valid = slots >= 0
    values, loaded_scales = layout.load(cache, slots[valid], torch.float8_e4m3fn)
    assert torch.equal(values.view(torch.uint8), k[valid].view(torch.uint8))
    assert torch.equal(loaded_scales, scales[valid])


@given(layout=LAYOUTS, n=st.integers(1, 150), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip(layout, n, seed):
    layout = KCacheLayout(*layout)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, 128, generator=gen).to(torch.float8_e4m3fnuz)
    scales = torch.rand(n, generator=gen)
    cache = layout.pack(k, scales)
    assert cache.shape == (layout.num_pages(n), layout.page_size * 132) and cache.dtype == torch.uint8
    values, loaded = layout.unpack(cache, torch.float8_e4m3fnuz)
    assert torch.equal(values[:n].view(torch.uint8), k.view(torch.uint8)) and torch.equal(loaded[:n], scales)


@given(layout=LAYOUTS, num_pages=st.integers(1, 3))
def test_slots_of_bytes_inverts_the_offsets(layout, num_pages):
    layout = KCacheLayout(*layout)
    slots = torch.arange(num_pages * layout.page_size)
    values, scales = layout.value_offsets(slots), layout.scale_offsets(slots)
    assert torch.equal(layout.slots_of_bytes(values), slots[:, None].expand_as(values))
    assert torch.equal(layout.slots_of_bytes(scales), slots[:, None].expand_as(scales))
    every_byte = layout.slots_of_bytes(torch.arange(num_pages * layout.page_bytes))
    assert torch.equal(every_byte.bincount(), torch.full((len(slots),), 132))  # each byte is one slot's


def test_preshuffle_is_the_16x16_tile_permutation_of_the_row_major_page():
    page = 64
    k = torch.randint(0, 256, (page, 128), dtype=torch.uint8)
    scales = torch.rand(page)
    row_major = KCacheLayout(page).pack(k.view(torch.float8_e4m3fn), scales)[0]
    shuffled = KCacheLayout(page, preshuffle=True).pack(k.view(torch.float8_e4m3fn), scales)[0]
    expected_values = row_major[: page * 128].view(page // 16, 16, 8, 16).permute(0, 2, 1, 3).reshape(-1)
    assert torch.equal(shuffled[: page * 128], expected_values)
    assert torch.equal(shuffled[page * 128 :], row_major[page * 128 :]), "scales are never shuffled"


def test_layout_errors_are_clear():
    with pytest.raises(ValueError, match="multiple of 16"):
        KCacheLayout(24, preshuffle=True)
    with pytest.raises(ValueError, match="positive int"):
        KCacheLayout(0)
    with pytest.raises(ValueError, match=r"uint8 \[num_pages, 8448\]"):
        KCacheLayout(64).check_cache(torch.zeros(2, 132, dtype=torch.uint8))
