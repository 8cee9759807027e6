"""quant_cache_store: act_quant + K-cache store -> nsa.quant_cache_store (counts, near misses, bytes vs eager)."""

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nsa_inductor.layout import KCacheLayout
from nsa_inductor.quant import act_quant
from helpers.pass_helpers import compile_with_dumps, count_ops, graph_dirs, pass_entry, pass_graphs, read_report

LAYOUTS = {"flat": KCacheLayout(1), "paged": KCacheLayout(16), "preshuffle": KCacheLayout(16, preshuffle=True)}
NUM_SLOTS = 96


def reference_store(layout, scale_fmt="ue8m0", fp8_dtype=torch.float8_e4m3fn, **quant_kwargs):
    def store(k, slots, cache):
        k_fp8, k_scale = act_quant(k, scale_fmt=scale_fmt, fp8_dtype=fp8_dtype, **quant_kwargs)
        layout.store(cache, slots, k_fp8, k_scale[:, 0])

    return store


def page_view_store(page_size):
    """Another spelling: views of the page bytes, plain overwrites, pow(2, .) for ue8m0."""

    def store(k, slots, cache):
        x = k.float()
        scale = torch.pow(2.0, torch.ceil(torch.log2(x.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0)))
        k_fp8 = torch.clamp(x / scale, -448.0, 448.0).to(torch.float8_e4m3fn)
        pages = cache.view(-1, page_size * 132)
        values = pages[:, : page_size * 128].unflatten(1, (page_size, 128))
        scales = pages[:, page_size * 128 :].view(torch.float32)
        values[slots // page_size, slots % page_size] = k_fp8.view(torch.uint8)
        scales[slots // page_size, slots % page_size] = scale.squeeze(-1)

    return store


def masked_store(layout, writes, masked_out=0, scale_masked=True, old_of_other_tokens=False):
    """The eager store's masked delta on the cache bytes, with ``writes(slots)`` the tokens that write, adding
    ``masked_out`` where they do not; ``scale_masked=False``: the scale written plainly (negative slots wrap);
    ``old_of_other_tokens``: the delta subtracts the bytes at the tokens' slots in reverse order."""

    def store(k, slots, cache):
        k_fp8, k_scale = act_quant(k)
        flat = cache.view(-1)
        valid = writes(slots)[:, None]
        pairs = [(layout.value_offsets(slots.clamp(min=0)), k_fp8.view(torch.uint8))]
        scale_bytes = k_scale.view(torch.uint8).view(-1, 4)
        if scale_masked:
            pairs.append((layout.scale_offsets(slots.clamp(min=0)), scale_bytes))
        else:
            flat[layout.scale_offsets(slots)] = scale_bytes
        for offsets, new in pairs:
            old = flat[offsets.flip(0)] if old_of_other_tokens else flat[offsets]
            flat.index_put_((offsets,), torch.where(valid, new - old, masked_out), accumulate=True)

    return store


def mirrored_store(k, slots, cache):
    """Every token's row written at two slots: two value and two scale writes, not the op's one of each."""
    k_fp8, k_scale = act_quant(k)
    for at in (slots, torch.where(slots >= 0, (slots + NUM_SLOTS // 2) % NUM_SLOTS, slots)):
        LAYOUTS["paged"].store(cache, at, k_fp8, k_scale[:, 0])


def scale_half_overwritten_store(k, slots, cache):
    """The store, then a third write of neither size the op makes: each token's first two value bytes over the first
    two of its scale."""
    k_fp8, k_scale = act_quant(k)
    layout = LAYOUTS["paged"]
    layout.store(cache, slots, k_fp8, k_scale[:, 0])
    cache.view(-1)[layout.scale_offsets(slots)[:, :2]] = k_fp8.view(torch.uint8)[:, :2]


def doubled_scale_store(k, slots, cache):
    k_fp8, k_scale = act_quant(k)
    LAYOUTS["paged"].store(cache, slots, k_fp8, k_scale[:, 0] * 2)


VARIANTS = {
    # name: (store function, compile-time layout name, expected to fire)
    "flat": (reference_store(LAYOUTS["flat"]), "flat", True),
    "paged": (reference_store(LAYOUTS["paged"]), "paged", True),
    "preshuffle": (reference_store(LAYOUTS["preshuffle"]), "preshuffle", True),
    "paged-fp32-scale": (reference_store(LAYOUTS["paged"], scale_fmt="fp32"), "paged", True),
    "preshuffle-fnuz": (reference_store(LAYOUTS["preshuffle"], fp8_dtype=torch.float8_e4m3fnuz), "preshuffle", True),
    "page-views-flat": (page_view_store(1), "flat", True),
    "page-views-paged": (page_view_store(16), "paged", True),
    "near-miss-fp8-max-224": (reference_store(LAYOUTS["paged"], max_value=224.0), "paged", False),
    "near-miss-block-64": (reference_store(LAYOUTS["paged"], block_size=64), "paged", False),
    "near-miss-wrong-layout": (reference_store(LAYOUTS["paged"]), "preshuffle", False),
    # no rule for shared slots (eager then writes no token's bytes there): the op's last-token rule may replace it
    "no-duplicate-rule": (masked_store(LAYOUTS["paged"], lambda s: s >= 0), "paged", True),
    # slot 0 never written, which the op would write
    "near-miss-mask": (masked_store(LAYOUTS["paged"], lambda s: s > 0), "paged", False),
    "near-miss-masked-out-one": (masked_store(LAYOUTS["paged"], lambda s: s >= 0, masked_out=1), "paged", False),
    "near-miss-scale-unmasked": (masked_store(LAYOUTS["paged"], lambda s: s >= 0, scale_masked=False), "paged",
                                 False),
    "near-miss-delta-of-other-bytes": (masked_store(LAYOUTS["paged"], lambda s: s >= 0, old_of_other_tokens=True),
                                       "paged", False),
    "near-miss-doubled-scale": (doubled_scale_store, "paged", False),
    "near-miss-mirrored": (mirrored_store, "paged", False),
    "near-miss-third-write": (scale_half_overwritten_store, "paged", False),
    "near-miss-first-of-shared-slot": (
        masked_store(LAYOUTS["paged"], lambda s: (s >= 0) & ~(s[:, None] == s[None, :]).tril(-1).any(1)), "paged",
        False),
}
REASONS = {
    "near-miss-fp8-max-224": "max is 448",
    "near-miss-block-64": "quant block is 64 wide",
    "near-miss-wrong-layout": "not the preshuffle(page_size=16) layout",
    "near-miss-mask": "padding mask is not slot >= 0",
    "near-miss-first-of-shared-slot": "another token than the last",
    "near-miss-masked-out-one": "masked-out delta is 1",
    "near-miss-scale-unmasked": "treat padding slots differently",
    "near-miss-delta-of-other-bytes": "does not subtract the bytes already at the written offsets",
    "near-miss-doubled-scale": "not the scale of the quantized values",
    "near-miss-mirrored": "one 128-byte value write and one 4-byte scale write",
    "near-miss-third-write": "one 128-byte value write and one 4-byte scale write",
}


@functools.cache
def compiled(variant):
    fn, layout_name, _ = VARIANTS[variant]
    layout = LAYOUTS[layout_name]
    compiled_fn, dump_dir = compile_with_dumps(
        fn, {"nsa.layout": layout_name, "nsa.page_size": layout.page_size}, dynamic=False)
    return fn, compiled_fn, dump_dir


def inputs(variant, num_tokens, seed, padding=True, dtype=torch.bfloat16):
    layout = LAYOUTS[VARIANTS[variant][1] if "wrong-layout" not in variant else "paged"]
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn(num_tokens, 128, generator=gen) * torch.rand(num_tokens, 1, generator=gen) * 10).to(dtype)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:num_tokens]
    if padding and num_tokens > 1:
        slots[torch.randperm(num_tokens, generator=gen)[: num_tokens // 3]] = -1
    cache = torch.randint(0, 256, (layout.num_pages(NUM_SLOTS), layout.page_bytes), dtype=torch.uint8, generator=gen)
    return k, slots, cache


def run_both(variant, num_tokens=8, seed=0, padding=True):
    fn, compiled_fn, _ = compiled(variant)
    padding = padding and not variant.startswith("page-views")
    k, slots, cache = inputs(variant, num_tokens, seed, padding)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    fn(k, slots, eager_cache)
    compiled_fn(k, slots, compiled_cache)
    return eager_cache, compiled_cache


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fires_exactly_on_the_idiom_and_keeps_bytes(variant):
    eager_cache, compiled_cache = run_both(variant)
    assert torch.equal(eager_cache, compiled_cache), "cache bytes differ from eager"
    _, _, dump_dir = compiled(variant)
    (graph_dir,) = graph_dirs(dump_dir)
    entry = pass_entry(graph_dir, "quant_cache_store")
    before, after = pass_graphs(graph_dir, "quant_cache_store")
    fires = VARIANTS[variant][2]
    assert entry["matched"] == int(fires)
    assert count_ops(before, "nsa.quant_cache_store") == 0
    assert count_ops(after, "nsa.quant_cache_store") == int(fires)
    assert (count_ops(after, "aten.index_put") == 0) == fires
    report = read_report(graph_dir)
    if fires:
        assert count_ops(after, "aten.log2") == 0 and count_ops(after, "aten.amax") == 0
        assert report["cache_copies"] == 0, report["cache_copy_sites"]
    else:
        (miss,) = entry["near_misses"]
        assert REASONS[variant] in miss["reason"]
        # Inductor's own store stays, with its copies of the cache: counted, and the near miss names the cache
        assert report["cache_copies"] > 0 and miss["reason"].startswith("cache arg")


@pytest.mark.parametrize("variant", ["flat", "paged", "preshuffle", "page-views-paged", "no-duplicate-rule",
                                     "near-miss-mirrored"])
def test_a_store_of_no_token_is_removed(variant):
    """An empty batch (Dynamo specialises T=0: a graph of its own) writes no byte: every write's index is empty, so
    the store goes whatever its layout and values (also one the pass leaves alone where tokens are written, the
    mirrored store), and no copy of the cache is left."""
    fn, layout_name, _ = VARIANTS[variant]
    compiled_fn, dump_dir = compile_with_dumps(
        fn, {"nsa.layout": layout_name, "nsa.page_size": LAYOUTS[layout_name].page_size}, dynamic=False)
    k, slots, cache = inputs(variant, 0, 0)
    before = cache.clone()
    compiled_fn(k, slots, cache)
    assert torch.equal(cache, before)
    (graph_dir,) = graph_dirs(dump_dir)
    assert pass_entry(graph_dir, "quant_cache_store")["matched"] == 1
    before_pass, after = pass_graphs(graph_dir, "quant_cache_store")
    assert count_ops(before_pass, "aten.index_put") > 0
    assert count_ops(after, "aten.index_put") == 0 and count_ops(after, "nsa.quant_cache_store") == 0
    assert read_report(graph_dir)["cache_copies"] == 0


def store_then_count_byte(k, slots, cache):
    """The store, then a byte at an index computed from the slots that exists with no token too (their sum: 0)."""
    reference_store(LAYOUTS["paged"])(k, slots, cache)
    cache.view(-1)[slots.sum(0, keepdim=True)] = 7


def test_a_store_of_no_token_that_writes_a_byte_elsewhere_stays():
    k, slots, cache = inputs("paged", 0, 0)
    assert_store_kept(store_then_count_byte, k, slots, cache, "holds no token, but a write into the cache indexes",
                      dynamic=False)


def test_the_rewritten_store_is_reinplaced():
    """No copy of the cache is left in the generated code: the op writes the cache input itself."""
    from torch._inductor.utils import run_and_get_code

    fn, _, _ = compiled("paged")
    k, slots, cache = inputs("paged", 8, 0)
    torch._dynamo.reset()
    compiled_fn = torch.compile(fn, backend="nsa_rocm", options={"nsa.layout": "paged", "nsa.page_size": 16})
    _, (code, *_) = run_and_get_code(compiled_fn, k, slots, cache)
    assert "nsa.quant_cache_store.default(" in code
    assert "auto_functionalized" not in code and ".copy_(" not in code


@given(num_tokens=st.sampled_from([1, 5, 8]), seed=st.integers(0, 10_000),
       variant=st.sampled_from(["flat", "paged", "preshuffle", "paged-fp32-scale", "page-views-paged"]))
def test_bytes_match_eager_for_any_slots(num_tokens, seed, variant):
    eager_cache, compiled_cache = run_both(variant, num_tokens, seed)
    assert torch.equal(eager_cache, compiled_cache)


def dynamic_store(k, slots, cache):
    """Its own code object: Dynamo's recompile state for the shared ``store`` closures does not leak into it."""
    k_fp8, k_scale = act_quant(k)
    LAYOUTS["paged"].store(cache, slots, k_fp8, k_scale[:, 0])


def test_one_compile_serves_many_token_counts():
    fn = dynamic_store
    compiled_fn, dump_dir = compile_with_dumps(fn, {"nsa.layout": "paged", "nsa.page_size": 16})
    for num_tokens in (3, 17, 64):
        k, slots, cache = inputs("paged", num_tokens, num_tokens)
        torch._dynamo.mark_dynamic(k, 0)
        torch._dynamo.mark_dynamic(slots, 0)
        eager_cache, compiled_cache = cache.clone(), cache.clone()
        fn(k, slots, eager_cache)
        compiled_fn(k, slots, compiled_cache)
        assert torch.equal(eager_cache, compiled_cache)
    dirs = graph_dirs(dump_dir)
    assert len(dirs) == 1, "one dynamic-shape graph serves every token count"
    assert pass_entry(dirs[0], "quant_cache_store")["matched"] == 1


def per_column_scale_store(k, slots, cache):
    """amax without keepdim: with 128 tokens the [T] scale broadcasts over columns. Must not fire."""
    x = k.float()
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(-1).clamp(min=1e-4) / 448.0)))
    k_fp8 = torch.clamp(x / scale, -448.0, 448.0).to(torch.float8_e4m3fn)
    LAYOUTS["paged"].store(cache, slots, k_fp8, scale)


def assert_store_rewritten(fn, k, slots, cache):
    """``fn`` compiled (static shapes) has its store rewritten and writes eager's bytes."""
    compiled_fn, dump_dir = compile_with_dumps(fn, {"nsa.layout": "paged", "nsa.page_size": 16}, dynamic=False)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    fn(k, slots, eager_cache)
    compiled_fn(k, slots, compiled_cache)
    assert torch.equal(eager_cache, compiled_cache)
    assert pass_entry(graph_dirs(dump_dir)[0], "quant_cache_store")["matched"] == 1


def assert_store_kept(fn, k, slots, cache, reason, dynamic=None, view=lambda c: c):
    """``fn`` compiled keeps Inductor's store, with ``reason`` in the pass's near miss, and writes eager's bytes
    (``view``: the cache ``fn`` gets, a view of ``cache``)."""
    compiled_fn, dump_dir = compile_with_dumps(fn, {"nsa.layout": "paged", "nsa.page_size": 16}, dynamic=dynamic)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    fn(k, slots, view(eager_cache))
    compiled_fn(k, slots, view(compiled_cache))
    assert torch.equal(eager_cache, compiled_cache)
    entry = pass_entry(graph_dirs(dump_dir)[0], "quant_cache_store")
    assert entry["matched"] == 0
    assert reason in entry["near_misses"][0]["reason"], entry["near_misses"]


def test_a_scale_that_is_not_one_per_row_does_not_fire():
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(128, 128, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(160, generator=gen)[:128]
    cache = torch.randint(0, 256, (LAYOUTS["paged"].num_pages(160), LAYOUTS["paged"].page_bytes), dtype=torch.uint8,
                          generator=gen)
    assert_store_kept(per_column_scale_store, k, slots, cache, "scale is not one per block")


def one_row_for_every_slot_store(k, slots, cache):
    """The first token's quantised row broadcast into every token's slot: written values of one row, not one a
    token. Must not fire (the op would read a row per slot)."""
    page_view_store(16)(k[:1], slots, cache)


def test_one_row_broadcast_to_every_slot_does_not_fire():
    assert_store_kept(one_row_for_every_slot_store, *inputs("page-views-paged", 6, 3, padding=False),
                      "not one row of bytes per token", dynamic=False)


def test_float64_rows_do_not_fire():
    """act_quant of fp64 K rows (its amax and division in fp64): not a dtype the op quantizes."""
    assert_store_kept(reference_store(LAYOUTS["paged"]), *inputs("paged", 6, 4, dtype=torch.float64),
                      "torch.float64", dynamic=False)


def test_a_cache_past_the_start_of_its_storage_does_not_fire():
    """The cache a view from the second page of a buffer (storage offset != 0): the op takes a cache from the start
    of its storage."""
    k, slots, cache = inputs("paged", 6, 5)
    assert_store_kept(reference_store(LAYOUTS["paged"]), k, slots, torch.cat([torch.zeros_like(cache[:1]), cache]),
                      "not contiguous", dynamic=False, view=lambda c: c[1:])


def moved_window_store(k, slots, cache):
    """A store into the first half of the cache's pages, written back over the second half: not a store in place."""
    layout, half = LAYOUTS["paged"], cache.shape[0] // 2
    k_fp8, k_scale = act_quant(k)
    flat = cache[:half].reshape(-1).index_put((layout.value_offsets(slots),), k_fp8.view(torch.uint8))
    flat = flat.index_put((layout.scale_offsets(slots),), k_scale.view(torch.uint8).view(-1, 4))
    cache[half:] = flat.view(half, -1)


def test_a_window_written_back_elsewhere_does_not_fire():
    k, slots, cache = inputs("paged", 6, 7, padding=False)
    assert_store_kept(moved_window_store, k, slots % (NUM_SLOTS // 2), cache, "written back at another place",
                      dynamic=False)


def spelled_quant(x, exponent=torch.ceil, floor=lambda a: a.clamp(min=1e-4),
                  reduce=lambda a: a.amax(-1, keepdim=True), magnitude=torch.abs, to_scale=lambda a: a / 448.0,
                  low=-448.0, power_of_two=True, log=torch.log2, power=torch.exp2, apply=torch.div):
    """act_quant written out, each step replaceable by one that quantises differently."""
    x = x.float()
    scale = to_scale(floor(reduce(magnitude(x))))
    if power_of_two:
        scale = power(exponent(log(scale)))
    return torch.clamp(apply(x, scale), low, 448.0).to(torch.float8_e4m3fn), scale.squeeze(-1)


def spelled_store(**changed):
    """The store of ``spelled_quant`` with ``changed`` steps."""
    def store(k, slots, cache):
        LAYOUTS["paged"].store(cache, slots, *spelled_quant(k, **changed))

    return store


def by_the_reciprocal(amax):
    """``amax * (1 / 448)``: for an fp32 scale one rounding from the op's ``amax / 448`` (about half of all amax
    values), for a power-of-two scale the same bytes."""
    return amax * (1.0 / 448.0)


def test_an_fp32_scale_multiplied_by_the_reciprocal_does_not_fire():
    k, slots, cache = inputs("paged", 64, 8)
    assert_store_kept(spelled_store(to_scale=by_the_reciprocal, power_of_two=False), k, slots, cache,
                      "multiplies by 1 / 448.0", dynamic=False)


def test_a_power_of_two_scale_from_the_reciprocal_fires_with_eager_bytes():
    assert_store_rewritten(spelled_store(to_scale=by_the_reciprocal, power=lambda e: torch.pow(2.0, e)),
                           *inputs("paged", 64, 8))


OTHER_QUANTS = {  # name: (the step changed, the near miss)
    "floor_exponent": (dict(exponent=torch.floor), "2^ceil(log2"),
    "rounded_exponent": (dict(exponent=torch.round), "2^ceil(log2"),
    "other_divisor": (dict(to_scale=lambda a: a / 240.0), "divides by 240"),
    "other_floor": (dict(floor=lambda a: a.clamp(min=1e-6)), "floored at"),
    "floor_added": (dict(floor=lambda a: a + 1e-4, power_of_two=False), "floored at"),
    "sum_not_amax": (dict(reduce=lambda a: a.sum(-1, keepdim=True)), "amax(|x|)"),
    "amax_of_the_negation": (dict(magnitude=torch.neg), "amax(|x|)"),
    "asymmetric_clamp": (dict(low=-224.0), "values clamped to"),
    "log10_exponent": (dict(log=torch.log10), "2^ceil(log2"),
    "powers_of_four": (dict(power=lambda e: torch.pow(4.0, e)), "the scale is not amax / fp8 max"),
    "values_times_the_scale": (dict(apply=torch.mul), "the values are not x / scale"),
}


def quant_inputs():
    k, slots, cache = inputs("paged", 64, 0, padding=False)
    k[3], k[4] = 0, k[4] * 1e-5  # a zero row and a tiny one: the amax floor decides their scales
    return k, slots, cache


def test_the_quantisation_spelled_out_fires_with_eager_bytes():
    assert_store_rewritten(spelled_store(), *quant_inputs())


@pytest.mark.parametrize("name", sorted(OTHER_QUANTS))
def test_quantisations_spelled_otherwise_do_not_fire(name):
    changed, reason = OTHER_QUANTS[name]
    assert_store_kept(spelled_store(**changed), *quant_inputs(), reason, dynamic=False)


def rotated_store(y, slots, cache, dtype=torch.bfloat16):
    """``rotate_activation``'s epilogue in front of act_quant: the op takes ``y`` and scales and rounds it itself."""
    reference_store(LAYOUTS["paged"])((y * 128**-0.5).to(dtype), slots, cache)


def rotated_store_fp16(y, slots, cache):
    rotated_store(y, slots, cache, torch.float16)


def rotated_store_returning_k(y, slots, cache):
    """The rounded K is also an output: it is computed anyway, so the op takes it as it is."""
    k = (y * 128**-0.5).to(torch.bfloat16)
    reference_store(LAYOUTS["paged"])(k, slots, cache)
    return k


def rotated_store_of_bf16(y, slots, cache):
    """``y`` in bf16: the product is rounded to bf16 before the fp16 cast, so the op cannot take ``y`` and scale it
    itself in fp32."""
    reference_store(LAYOUTS["paged"])((y.bfloat16() * 128**-0.5).to(torch.float16), slots, cache)


def shifted_store(y, slots, cache):
    """``y + 0.5``: not a scale the op can take."""
    reference_store(LAYOUTS["paged"])((y + 0.5).to(torch.bfloat16), slots, cache)


@pytest.mark.parametrize("fn, input_dtype", [(rotated_store, "torch.bfloat16"), (rotated_store_fp16, "torch.float16"),
                                             (rotated_store_returning_k, None), (rotated_store_of_bf16, None),
                                             (shifted_store, None)])
def test_the_rotation_epilogue_moves_into_the_op(fn, input_dtype):
    gen = torch.Generator().manual_seed(11)
    y = torch.randn(12, 128, generator=gen) * torch.rand(12, 1, generator=gen) * 40
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:12]
    slots[::5] = -1
    layout = LAYOUTS["paged"]
    cache = torch.randint(0, 256, (layout.num_pages(NUM_SLOTS), layout.page_bytes), dtype=torch.uint8, generator=gen)
    compiled_fn, dump_dir = compile_with_dumps(fn, {"nsa.layout": "paged", "nsa.page_size": 16}, dynamic=False)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    eager_out, out = fn(y, slots, eager_cache), compiled_fn(y, slots, compiled_cache)
    assert torch.equal(eager_cache, compiled_cache)
    assert eager_out is None and out is None or torch.equal(eager_out, out)
    _, after = pass_graphs(graph_dirs(dump_dir)[0], "quant_cache_store")
    (store,) = [line for line in after.splitlines() if "nsa.quant_cache_store" in line]
    if input_dtype:
        assert f"input_scale = 0.08838834764831845, input_dtype = {input_dtype}" in store
        assert count_ops(after, "aten.mul") == 0 and count_ops(after, "prims.convert_element_type") == 0
    else:
        assert "input_scale" not in store and count_ops(after, "aten.mul") + count_ops(after, "aten.add") == 1


# ---------------------------------------------------------------------------------------------------------------
# size 1: Dynamo specialises one token (decode B=1, prefill T=1), so the graph spells the rows squeezed
# ---------------------------------------------------------------------------------------------------------------


def page_parts(cache):
    """The 16-token pages' value bytes ``[pages, 16, 128]`` and fp32 scales ``[pages, 16]``, as views of ``cache``."""
    pages = cache.view(-1, 16 * 132)
    return pages[:, : 16 * 128].unflatten(1, (16, 128)), pages[:, 16 * 128 :].view(torch.float32)


def scalar_slot_store(k, slot, cache):
    """One token through a 0-d slot mapping and a squeezed row: ``values.index_put_((page, pos), k_fp8[0])``."""
    k_fp8, k_scale = act_quant(k)
    values, scales = page_parts(cache)
    values.index_put_((slot // 16, slot % 16), k_fp8[0].view(torch.uint8))
    scales.index_put_((slot // 16, slot % 16), k_scale[0, 0])


def expanded_row_store(k, slots, cache):
    """The row unsqueezed and expanded to the index shape: ``values[page, pos] = k_fp8.view(u8).unsqueeze(1)...``."""
    k_fp8, k_scale = act_quant(k)
    values, scales = page_parts(cache)
    page, pos = slots // 16, slots % 16
    values[page[:, None], pos[:, None]] = k_fp8.view(torch.uint8).unsqueeze(1).expand(-1, 1, 128)
    scales[page, pos] = k_scale.squeeze(-1)


def broadcast_row_store(k, slots, cache):
    """Near miss: the first token's row written at every slot (broadcast), not each token's own row."""
    k_fp8, k_scale = act_quant(k)
    values, scales = page_parts(cache)
    page, pos = slots // 16, slots % 16
    values[page, pos] = k_fp8[:1].view(torch.uint8)
    scales[page, pos] = k_scale[:1, 0]


def byte_broadcast_store(k, slots, cache):
    """Near miss at one token: one byte of the quantized row broadcast over the 128 value bytes."""
    k_fp8, k_scale = act_quant(k)
    values, scales = page_parts(cache)
    page, pos = slots // 16, slots % 16
    values[page, pos] = k_fp8.view(torch.uint8)[:, :1]
    scales[page, pos] = k_scale.squeeze(-1)


def unsqueezed_index_store(k, slots, cache):
    """Fires: a [T, 1] index built from the 1-D slot mapping still writes one slot per token."""
    k_fp8, k_scale = act_quant(k)
    values, scales = page_parts(cache)
    slots2d = slots[:, None]
    values[slots2d // 16, slots2d % 16] = k_fp8.view(torch.uint8)[:, None]
    scales[slots2d // 16, slots2d % 16] = k_scale


def two_d_slot_store(k, slots2d, cache):
    """Near miss: the slot mapping input is 2-D ([T, 1]), not one slot per token in a 1-D mapping."""
    unsqueezed_index_store(k, slots2d.squeeze(1), cache)


SIZE_ONE = {
    # name: (store function, layout name, token count, expected near-miss reason, or None: fires)
    "reference-flat": (reference_store(LAYOUTS["flat"]), "flat", 1, None),
    "reference-paged": (reference_store(LAYOUTS["paged"]), "paged", 1, None),
    "page-views": (page_view_store(16), "paged", 1, None),
    "scalar-slot": (scalar_slot_store, "paged", 1, None),
    "expanded-row": (expanded_row_store, "paged", 1, None),
    "expanded-row-3-tokens": (expanded_row_store, "paged", 3, None),
    "near-miss-broadcast-row": (broadcast_row_store, "paged", 2, "not one row of bytes per token"),
    "near-miss-byte-broadcast": (byte_broadcast_store, "paged", 1, "not one row of bytes per token"),
    "unsqueezed-index": (unsqueezed_index_store, "paged", 2, None),
    "near-miss-2d-slots": (two_d_slot_store, "paged", 2, "one slot per token"),
}


@pytest.mark.parametrize("name", sorted(SIZE_ONE))
def test_one_token_spellings(name):
    """Each spelling compiled at its own (static) token count: fires with no cache copy, or a near miss naming the
    cache with Inductor's copies counted."""
    fn, layout_name, num_tokens, reason = SIZE_ONE[name]
    layout = LAYOUTS[layout_name]
    gen = torch.Generator().manual_seed(7)
    k = (torch.randn(num_tokens, 128, generator=gen) * 10).to(torch.bfloat16)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:num_tokens]
    cache = torch.randint(0, 256, (layout.num_pages(NUM_SLOTS), layout.page_bytes), dtype=torch.uint8, generator=gen)
    if fn is two_d_slot_store:
        slots = slots[:, None]
    if fn is scalar_slot_store:
        slots = slots[0]
    compiled_fn, dump_dir = compile_with_dumps(fn, {"nsa.layout": layout_name, "nsa.page_size": layout.page_size},
                                               dynamic=False)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    fn(k, slots, eager_cache)
    compiled_fn(k, slots, compiled_cache)
    assert torch.equal(eager_cache, compiled_cache)
    (graph_dir,) = graph_dirs(dump_dir)
    entry, report = pass_entry(graph_dir, "quant_cache_store"), read_report(graph_dir)
    if reason is None:
        assert entry["matched"] == 1, entry["near_misses"]
        assert report["cache_copies"] == 0, report["cache_copy_sites"]
    else:
        (miss,) = entry["near_misses"]
        assert entry["matched"] == 0 and reason in miss["reason"] and miss["reason"].startswith("cache arg")
        assert report["cache_copies"] > 0
