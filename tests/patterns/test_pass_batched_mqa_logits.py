"""batched_mqa_logits: Hugging Face's indexer scoring (fp32 matmuls of upcast bf16/fp16 q and k, relu, a matmul
with the head weights) becomes one nsa.batched_mqa_logits call; near misses keep the matmuls."""

import re

import pytest
import torch
import torch.nn.functional as F

import nsa_inductor
from nsa_inductor.patterns.batched_mqa_logits import BatchedMqaLogits
from helpers import pass_helpers
from helpers.reference64 import assert_logits_close

D = 64
SCALE = D**-0.5


def hf(q, k, w):
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE
    return torch.matmul(w.unsqueeze(-2), F.relu(scores)).squeeze(-2)


def relu_of_scaled(q, k, w):
    scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


def scaled_after_relu(q, k, w):
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1))) * SCALE
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


def scale_in_weights(q, k, w):
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)))
    return torch.matmul((w * SCALE).unsqueeze(-2), scores).squeeze(-2)


def heads_flattened(q, k, w):
    b, s, h, _ = q.shape
    scores = torch.matmul(q.flatten(1, 2).float(), k.transpose(-1, -2).float()) * SCALE
    scores = F.relu(scores).view(b, s, h, k.shape[1])
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


def scores_transposed(q, k, w):
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
    return torch.matmul(scores.transpose(-1, -2), w.unsqueeze(-1)).squeeze(-1)


def weights_reversed(q, k, w):  # the weights a computed tensor, read as [B, S, H]
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)))
    return torch.matmul(w.flip(-1).unsqueeze(-2), scores).squeeze(-2)


def first_entrys_keys(q, k, w):  # every batch entry scores k[0]: one batch entry of B * S rows to the op
    scores = F.relu(torch.matmul(q.float(), k[:1].transpose(-1, -2).float().unsqueeze(1)))
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


def heads_summed(q, k, w):  # the head sum a sum over the head dim of a product
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
    return (scores * w.unsqueeze(-1)).sum(dim=2)


def einsum_heads_first(q, k, w):  # DeepGEMM's reference order: scores [H, B*S, T] of q [B*S, H, D], one K per entry
    scores = torch.einsum("bshd,btd->hbst", q.float(), k.float())
    return (F.relu(scores * SCALE) * w.permute(2, 0, 1).unsqueeze(-1)).sum(dim=0)


SPELLINGS = [hf, relu_of_scaled, scaled_after_relu, scale_in_weights, heads_flattened, scores_transposed,
             weights_reversed, first_entrys_keys, heads_summed, einsum_heads_first]


def inputs(batch, tokens, heads, keys, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, tokens, heads, D, generator=gen).to(dtype),
            torch.randn(batch, keys, D, generator=gen).to(dtype), torch.randn(batch, tokens, heads, generator=gen))


def count_ops(gm) -> tuple[int, int]:
    nodes = list(gm.graph.nodes)
    return (sum(n.target is torch.ops.aten.bmm.default for n in nodes),
            sum(n.target is torch.ops.nsa.batched_mqa_logits.default for n in nodes))


def rewritten(fn, *args):
    """``(the graph module after the pass, the pass's result, eager's output)``."""
    gm = pass_helpers.functional_graph(fn, *args)
    before = gm(*args)
    result = BatchedMqaLogits()(gm.graph, None)
    gm.graph.lint()
    gm.recompile()
    return gm, result, before


def run_pass(fn, *args):
    gm, result, before = rewritten(fn, *args)
    return result, before, gm(*args), count_ops(gm)


@pytest.mark.parametrize("fn", SPELLINGS)
@pytest.mark.parametrize("batch, tokens, heads, keys", [(2, 3, 4, 16), (1, 1, 4, 16), (3, 1, 2, 5), (1, 5, 3, 2)])
def test_fires_on_each_spelling_and_keeps_the_logits(fn, batch, tokens, heads, keys):
    result, before, after, (bmms, ops) = run_pass(fn, *inputs(batch, tokens, heads, keys))
    assert (result.matched, result.near_misses, bmms, ops) == (1, [], 0, 1)
    assert_logits_close(after, before, rtol=1e-6)


def tensor_scale(q, k, w, scale):  # the scale a graph input, as Dynamo passes an unspecialised float
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale)
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


def tensor_scale_then_number(q, k, w, scale):
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * 0.5 * scale)
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


def number_then_tensor_scale(q, k, w, scale):  # (dot * t) * 0.5: the kernel's dot * 0.5 * t would round otherwise
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale * 0.5)
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


@pytest.mark.parametrize("fn, fires", [(tensor_scale, True), (tensor_scale_then_number, True),
                                       (number_then_tensor_scale, False)])
def test_a_0d_tensor_scale_inside_the_relu(fn, fires):
    result, before, after, (bmms, ops) = run_pass(fn, *inputs(2, 3, 4, 9), torch.tensor(0.3))
    assert (result.matched, bmms, ops) == ((1, 0, 1) if fires else (0, 2, 0))
    if fires:
        assert_logits_close(after, before, rtol=1e-6)
    else:
        (miss,) = result.near_misses
        assert "inside it, one 0-d fp32 tensor applied after them" in miss["reason"]


def test_fp16_operands():
    result, before, after, counts = run_pass(hf, *inputs(2, 2, 4, 9, torch.float16))
    assert (result.matched, counts) == (1, (0, 1))
    assert_logits_close(after, before, rtol=1e-6)


def relu_scaled_by_a_negative(q, k, w):
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1))) * -0.5
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


def scores_times_a_tensor(q, k, w):
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)))
    return torch.matmul(w.unsqueeze(-2), scores * k[:, None, None, :, 0].float()).squeeze(-2)


def fp32_q(q, k, w):
    scores = F.relu(torch.matmul(q.float().exp(), k.transpose(-1, -2).float().unsqueeze(1)))
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


def q_heads_first(q, k, w):  # q given as [B, H, S, D]: not the op's row-major order
    scores = F.relu(torch.matmul(q.transpose(1, 2).float(), k.transpose(-1, -2).float().unsqueeze(1)))
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


def two_weight_rows(q, k, w):
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)))
    return torch.matmul(torch.stack([w, -w], -2), scores)


def mixed_types(q, k, w):
    scores = F.relu(torch.matmul(q.float(), k.half().transpose(-1, -2).float().unsqueeze(1)))
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


@pytest.mark.parametrize("fn, q_shape, reason", [
    (relu_scaled_by_a_negative, None, "multiplied by -0.5 after it: folded are numbers"),
    (scores_times_a_tensor, None, r"multiplied by \w+ \([\w.]+\) after it: folded are numbers"),
    (fp32_q, None, r"the dot's first operand is exp \(exp.default\) of float32"),
    (q_heads_first, (2, 4, 3, D), r"q \(q\w* \(placeholder\) \[2, 4, 3, 64\]\) is not read as \[B, S, H, D\]"),
    (two_weight_rows, None, "with 2 weight rows, expected one"),
    (mixed_types, None, "q is torch.bfloat16 and k torch.float16"),
])
def test_near_misses_keep_the_matmuls(fn, q_shape, reason):
    q, k, w = inputs(2, 3, 4, 7)
    if q_shape is not None:
        q = torch.randn(q_shape).bfloat16()
    result, _, _, (bmms, ops) = run_pass(fn, q, k, w)
    assert (result.matched, ops) == (0, 0) and bmms == 2
    (miss,) = result.near_misses
    assert re.search(reason, miss["reason"]), miss["reason"]


def shared_keys(q, k, w):  # one K [T, D] for every row (a ragged prefill's keys): one batch entry of B * S rows
    scores = torch.einsum("mhd,nd->hmn", q.flatten(0, 1).float(), k[0].float())
    return (scores.relu() * w.flatten(0, 1).T.unsqueeze(-1)).sum(dim=0)


def test_one_k_for_every_row():
    q, k, w = inputs(2, 3, 4, 9)
    result, before, after, (bmms, ops) = run_pass(shared_keys, q, k, w)
    assert (result.matched, result.near_misses, bmms, ops) == (1, [], 0, 1)
    assert_logits_close(after, before, rtol=1e-6)


def keys_summed(q, k, w):  # a sum over the keys: no head sum
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)))
    return (scores * w.unsqueeze(-1)).sum(dim=-1)


def gelu_scores(q, k, w):
    scores = F.gelu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)))
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


def fp8_logits(q, k, w):  # the fp8 MQA passes' idiom: their report, not this pass's
    scores = F.relu(torch.matmul(q.to(torch.float8_e4m3fn).float(), k.to(torch.float8_e4m3fn).transpose(-1, -2)
                                 .float().unsqueeze(1)))
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


def fp8_logits_key_scaled(q, k, w):  # with the keys' scales after the relu, as the reference indexer sums its heads
    scores = F.relu(torch.matmul(q.to(torch.float8_e4m3fn).float(), k.to(torch.float8_e4m3fn).transpose(-1, -2)
                                 .float().unsqueeze(1)))
    return (scores * k[:, None, None, :, 0].float().abs() * w.unsqueeze(-1)).sum(2)


@pytest.mark.parametrize("fn", [gelu_scores, fp8_logits, fp8_logits_key_scaled, keys_summed])
def test_other_activations_fp8_dots_and_other_sums_are_not_candidates(fn):
    gm = pass_helpers.functional_graph(fn, *inputs(2, 3, 4, 7))
    before = count_ops(gm)
    result = BatchedMqaLogits()(gm.graph, None)
    assert (result.matched, result.near_misses, count_ops(gm)) == (0, [], before)


@pytest.mark.parametrize("heads, keys", [(1, 7), (4, 1)])
def test_one_head_or_one_key_is_left_alone(heads, keys):
    """With one head (or one key) torch's matmul with the weights is a product (or a sum of products), not a bmm:
    nothing to rewrite; the compiled function stays eager's."""
    result, before, after, (bmms, ops) = run_pass(hf, *inputs(2, 3, heads, keys))
    assert (result.matched, result.near_misses, bmms, ops) == (0, [], 1, 0)
    assert torch.equal(before, after)


def hf_topk(q, k, w, mask):
    scores = hf(q, k, w).masked_fill(~mask, float("-inf"))
    return scores.topk(min(8, scores.shape[-1]), dim=-1).indices.to(torch.int32)


@pytest.fixture(scope="module")
def compiled_hf_topk():
    torch._dynamo.reset()
    return torch.compile(hf_topk, backend="nsa_rocm", dynamic=True)


@pytest.mark.parametrize("batch, tokens, keys", [(3, 1, 40), (5, 1, 33), (1, 1, 40), (2, 4, 24), (1, 6, 6)])
def test_compiled_indexer_picks_eagers_top_k(compiled_hf_topk, batch, tokens, keys):
    """One dynamic compile over B, S and T (then Dynamo's size-1 graphs): both rewrites fire, and each row's picks
    are eager's as a set."""
    q, k, w = inputs(batch, tokens, 4, keys, seed=batch * 100 + keys)
    mask = torch.arange(keys)[None, None, :] < torch.randint(1, keys + 1, (batch, tokens, 1))
    got = compiled_hf_topk(q, k, w, mask)
    want = hf_topk(q, k, w, mask)
    assert got.shape == want.shape and got.dtype == torch.int32
    scores = hf(q, k, w).masked_fill(~mask, float("-inf")).flatten(0, 1)
    for row, g, e in zip(scores, got.flatten(0, 1).long(), want.flatten(0, 1).long()):
        finite = set(e[row[e].isfinite()].tolist())
        assert finite <= set(g.tolist()), (finite, g)
    (report,) = nsa_inductor.last_reports()[-1:]
    matched = {p["name"]: p["matched"] for p in report["passes"]}
    assert matched["batched_mqa_logits"] == 1 and matched["topk_indices"] == 1


def test_a_batch_of_one_as_inductors_gpu_graph_has_it(monkeypatch):
    """On GPUs Inductor's joint-graph pass turns a bmm of batch 1 into an mm (``bmm_to_mm``; forced here on the
    CPU): one sequence's decode step is rewritten all the same, and equals eager."""
    from torch._inductor.fx_passes import joint_graph

    monkeypatch.setattr(joint_graph, "check_device", lambda *unused: True)
    torch._dynamo.reset()
    q, k, w = inputs(1, 1, 4, 40)
    mask = torch.arange(40)[None, None, :] < 33
    got = torch.compile(hf_topk, backend="nsa_rocm", dynamic=False)(q, k, w, mask)
    (report,) = nsa_inductor.last_reports()[-1:]
    matched = {p["name"]: p["matched"] for p in report["passes"]}
    assert matched["batched_mqa_logits"] == 1 and matched["topk_indices"] == 1, report["passes"]
    assert set(got.flatten().tolist()) == set(hf_topk(q, k, w, mask).flatten().tolist())


def hf_topk_with_scores(q, k, w, mask):  # transformers' newest indexer returns the top-k scores too
    scores = hf(q, k, w).masked_fill(~mask, float("-inf"))
    values, indices = scores.topk(min(8, scores.shape[-1]), dim=-1)
    return indices.to(torch.int32), values


def test_compiled_indexer_returning_its_scores():
    """Both rewrites fire; the scores returned are the logits at the op's picks, eager's within the logits'
    tolerance, in descending order."""
    torch._dynamo.reset()
    q, k, w = inputs(2, 3, 4, 24)
    mask = torch.arange(24)[None, None, :] < torch.randint(1, 25, (2, 3, 1))
    got_indices, got_values = torch.compile(hf_topk_with_scores, backend="nsa_rocm")(q, k, w, mask)
    (report,) = nsa_inductor.last_reports()[-1:]
    matched = {p["name"]: p["matched"] for p in report["passes"]}
    assert matched["batched_mqa_logits"] == 1 and matched["topk_indices"] == 1, report["passes"]
    want_indices, want_values = hf_topk_with_scores(q, k, w, mask)
    assert got_indices.dtype == torch.int32 and got_indices.shape == want_indices.shape
    finite = want_values.isfinite()
    assert torch.equal(got_values.isfinite(), finite)
    assert torch.allclose(got_values[finite], want_values[finite], rtol=1e-5, atol=1e-6)
    assert bool((got_values[..., :-1] >= got_values[..., 1:]).all())


def masked_fill_kept(q, k, w, mask):  # Hugging Face's spelling
    return hf(q, k, w).masked_fill(~mask, float("-inf"))


def where_kept(q, k, w, mask):
    return torch.where(mask, hf(q, k, w), float("-inf"))


def masked_fill_dropped(q, k, w, mask):  # the mask marks what is dropped: the op gets its negation
    return hf(q, k, w).masked_fill(mask, float("-inf"))


def logical_not_kept(q, k, w, mask):
    return hf(q, k, w).masked_fill(torch.logical_not(mask), float("-inf"))


def masked_before_the_squeeze(q, k, w, mask):  # the mask on [B, S, 1, T], squeezed after
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
    logits = torch.matmul(w.unsqueeze(-2), scores)
    return logits.masked_fill(~mask.unsqueeze(-2), float("-inf")).squeeze(-2)


def filled_with_the_least_float(q, k, w, mask):  # finite fills, as several ports write them
    return hf(q, k, w).masked_fill(~mask, torch.finfo(torch.float32).min)


def filled_with_zero(q, k, w, mask):
    return torch.where(mask, hf(q, k, w), 0.0)


def causal_in_the_graph(q, k, w, unused):  # the causal mask computed in the graph
    tokens, keys = q.shape[1], k.shape[1]
    causal = torch.arange(keys)[None] <= torch.arange(tokens)[:, None] + keys - tokens
    return hf(q, k, w).masked_fill(~causal, float("-inf"))


def masks(batch, tokens, keys, seed=0):
    """Masks as indexers hold them: ``[B, S, T]`` (random), ``[B, 1, T]`` (a context length an entry), ``[S, T]``
    (causal, the last row seeing every key), ``[T]``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, keys + 1, (batch, 1, 1), generator=gen)
    return {"full": torch.rand(batch, tokens, keys, generator=gen) < 0.6,
            "entry": torch.arange(keys)[None, None] < lengths,
            "causal": torch.arange(keys)[None] <= torch.arange(tokens)[:, None] + keys - tokens,
            "keys": torch.rand(keys, generator=gen) < 0.5}


def masked_pass(fn, *args):
    """``(result, eager's output, the rewritten graph's, the masks of its nsa.batched_mqa_logits calls, wheres)``."""
    gm, result, before = rewritten(fn, *args)
    nodes = list(gm.graph.nodes)
    op_masks = [n.args[5] if len(n.args) > 5 else None for n in nodes
                if n.target is torch.ops.nsa.batched_mqa_logits.default]
    return result, before, gm(*args), op_masks, sum(n.target is torch.ops.aten.where.self for n in nodes)


@pytest.mark.parametrize("fn, mask_kind, batch, tokens, keys", [
    (masked_fill_kept, "entry", 2, 3, 16), (masked_fill_kept, "full", 1, 1, 7), (masked_fill_kept, "causal", 1, 5, 9),
    (masked_fill_kept, "keys", 3, 1, 16), (where_kept, "entry", 1, 1, 7), (where_kept, "causal", 2, 3, 16),
    (masked_fill_dropped, "full", 2, 3, 16), (masked_fill_dropped, "entry", 1, 1, 7),
    (logical_not_kept, "keys", 2, 3, 16), (masked_before_the_squeeze, "entry", 2, 3, 16),
    (masked_before_the_squeeze, "causal", 1, 1, 7), (filled_with_the_least_float, "entry", 2, 3, 16),
    (filled_with_zero, "full", 1, 1, 7)])
def test_the_mask_becomes_the_ops(fn, mask_kind, batch, tokens, keys):
    """The mask folds into the op (no where left) in every spelling, broadcast shape and fill; the fill exactly where
    eager has it, the rest eager's logits."""
    q, k, w = inputs(batch, tokens, 4, keys)
    result, before, after, (op_mask,), wheres = masked_pass(fn, q, k, w, masks(batch, tokens, keys)[mask_kind])
    assert (result.matched, wheres) == (1, 0) and op_mask is not None
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)  # (fills equal, infinite or not)


def test_a_mask_the_graph_computes():
    result, before, after, (op_mask,), wheres = masked_pass(causal_in_the_graph, *inputs(2, 3, 4, 16), None)
    assert (result.matched, wheres) == (1, 0) and op_mask is not None
    assert_logits_close(after, before, rtol=1e-6)


def filled_with_a_tensor(q, k, w, mask):
    return torch.where(mask, hf(q, k, w), w.sum(-1, keepdim=True))


def unmasked_scores_returned_too(q, k, w, mask):
    logits = hf(q, k, w)
    return logits.masked_fill(~mask, float("-inf")), logits


def masked_transposed(q, k, w, mask):  # a permute between the logits and the mask: not folded (it could be)
    return hf(q, k, w).transpose(0, 1).masked_fill(~mask.transpose(0, 1), float("-inf"))


def additive_mask(q, k, w, mask):
    return hf(q, k, w) + torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))


@pytest.mark.parametrize("fn", [filled_with_a_tensor, unmasked_scores_returned_too, masked_transposed, additive_mask])
def test_other_masks_stay_in_the_graph(fn):
    """A fill that is no number, scores also used unmasked, a mask over other than reshapes of the logits, an additive
    mask: the op fires without a mask and the graph keeps the rest, eager's values."""
    result, before, after, (op_mask,), _ = masked_pass(fn, *inputs(2, 3, 4, 16), masks(2, 3, 16)["full"])
    assert result.matched == 1 and op_mask is None
    for got, want in [(after, before)] if isinstance(before, torch.Tensor) else zip(after, before):
        assert_logits_close(got, want, rtol=1e-6)


def test_a_mask_whose_sizes_cannot_be_expressed_stays(monkeypatch):
    """Where a size of the where's shape is no input's (``size_arg`` gives up), the where stays and the size nodes made
    before are erased."""
    from nsa_inductor.patterns import batched_mqa_logits as module

    made = []

    def second_size_fails(graph, size, sources):
        if made:
            raise module.NearMiss("cannot express it")
        made.append(module.insert_call(graph, torch.ops.aten.sym_size.int, (sources[0], 0)))
        return made[-1]

    def fold_mask(graph, op, fold=module._fold_mask):
        with monkeypatch.context() as patch:
            patch.setattr(module, "size_arg", second_size_fails)
            fold(graph, op)

    monkeypatch.setattr(module, "_fold_mask", fold_mask)
    result, before, after, (op_mask,), wheres = masked_pass(masked_fill_kept, *inputs(2, 3, 4, 16),
                                                            masks(2, 3, 16)["entry"])
    assert (result.matched, op_mask, wheres) == (1, None, 1) and made and made[0]._erased
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_the_mask_folds_in_a_dynamic_compile():
    """Symbolic B, S and T: the broadcast mask is expanded by the graph's sizes; compiled equals eager."""
    torch._dynamo.reset()
    compiled, dump_dir = pass_helpers.compile_with_dumps(masked_fill_kept, dynamic=True)
    for batch, tokens, keys in [(2, 3, 16), (3, 2, 24)]:
        q, k, w = inputs(batch, tokens, 4, keys)
        mask = masks(batch, tokens, keys)["entry"]
        assert_logits_close(compiled(q, k, w, mask), masked_fill_kept(q, k, w, mask), rtol=1e-6)
    graph = pass_helpers.graph_dirs(dump_dir)[-1]
    _, after = pass_helpers.pass_graphs(graph, "batched_mqa_logits")
    assert pass_helpers.count_ops(after, "aten.where") == 0 and "sym_size" in after
    assert pass_helpers.count_ops(after, "nsa.batched_mqa_logits") == 1
