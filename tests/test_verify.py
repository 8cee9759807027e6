"""``nsa.verify``: a compiled step that agrees with the unrewritten graph runs unchanged; a deliberately wrong rewrite,
registered beside the real passes, raises VerifyError naming it and the first differing elements; the comparison
rules (docs/numerics.md) on their own."""

import pathlib
import tempfile

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import nsa_inductor
import nsa_inductor.pass_manager
from nsa_inductor import verify
from nsa_inductor.cache_difference import error_outside_moved_keys, k_cache_difference, logits_rtol
from nsa_inductor.capability import LayoutDecision
from nsa_inductor.indexer import Indexer
from nsa_inductor.layout import KCacheLayout
from nsa_inductor.quant import act_quant
from nsa_inductor.patterns import GraphPass, PassResult
from nsa_inductor.workload import decode_batch, prefill_batch
from helpers.models import CACHE_SLOTS, CONFIGS, LAYOUTS

aten = torch.ops.aten
LAYOUT = LAYOUTS["paged"]


class ScaleLogits(GraphPass):
    """Wrong on purpose: a logits op's output (the paged one by default) times ``factor``."""

    name = "wrong_scale_logits"

    def __init__(self, factor=1.01, op=torch.ops.nsa.paged_mqa_logits.default):
        self.factor, self.op = factor, op

    def __call__(self, graph, ctx=None):
        result = PassResult()
        for node in list(graph.find_nodes(op="call_function", target=self.op)):
            with graph.inserting_after(node):
                scaled = graph.call_function(aten.mul.Tensor, (node, self.factor))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
            scaled.meta["val"] = node.meta["val"]
            result.matched += 1
        return result


class FlipCacheBits(GraphPass):
    """Wrong on purpose: every byte copied back into the K cache has its low bit flipped (writes outside the slots)."""

    name = "wrong_cache_write"

    def __call__(self, graph, ctx=None):
        result = PassResult()
        for node in list(graph.find_nodes(op="call_function", target=aten.copy_.default)):
            dst, src = node.args[:2]
            if dst.op == "placeholder" and dst.meta["val"].dtype == torch.uint8:
                with graph.inserting_before(node):
                    flipped = graph.call_function(aten.bitwise_xor.Scalar, (src, 1))
                flipped.meta["val"] = src.meta["val"]
                node.args = (dst, flipped, *node.args[2:])
                result.matched += 1
        return result


class NudgeStoredK(GraphPass):
    """Within the contract on purpose: the K store's input times ``1 + factor * sign``, so that some K values land an
    fp8 step away, as another summation order moves them (a pass that may change cache bytes)."""

    name = "nudged_k_store"
    may_change_cache_bytes = True

    def __init__(self, factor=2e-3):
        self.factor = factor

    def __call__(self, graph, ctx=None):
        result = PassResult()
        for node in list(graph.find_nodes(op="call_function", target=torch.ops.higher_order.auto_functionalized)):
            if node.args[0] is torch.ops.nsa.quant_cache_store.default:
                k = node.kwargs["k"]
                with graph.inserting_before(node):
                    size = graph.call_function(aten.abs.default, (k,))
                    step = graph.call_function(aten.mul.Tensor, (size, self.factor))
                    nudged = graph.call_function(aten.add.Tensor, (k, step))
                for new in (size, step, nudged):
                    new.meta["val"] = k.meta["val"]
                node.kwargs = {**node.kwargs, "k": nudged}
                result.matched += 1
        return result


class OneFarColumn(GraphPass):
    """Wrong on purpose: each row's first top-k entry replaced by the row's smallest logit's column (one of k), less
    the row's offset where the op has one (a prefill's output is column minus the sequence's first token)."""

    name = "wrong_topk_column"

    def __call__(self, graph, ctx=None):
        result = PassResult()
        for node in list(graph.find_nodes(op="call_function", target=torch.ops.nsa.topk_indices.default)):
            logits, offset = node.args[0], node.args[3]
            with graph.inserting_before(node.next):
                smallest = graph.call_function(aten.argmin.default, (logits, -1, True))
                shifted = smallest if offset is None else graph.call_function(
                    aten.sub.Tensor, (smallest, graph.call_function(aten.unsqueeze.default, (offset, 1))))
                column = graph.call_function(torch.ops.prims.convert_element_type.default, (shifted, torch.int32))
                wrong = graph.call_function(aten.slice_scatter.default, (node, column, 1, 0, 1))
            node.replace_all_uses_with(wrong, delete_user_cb=lambda user: user is not wrong)
            with node.meta["val"].fake_mode:
                smallest.meta["val"] = aten.argmin.default(logits.meta["val"], -1, True)
                if offset is not None:
                    shifted.args[1].meta["val"] = offset.meta["val"][:, None]
                    shifted.meta["val"] = smallest.meta["val"] - shifted.args[1].meta["val"]
                column.meta["val"] = shifted.meta["val"].to(torch.int32)
                wrong.meta["val"] = node.meta["val"].clone()
            result.matched += 1
        return result


REAL_PASSES = nsa_inductor.pass_manager.passes_for


def compiled_step(monkeypatch, *extra_passes, verify_calls=True, entry="decode", config="deepseek_v32",
                  layout="paged"):
    """A small reference indexer's ``entry`` under nsa.verify, with ``extra_passes`` appended to the real passes."""
    if extra_passes:
        monkeypatch.setattr(nsa_inductor.pass_manager, "passes_for",
                            lambda options: [*REAL_PASSES(options), *extra_passes])
    torch._dynamo.reset()
    model = Indexer(CONFIGS[config], LAYOUTS[layout])
    model.reset_parameters(torch.Generator().manual_seed(0))
    dump_dir = tempfile.mkdtemp(prefix="nsa-verify-")
    options = {"nsa.layout": layout, "nsa.page_size": LAYOUTS[layout].page_size, "nsa.dump_dir": dump_dir,
               "nsa.verify": verify_calls, "fx_graph_cache": False}
    return model, torch.compile(getattr(model, entry), backend="nsa_rocm", dynamic=False, options=options), \
        pathlib.Path(dump_dir)


def relative_error(actual, expected):
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def batch(seed=1):
    return decode_batch(CONFIGS["deepseek_v32"], LAYOUT, [5, 33, 17], max_len=48, seed=seed,
                        cache_pages=CACHE_SLOTS // LAYOUT.page_size)


def test_agreeing_step_runs_and_returns_the_compiled_result(monkeypatch):
    """Logits 1e-4 off (within 1e-3): verify returns, and what it returns is the compiled graph's result."""
    model, step, _ = compiled_step(monkeypatch, ScaleLogits(1 + 1e-4))
    b = batch()
    eager = b.clone()
    with torch.no_grad():
        logits, topk = step(*b.args)
        e_logits, e_topk = model.decode(*eager.args)
    assert torch.equal(b.kv_cache, eager.kv_cache)  # the real cache was written once, by the compiled graph
    assert torch.equal(logits.isneginf(), e_logits.isneginf())
    finite = ~e_logits.isneginf()
    assert relative_error(logits[finite], (1 + 1e-4) * e_logits[finite]) < 3e-5 < 7e-5 < \
        relative_error(logits[finite], e_logits[finite])
    assert [set(r) for r in topk.tolist()] == [set(r) for r in e_topk.tolist()]
    report = nsa_inductor.last_reports()[-1]
    assert {p["name"]: p["matched"] for p in report["passes"]}["paged_mqa_logits"] == 1


@pytest.mark.parametrize("entry", ["decode", "prefill"])
def test_an_empty_batch_is_verified(monkeypatch, entry):
    """An idle data-parallel rank's step (no token): its compiled graph (the store removed, no logits kernel) runs
    under verify and returns eager's empty outputs, the cache untouched."""
    model, step, _ = compiled_step(monkeypatch, entry=entry)
    pages = CACHE_SLOTS // LAYOUT.page_size
    b = decode_batch(CONFIGS["deepseek_v32"], LAYOUT, [], max_len=48, cache_pages=pages) if entry == "decode" else \
        prefill_batch(CONFIGS["deepseek_v32"], LAYOUT, [], cache_pages=pages)
    before = b.kv_cache.clone()
    with torch.no_grad():
        logits, topk = step(*b.args)
        e_logits, e_topk = getattr(model, entry)(*b.clone().args)
    assert torch.equal(b.kv_cache, before)
    assert (logits.shape, topk.shape, topk.dtype) == (e_logits.shape, e_topk.shape, e_topk.dtype)
    assert {p["name"]: p["matched"] for p in nsa_inductor.last_reports()[-1]["passes"]}["quant_cache_store"] == 1


def test_a_step_of_two_tokens_may_move_one_tokens_values(monkeypatch):
    """Seven of the 258 bytes the step changes differ from eager's (2.7 %: one token's values a step apart,
    wk_gate_gemm's summation order): decoded, within the bound (docs/numerics.md), so verify returns."""
    model, step, _ = compiled_step(monkeypatch)
    b = decode_batch(CONFIGS["deepseek_v32"], LAYOUT, [21, 24], max_len=48, seed=1425,
                     cache_pages=CACHE_SLOTS // LAYOUT.page_size)
    eager = b.clone()
    with torch.no_grad():
        step(*b.args)
        model.decode(*eager.args)
    assert int((b.kv_cache != eager.kv_cache).sum()) == 7


def test_a_prefill_of_18_tokens_may_move_one_keys_logits(monkeypatch):
    """One of the 18 tokens has 7 values a step from eager's (wk_gate_gemm's summation order), which moves its
    key's logits: 3.6e-3 norm-wise over the step's small logits matrix, past 1e-3 but within the allowance for moved
    keys (docs/numerics.md), and all of it in that key's column."""
    model, step, _ = compiled_step(monkeypatch, entry="prefill", config="glm5", layout="flat")
    b = prefill_batch(CONFIGS["glm5"], LAYOUTS["flat"], [8, 10], seed=92)
    eager = b.clone()
    with torch.no_grad():
        logits, _ = step(*b.args)
        e_logits, _ = model.prefill(*eager.args)
    finite = ~e_logits.isneginf()
    error = (logits[finite].double() - e_logits[finite].double()).norm() / e_logits[finite].double().norm()
    assert 3e-3 < error < 4e-3
    assert error_outside_moved_keys(e_logits, logits, 1) < 1e-5


def test_logits_off_where_a_key_moved_are_named(monkeypatch):
    """The same prefill with its logits 0.5 % off everywhere: within the norm-wise allowance for one moved key of 18
    (1e-2), but the step reads its keys back from the cache, so verify compares it with the unrewritten graph reading
    the compiled step's K, at 1e-3."""
    _, step, _ = compiled_step(monkeypatch, ScaleLogits(1.005, torch.ops.nsa.mqa_logits.default), entry="prefill",
                               config="glm5", layout="flat")
    with pytest.raises(verify.VerifyError, match=r"differs from the unrewritten graph reading the compiled step's K "
                                                 r"cache: output 0: relative error 5.00e-03 .*wrong_scale_logits x1"), \
            torch.no_grad():
        step(*prefill_batch(CONFIGS["glm5"], LAYOUTS["flat"], [8, 10], seed=92).args)


def test_a_one_token_prefill_whose_key_moved_is_compared_on_its_own_k(monkeypatch):
    """A one-token prefill has a single logit, a sum over heads that may nearly cancel: its key's K moved within the
    bound moves it by 15 % here, past the norm-wise allowance for moved keys (docs/numerics.md). Read from the
    compiled step's own K it agrees, so verify returns; the same step with its logits 1 % off raises."""
    config, layout = CONFIGS["deepseek_v32"], LAYOUT
    model, step, _ = compiled_step(monkeypatch, NudgeStoredK(), entry="prefill")
    b = prefill_batch(config, layout, [1], seed=7, cache_pages=CACHE_SLOTS // layout.page_size)
    eager = b.clone()
    with torch.no_grad():
        logits, _ = step(*b.args)
        e_logits, _ = model.prefill(*eager.args)
    moved = k_cache_difference(layout, eager.kv_cache, b.kv_cache, slots=b.slot_mapping)
    assert moved["tokens_moved"] == 1
    assert float((logits - e_logits).abs() / e_logits.abs()) > logits_rtol(verify.LOGITS_RTOL, moved)
    _, wrong, _ = compiled_step(monkeypatch, NudgeStoredK(), ScaleLogits(1.01, torch.ops.nsa.mqa_logits.default),
                                entry="prefill")
    with pytest.raises(verify.VerifyError, match=r"reading the compiled step's K cache: output 0: relative error "
                                                 r"\S+ over the finite entries \(allowed 0.001\)"), torch.no_grad():
        wrong(*b.clone().args)


def test_wrong_logits_rewrite_is_named(monkeypatch):
    _, step, _ = compiled_step(monkeypatch, ScaleLogits())
    with pytest.raises(verify.VerifyError) as err, torch.no_grad():
        step(*batch().args)
    message = str(err.value)
    assert "output 0: relative error 1.00e-02" in message
    assert "wrong_scale_logits x1" in message and "paged_mqa_logits x1" in message


def test_write_outside_the_slots_is_named(monkeypatch):
    _, step, _ = compiled_step(monkeypatch, FlipCacheBits())
    expected = (r"input \w*kv_cache\w* changed \d+ slot\(s\) of layout paged\(page_size=16\) the unrewritten graph left "
                r"unchanged.*wrong_cache_write x1")
    with pytest.raises(verify.VerifyError, match=expected), torch.no_grad():
        step(*batch().args)


def test_one_far_top_k_column_is_named(monkeypatch):
    """One entry of k in every row replaced by a column far below the k-th value: within the 1 % that set
    comparison alone would allow, but not a near tie of the logits ``topk`` read."""
    _, step, _ = compiled_step(monkeypatch, OneFarColumn())
    with pytest.raises(verify.VerifyError, match=r"output 1: row \d+ has column\(s\) \[\d+\] .* not near ties of "
                                                 r"the k-th value .*wrong_topk_column x1"), torch.no_grad():
        step(*batch().args)


def test_one_far_top_k_column_in_a_prefill_is_named(monkeypatch):
    """The same wrong entry in a prefill, whose top-k output is column minus the sequence's first token: verify
    adds each row's offset back (read from the reference run) and finds the column far below the k-th value, where
    set comparison alone would allow one entry of a row to differ."""
    _, step, _ = compiled_step(monkeypatch, OneFarColumn(), entry="prefill")
    b = prefill_batch(CONFIGS["deepseek_v32"], LAYOUT, [5, 40], seed=3, cache_pages=CACHE_SLOTS // LAYOUT.page_size)
    with pytest.raises(verify.VerifyError, match=r"output 1: row \d+ has column\(s\) \[\d+\] .* not near ties of "
                                                 r"the k-th value .*wrong_topk_column x1"), torch.no_grad():
        step(*b.args)


def test_only_the_first_calls_are_verified(monkeypatch):
    """``nsa.verify: 2``: the first two calls of a wrong graph raise, the third returns its (wrong) result."""
    model, step, _ = compiled_step(monkeypatch, ScaleLogits(), verify_calls=2)
    with torch.no_grad():
        for _ in range(2):
            with pytest.raises(verify.VerifyError, match="wrong_scale_logits x1"):
                step(*batch().args)
        logits, _ = step(*batch().args)
        e_logits, _ = model.decode(*batch().args)
    finite = ~e_logits.isneginf()
    assert relative_error(logits[finite], 1.01 * e_logits[finite]) < 1e-4


# ---------------------------------------------------------------------------------------------------------------
# the comparison rules
# ---------------------------------------------------------------------------------------------------------------


def test_float_rules():
    want = torch.tensor([[1.0, float("-inf"), 3.0], [float("nan"), 2.0, 5.0]])
    assert verify._compare_float("x", want, want * (1 + 5e-4)) == []
    assert "relative error" in verify._compare_float("x", want, want * 1.01)[0]
    moved = want.clone()
    moved[0, 1] = -1e30
    assert "-inf positions differ, first at [0, 1]" in verify._compare_float("x", want, moved)[0]
    no_nan = want.nan_to_num(0.0)
    assert "NaN positions differ, first at [1, 0]" in verify._compare_float("x", want, no_nan)[0]


def test_logits_error_outside_the_moved_keys():
    """Where K moved in m keys, the logits ``topk`` reads keep 1e-3 outside the m columns where the error is largest:
    one key's column 2 % off passes, the same error spread over every column does not."""
    want = torch.arange(1.0, 41.0).view(4, 10)
    want[0, 9] = float("-inf")
    one_key = want.clone()
    one_key[:, 3] *= 1.02
    finite = want.isfinite()
    spread = want * (1 + (one_key - want)[finite].norm() / want[finite].norm())  # the same error, every column
    assert verify._compare_outside_moved_keys("x", want, one_key, 1) == []
    left_out = torch.arange(10) == 9  # spread's largest error: the column of the largest finite norm
    outside = (spread - want)[finite & ~left_out].norm() / want[finite].norm()
    assert f"relative error {outside:.2e} outside the 1 key column(s)" in \
        verify._compare_outside_moved_keys("x", want, spread, 1)[0]
    assert verify._compare_outside_moved_keys("x", want, spread, 0) == []  # no key moved: the float rule alone


def test_uint8_rules():
    """A uint8 input that is not a K cache of the compile's layout (or any, where no pass reorders sums): bytes."""
    old = torch.zeros(4, 300, dtype=torch.uint8)
    want = old.clone()
    want[1] = torch.arange(300).to(torch.uint8)  # the reference wrote row 1 (298 bytes: two stay 0)
    near = want.clone()
    near[1, 7] += 1
    assert "differs in 1 of the 298 bytes written, first at [1, 7]: 8, expected 7" in \
        verify._compare_input("c", old, want, near)[0]
    outside = want.clone()
    outside[3, 0] = 9
    message = verify._compare_input("c", old, want, outside)[0]
    assert "changed at 1 element(s) the unrewritten graph left unchanged, first at [3, 0]: 0 -> 9" in message
    assert verify._cache_layout(old, LAYOUT_DECISION) is None  # 300-byte rows: not whole tokens
    assert verify._cache_layout(torch.zeros(4, 264, dtype=torch.uint8), LAYOUT_DECISION) == KCacheLayout(2)


LAYOUT_DECISION = LayoutDecision(KCacheLayout(16), "test")
CACHE_LAYOUT = KCacheLayout(16)
WRITTEN = torch.tensor([3, 17, 20, 40, 41, 63])  # slots of 4 pages of 16


def cache_step():
    """(old, want): a cache of random bytes and the same with eager's K written at ``WRITTEN``."""
    gen = torch.Generator().manual_seed(5)
    old = CACHE_LAYOUT.allocate(64).random_(0, 256, generator=gen)
    k = torch.randn(len(WRITTEN), 128, generator=gen) * 3
    k[:, 0] = 1e-3  # a value near zero in every token
    want = old.clone()
    CACHE_LAYOUT.store(want, WRITTEN, *(t.squeeze(-1) for t in act_quant(k, 128)))
    return old, want


def stored(cache, slot, values=None, scale=None):
    """``cache`` with slot ``slot``'s fp8 values and/or scale replaced."""
    cache = cache.clone()
    old_values, old_scale = CACHE_LAYOUT.load(cache, torch.tensor([slot]), torch.float8_e4m3fn)
    CACHE_LAYOUT.store(cache, torch.tensor([slot]), old_values if values is None else values[None],
                       old_scale if scale is None else torch.tensor([scale]))
    return cache


def fp8_steps(values, steps):
    """fp8 values moved ``steps`` places along the grid (away from zero for positive steps)."""
    bits = values.view(torch.uint8).int()
    return (bits + steps).to(torch.uint8).view(torch.float8_e4m3fn)


def decoded(old, want, new):
    return verify._compare_cache("input kv", CACHE_LAYOUT, torch.float8_e4m3fn, old, want, new)[0]


def test_cache_decoded_rules():
    old, want = cache_step()
    values, _ = CACHE_LAYOUT.load(want, WRITTEN, torch.float8_e4m3fn)
    assert decoded(old, want, want) == []
    big = values[1].float().abs().argmax()
    one_step = values[1].clone()
    one_step[big] = fp8_steps(one_step[big:big + 1], 1)[0]
    assert decoded(old, want, stored(want, 17, one_step)) == []
    three = values[1].clone()
    three[big] = fp8_steps(three[big:big + 1], 3)[0]
    assert "a value of slot 17 is 1.5 times its bound away" in decoded(old, want, stored(want, 17, three))[0]
    near_zero = int(values[2].float().abs().argmin())
    assert values[2, near_zero].float().abs() < 0.1  # in units of the scale
    for moved_to, within in ((0.875, True), (-1.25, False)):  # up to 1 scale unit away where the steps are smaller
        moved = values[2].clone()
        moved[near_zero] = moved_to
        assert (decoded(old, want, stored(want, 20, moved)) == []) == within
    many = want
    for t, slot in enumerate(WRITTEN.tolist()[:3]):  # 3 x 22 = 66 values a step away: over 64 (1 % of 768 is 7)
        moved = values[t].clone()
        moved[:22] = fp8_steps(moved[:22], 1)
        many = stored(many, slot, moved)
    assert "66 of 768 fp8 values differ (allowed 64)" in decoded(old, want, many)[0]


def test_cache_scales_are_decoded():
    """A scale one power of two off changes one or two bytes: decoded, its values are twice eager's. The same token
    quantized to the next scale, its values halved onto that grid, is the same numbers: one such token passes."""
    old, want = cache_step()
    values, scales = CACHE_LAYOUT.load(want, WRITTEN, torch.float8_e4m3fn)
    wrong_scale = stored(want, 40, scale=float(scales[3]) * 2)
    assert int((wrong_scale != want).sum()) <= 2
    assert "a value of slot 40 is " in decoded(old, want, wrong_scale)[0]
    coarser = (values[3].float() / 2).to(torch.float8_e4m3fn)
    requantized = stored(want, 40, coarser, float(scales[3]) * 2)
    assert decoded(old, want, requantized) == []
    two_tokens = stored(requantized, 63, (values[5].float() / 2).to(torch.float8_e4m3fn), float(scales[5]) * 2)
    assert "2 of 6 tokens have another scale (allowed 1)" in decoded(old, want, two_tokens)[0]
    nan_scale = stored(want, 3, scale=float("nan"))
    assert "a value of slot 3 is inf times its bound away" in decoded(old, want, nan_scale)[0]


def test_cache_difference_skips_slots_a_store_skips():
    """A step's slot mapping with padding (-1) and a slot past the cache (the store writes neither): compared at the
    slots it wrote, not read outside the cache (an index error on the CPU, a device-side assert on a GPU)."""
    old, want = cache_step()
    values, _ = CACHE_LAYOUT.load(want, WRITTEN, torch.float8_e4m3fn)
    moved = values[1].clone()
    moved[0] = fp8_steps(moved[:1], 1)[0]
    slots = torch.cat([WRITTEN, torch.tensor([-1, 64, 10**6])])
    diff = k_cache_difference(CACHE_LAYOUT, want, stored(want, 17, moved), slots=slots)
    assert (diff["tokens_compared"], diff["tokens_moved"], diff["values_differing"]) == (len(WRITTEN), 1, 1)


def test_cache_writes_outside_the_reference_slots():
    old, want = cache_step()
    outside = want.clone()
    outside[2, 5] ^= 1  # page 2, the value bytes of its slot 0: slot 32
    assert decoded(old, want, outside) == ["input kv changed 1 slot(s) of layout paged(page_size=16) the "
                                           "unrewritten graph left unchanged, first slot 32"]


def test_fp8_format_is_the_graphs():
    from torch.fx.experimental.proxy_tensor import make_fx

    fnuz = make_fx(lambda x: x.to(torch.float8_e4m3fnuz).float())(torch.ones(4))
    assert verify._fp8_dtype(fnuz) == torch.float8_e4m3fnuz
    no_fp8 = make_fx(lambda x: x * 2)(torch.ones(4))
    assert verify._fp8_dtype(no_fp8) == nsa_inductor.capability.capability().fp8_dtype


def test_topk_rules():
    want = torch.tensor([[0, 1, 2, 3], [4, -1, -1, -1]])
    assert verify._compare_topk("t", want, want.flip(1)) == []  # sets, any order; the -1 padding repeats
    one_swap = torch.tensor([[0, 1, 2, 9], [4, -1, -1, -1]])
    assert verify._compare_topk("t", want, one_swap) == []  # a near tie: one entry of a row may differ
    two = torch.tensor([[0, 1, 8, 9], [4, -1, -1, -1]])
    assert "row 0 misses 2 of its 4 top-k entries (allowed 1)" in verify._compare_topk("t", want, two)[0]
    repeated = torch.tensor([[0, 1, 2, 3], [4, 4, -1, -1]])
    assert "row 1 repeats column(s) [4]" in verify._compare_topk("t", want, repeated)[0]
    zero_filled = torch.tensor([[5, 0, 0, 0]])  # masked to 0 rather than -1: the reference repeats it too
    assert verify._compare_topk("t", zero_filled, zero_filled.flip(1)) == []
    wide = torch.arange(200).view(1, 200)
    assert verify._compare_topk("t", wide, wide.clone().index_fill_(1, torch.tensor([0, 1]), 500)[:, :200]) != []
    assert verify._compare_topk("t", wide, torch.cat([wide[:, 2:], torch.tensor([[700, 701]])], 1)) == []  # 2 of 200


def test_topk_rules_with_the_logits():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.999999, 1.0], [1.0, 1.0, 1.0, 1.0, float("-inf"), float("-inf")]])
    want = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    tied = torch.tensor([[0, 1, 2, 4], [3, 2, 1, 0]])  # 3 and 4 within 1e-3 of the largest magnitude
    assert verify._compare_topk("t", want, tied, logits) == []
    far = torch.tensor([[0, 1, 2, 5], [0, 1, 2, 3]])
    assert "row 0 has column(s) [5] (logits [1.0]) in place of [3] (logits [2.0]): not near ties of the k-th value 2" \
        in verify._compare_topk("t", want, far, logits)[0]
    padded = torch.tensor([[0, 1, 2, 3], [0, 1, 2, -1]])
    assert "row 1 has 3 columns (the rest -1), expected 4" in verify._compare_topk("t", want, padded, logits)[0]
    ties = torch.zeros(1, 400)  # many equal logits: any 200 of them are a top k, though most differ from eager's
    assert verify._compare_topk("t", torch.arange(200)[None], torch.arange(200, 400)[None], ties) == []
    assert verify._compare_topk("t", torch.arange(200)[None], torch.arange(200, 400)[None]) != []  # as sets only


def test_topk_shift_per_row():
    indices = torch.tensor([[7, 9, 8], [2, 0, 1], [4, 5, 6]])
    output = torch.tensor([[2, 4, -1], [2, 0, 1], [-1, -1, -1]])  # rows shifted by 5, 0, none kept (-1 fills)
    shift = verify._row_shift(output, indices)
    assert shift.tolist() == [5, 0, 0]
    assert verify._unshifted(output, shift).tolist() == [[7, 9, -1], [2, 0, 1], [-1, -1, -1]]
    assert verify._row_shift(torch.tensor([[2, 3, 3]]), indices[:1]) is None  # not one shift a row
    assert verify._row_shift(output[:, :2], indices) is None  # not topk's shape


def test_an_unmasked_shifted_topk_output_has_no_fills():
    """``topk(...).indices - ks`` without a mask: an entry of -1 is column ks - 1 (an -inf one, where fewer than k
    columns are visible), not a fill. Which -inf columns fill such a row is unspecified (torch's or the kernel's), so
    the reference may take that column where the compiled graph takes another: both are near ties of -inf."""
    def shifted(logits, ks):
        return torch.topk(logits, 3).indices - ks[:, None]

    def masked(logits, ks):
        values, indices = torch.topk(logits, 3)
        return (indices - ks[:, None]).masked_fill(values == float("-inf"), -1)

    for fn, fills in ((shifted, False), (masked, True)):
        traced = torch.fx.symbolic_trace(fn)
        for node in traced.graph.nodes:
            node.meta["example_value"] = torch.empty(1, 6) if node.name == "logits" else None
        assert verify._topk_outputs(traced) == {0: verify._TopkPath(
            next(n for n in traced.graph.nodes if n.name == "topk"), True, fills)}
    logits = torch.tensor([[float("-inf")] * 3 + [1.0] + [float("-inf")] * 2])
    indices, want, have = torch.tensor([[3, 2, 5]]), torch.tensor([[0, -1, 2]]), torch.tensor([[0, 1, 2]])
    shift = verify._row_shift(want, indices, fills=False)
    assert verify._unshifted(want, shift, fills=False).tolist() == [[3, 2, 5]]
    assert verify._compare_topk("t", verify._unshifted(want, shift, False), verify._unshifted(have, shift, False),
                                logits) == []
    assert "has 3 columns (the rest -1), expected 2" in verify._compare_topk(
        "t", verify._unshifted(want, shift), verify._unshifted(have, shift), logits)[0]  # read as a mask's fill


@given(st.data())
def test_shifted_topk_outputs_are_compared_as_their_columns(data):
    """A prefill-style top-k output (columns minus the row's first visible column, -inf entries -1) in any order, or
    with another column of the k-th value, is the reference's after its shift is added back; one entry replaced by a
    column far below the k-th value is not."""
    rows, cols = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 12))
    k = data.draw(st.integers(1, cols))
    logits = torch.tensor(data.draw(st.lists(st.lists(st.sampled_from([0.0, 1.0, 2.5, 3.0, 9.0]), min_size=cols,
                                                      max_size=cols), min_size=rows, max_size=rows)))
    offset = torch.tensor(data.draw(st.lists(st.integers(0, cols - 1), min_size=rows, max_size=rows)))
    logits[torch.arange(cols)[None, :] < offset[:, None]] = float("-inf")
    values, indices = logits.topk(k)
    want = (indices - offset[:, None]).masked_fill(values == float("-inf"), -1)
    have = torch.stack([row[torch.randperm(k, generator=torch.Generator().manual_seed(r))]
                        for r, row in enumerate(want)])
    shift = verify._row_shift(want, indices)
    assert verify._compare_topk("t", verify._unshifted(want, shift), verify._unshifted(have, shift), logits) == []
    tied = [(r, c) for r in range(rows) for c in range(cols) if c not in indices[r].tolist()
            and logits[r, c] == values[r, -1] > float("-inf")]
    if tied:  # another column of the k-th value in place of the reference's: a tie, allowed
        r, c = tied[0]
        swapped = want.clone()
        swapped[r, -1] = c - offset[r]
        assert verify._compare_topk("t", verify._unshifted(want, shift), verify._unshifted(swapped, shift),
                                    logits) == []
    far = [(r, c) for r in range(rows) for c in range(cols) if c not in indices[r].tolist()
           and logits[r, c] < values[r, -1] - 1.0 and (want[r] >= 0).any()]
    if far:
        r, c = far[0]
        wrong = want.clone()
        wrong[r, int((want[r] >= 0).nonzero()[0])] = c - offset[r]
        problems = verify._compare_topk("t", verify._unshifted(want, shift), verify._unshifted(wrong, shift), logits)
        assert problems and f"row {r} has " in problems[0]  # (column offset - 1 reads as a -1: a count too few)


@pytest.mark.parametrize("extra, message", [((), "1 outputs, the unrewritten graph has 2"),
                                            ((3,), "output 1 is 3, expected torch.float32 \\[3, 5\\]")])
def test_a_missing_or_wrong_typed_output_is_named(extra, message):
    """A compiled graph whose top-k's logits output is missing or not a tensor: a VerifyError naming it."""
    def step(x):
        logits = x * 2
        return torch.topk(logits, 2).indices, logits

    traced = torch.fx.symbolic_trace(step)
    for node in traced.graph.nodes:
        node.meta["example_value"] = torch.empty(3, 5) if node.name == "mul" else None
    run = verify.verified(lambda x: (torch.topk(x * 2, 2).indices, *extra), verify.reference_graph(traced), 1, None,
                          set(), LAYOUT_DECISION)
    with pytest.raises(verify.VerifyError, match=message):
        run(torch.randn(3, 5))


def test_options():
    from nsa_inductor.options import parse_options

    assert parse_options({"nsa.verify": 3})[0].verify == 3
    with pytest.raises(ValueError, match="number of calls >= 0"):
        parse_options({"nsa.verify": -1})
    with pytest.raises(ValueError, match="nsa.verify needs the nsa_rocm backend"):
        nsa_inductor.install({"nsa.verify": True})
